"""The engines the :class:`~ds_twocircuit.trainer.Trainer` drives.

* :class:`~ds_twocircuit.adapters.engine.PipelineEngine` -- DeepSpeed's pipeline engine with coded
  boundaries and a pluggable DP backend, one process per stage and replica (``launch/train.py``).
* :class:`~ds_twocircuit.engines.reference.ReferenceEngine` -- one process: the whole Hugging Face
  model, the same codec objects at the same boundaries, DP replicas simulated in-process (a model,
  optimizer and DP backend per replica over an in-process communicator), the anchor in-process
  (the quality studies; the equivalence tests compare the two on the same config file).

What the trainer asks of an engine (both implement exactly this)::

    kind                      "pipeline" | "reference"
    codec                     the Codec of this process's links (describe, keep, identity)
    global_steps, mask_seed, timing (dict of seconds: dp_s, ...), step_stats (the last step's DP stats)
    start_broadcast_bytes     bytes this process received in a start-up weight broadcast
    set_train_data(seqs, start_step)
    train_batch() -> float    one optimizer step; the mean training loss over replicas and micro-batches
    eval_losses(seqs, calls, dense, bar) -> list[float]   held-out loss of each global batch
    keep_fraction(step, hidden), lr()
    anchor_link(world)        the anchor circuit's link (publish, poll, step_stats, finish) or None
    save_checkpoint(dir, fault) -> tag folder / load_checkpoint(path) -> step
    finalize() -> bool        end of training: finish DP syncs, average drifted replicas once
    replicas_identical() -> bool | None
    parameter_counts() -> (trainable, total)   this process's share (summed over the world)
    export_hf(folder, world) -> folder | None   the adapted model as a Hugging Face folder
"""


def build_optimizer(plan, params):
    """The config's optimizer (``plan.optimizer``: a ``torch.optim`` class name and its arguments)
    over ``params``; both engines build it here."""
    import torch
    name, kw = plan.optimizer
    cls = getattr(torch.optim, name)
    params = list(params)
    if name in ("Adam", "AdamW") and params and all(p.is_cuda for p in params):
        kw = {**kw, "fused": True}     # by where the parameters are, not by what the host has
    return cls(params, **kw)


def rescale_resumed_lr(optimizer, dp_cfg, old_replicas: int, new_replicas: int) -> None:
    """A checkpoint's optimizer state brings its learning rates, scaled for the width it was saved
    at (``twocircuit.dp.inner_lr_scale``); on another DP width they are rescaled to this one's, as a
    fresh run at this width would have them. Nothing changes at the same width (bit-exact resume)."""
    if old_replicas == new_replicas:
        return
    ratio = dp_cfg.inner_lr_factor(new_replicas) / dp_cfg.inner_lr_factor(old_replicas)
    if ratio != 1.0:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * ratio
