"""Every private DeepSpeed (and torch.distributed) name the adapters override, call or read.

DeepSpeed offers no public hook for what the adapters do (send a coded tensor at a pipeline
boundary, run a DP backend between the gradient boundary and the optimizer step, choose the stage
boundaries), so they override or call these names. All such uses live in this folder; this list
names each one and where it is used, and ``tests/test_structure.py`` fails when the installed
DeepSpeed is not the version they were checked against, or when a name is gone or its signature
changed. On a new DeepSpeed: re-read each method below in its source, then update
``CHECKED_VERSION`` and the recorded signatures.
"""
from __future__ import annotations

CHECKED_VERSION = "0.19.8"

PIPE_ENGINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
PIPE_MODULE = "deepspeed.runtime.pipe.module.PipelineModule"
ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"

# (owner, name) -> (the parameters of the method we override, where and why)
OVERRIDDEN = {
    (PIPE_ENGINE, "_INSTRUCTION_MAP"): (None, "pipeline_engine.MaskedPipelineEngine and "
                                        "anchor_circuit.AnchorPipelineEngine rebuild it: it binds the "
                                        "functions below when PipelineEngine's class is created"),
    (PIPE_ENGINE, "_exec_send_activations"): (["self", "buffer_id"], "the boundary codec (send)"),
    (PIPE_ENGINE, "_exec_recv_activations"): (["self", "buffer_id"], "the boundary codec (receive)"),
    (PIPE_ENGINE, "_exec_send_grads"): (["self", "buffer_id"], "the boundary codec (send)"),
    (PIPE_ENGINE, "_exec_recv_grads"): (["self", "buffer_id"], "the boundary codec (receive)"),
    (PIPE_ENGINE, "_exec_forward_pass"): (["self", "buffer_id"], "compute timing; reference = base: a "
                                          "middle stage reads its token ids, the base activation is added"),
    (PIPE_ENGINE, "set_dataiterator"): (["self", "iterator"], "reference = base: a middle stage keeps the "
                                        "data stream (DeepSpeed gives it to the first and last stages only; "
                                        "eval_batch swaps its iterator in and back through it)"),
    (PIPE_ENGINE, "_exec_backward_pass"): (["self", "buffer_id"], "compute timing"),
    (PIPE_ENGINE, "_exec_reduce_tied_grads"): (["self"], "tied-weight bytes counted"),
    (PIPE_ENGINE, "_exec_reduce_grads"): (["self"], "the DP backend replaces the all-reduce"),
    (PIPE_ENGINE, "_exec_optimizer_step"): (["self", "lr_kwargs"], "DiLoCo's outer step after it"),
    (PIPE_MODULE, "_partition_layers"): (["self", "method"], "pipe_module.TwoCircuitPipe: stage "
                                         "boundaries by layer cost"),
    (ENGINE, "_broadcast_model"): (["self"], "pipeline_engine.MaskedPipelineEngine: the start-up "
                                   "broadcast is skipped when a DP group's replicas already agree"),
    (ENGINE, "_take_model_step"): (["self", "lr_kwargs"],
                                   "plain_engine.attach_dp_backend wraps it on the instance: the DP "
                                   "sync must come before DeepSpeed's gradient clipping inside it, "
                                   "so an optimizer step pre-hook would be too late"),
}

# (owner, name): private names the adapters call or read (``self.<name>`` for instance attributes)
USED = {
    (PIPE_ENGINE, "_send_tensor_meta"): "pipeline_engine: the shape handshake of the first send",
    (PIPE_ENGINE, "_recv_tensor_meta"): "pipeline_engine: the shape handshake of the first receive",
    (PIPE_ENGINE, "_force_grad_boundary"): "pipeline_engine: set around the DP backend's reduction",
    (PIPE_ENGINE, "_next_batch"): "pipeline_engine: a middle stage's token ids (reference = base)",
    (PIPE_ENGINE, "data_iterator"): "pipeline_engine: a middle stage's data stream (reference = base)",
    (PIPE_MODULE, "_set_bounds"): "pipe_module: stage boundaries",
    (PIPE_MODULE, "_topo"): "pipe_module: this rank's stage",
    (PIPE_MODULE, "_local_start"): "anchor_circuit: which layer files a stage writes",
    (PIPE_MODULE, "_local_stop"): "anchor_circuit: which layer files a stage writes",
    (PIPE_MODULE, "_recursive_getattr"): "pipe_module.mark_stage_parameters: tied copies",
    (ENGINE, "_get_ckpt_name"): "catchup.stage_files: the engine state file a stage loads",
    (ENGINE, "seq_data_parallel_group"): "pipeline_engine: the DP group, before self.grid exists",
    (ENGINE, "dist_backend"): "pipeline_engine: no broadcast without a backend",
    (ENGINE, "_config"): "plain_engine: the twocircuit section of the engine's config",
    ("deepspeed.utils.groups", "_get_data_parallel_group"): "plain_engine and accelerate.replicas_identical: the DP group",
    ("deepspeed.comm.torch", "build_shm_op"): "dist.prepare_runtime: skips a 1-minute JIT build on CPU",
    ("torch.distributed.distributed_c10d", "default_pg_timeout"): "dist.init_world: --peer-timeout "
                                                                   "for DeepSpeed's own groups",
}
