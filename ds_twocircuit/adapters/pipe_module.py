"""DeepSpeed adapter: the pipeline layers of ``layers.py`` as a ``PipelineModule``.

Only the layers of the local stage are built (LayerSpec), and their weights are read tensor by
tensor from the Hugging Face folder. Partitioning comes from :func:`layers.partition_parts` so the
single-process reference and masked inference place boundaries exactly where the engine does.
"""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from ..models.layers import (DecoderPipe, EmbedPipe, HeadPipe, ModelSpec, NormPipe, PIPE_LAYER_TYPES,
                             WeightReader, causal_lm_loss, hf_state_of, load_layer_weights,
                             tied_head_forward)


class TwoCircuitPipe(PipelineModule):
    """PipelineModule whose stage boundaries come from :func:`partition_parts`."""

    def __init__(self, layers, spec: ModelSpec, partition: str, **kw):
        self._tc_spec = spec
        self._tc_partition = partition
        super().__init__(layers, **kw)

    def _partition_layers(self, method="uniform"):
        self.parts = self._tc_spec.parts(self.num_stages, self._tc_partition)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def layer_specs(spec: ModelSpec, tied_mode: str) -> list:
    """``tied_mode`` for models with tied embeddings: ``sync`` keeps one tied weight (its gradient
    is all-reduced between the first and last stage every step), ``untie`` gives the head its own
    copy (no traffic; saved untied), ``freeze`` keeps it tied and frozen (no traffic)."""
    tied = spec.tied and tied_mode in ("sync", "freeze")
    specs = [TiedLayerSpec("embed", EmbedPipe, spec, tied_weight_attr=["embed_tokens.weight"]) if tied
             else LayerSpec(EmbedPipe, spec)]
    specs += [LayerSpec(DecoderPipe, spec, i) for i in range(spec.num_layers)]
    specs.append(LayerSpec(NormPipe, spec))
    if tied:
        specs.append(TiedLayerSpec("embed", EmbedPipe, spec, forward_fn=tied_head_forward,
                                   tied_weight_attr=["embed_tokens.weight"]))
    else:
        specs.append(LayerSpec(HeadPipe, spec))
    return specs


def build_pipeline(spec: ModelSpec, num_stages: int, partition: str = "balanced",
                   tied_mode: str = "untie", dtype=torch.float32, lora=None, seed: int = 0) -> TwoCircuitPipe:
    """This rank's stage of the model; ``lora`` (a ``LoRAConfig`` with ``r > 0``): only LoRA
    adapters on the decoder projections train (``ds_twocircuit.lora``)."""
    module = TwoCircuitPipe(layer_specs(spec, tied_mode), spec=spec, partition=partition, num_stages=num_stages, loss_fn=causal_lm_loss,
                            partition_method="type:DecoderPipe", activation_checkpoint_interval=0)
    reader = WeightReader(spec.folder)
    for m in module.modules():
        if isinstance(m, PIPE_LAYER_TYPES):
            load_layer_weights(m, spec, reader)
    module.to(dtype)
    if spec.tied and tied_mode == "freeze":
        for m in module.modules():
            if isinstance(m, EmbedPipe):
                m.embed_tokens.weight.requires_grad_(False)
    if lora is not None and lora.enabled:
        from ..lora import add_lora
        add_lora(module, [(m.layer, f"model.layers.{m.layer_idx}.") for m in module.modules()
                          if isinstance(m, DecoderPipe)], lora, seed)
    mark_stage_parameters(module)
    return module


def stage_adapter_state(module: TwoCircuitPipe) -> dict[str, torch.Tensor]:
    """This stage's LoRA adapter weights under the names of a saved PEFT adapter."""
    from ..lora import adapter_state
    out = {}
    for m in module.modules():
        if isinstance(m, DecoderPipe):
            out.update(adapter_state(m.layer, f"model.layers.{m.layer_idx}."))
    return out


def mark_stage_parameters(module) -> None:
    """DeepSpeed's gradient norm over a pipeline (``clip_grad_norm_``, the fp16/bf16 overflow and
    norm checks, ZeRO-1) sums over the stages of a replica but counts a parameter on a stage other
    than the first only if it is marked ``model_parallel`` (Megatron's convention for tensor-sliced
    weights): unmarked, the clipping norm is stage 0's alone and every stage is clipped by it.
    Each stage holds its own slice of the model, so every parameter is marked; a tied weight held
    by several stages (``tied_embeddings = sync``) is counted once, by the lowest rank holding it."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    copies = set()
    for comm in getattr(module, "tied_comms", {}).values():
        if rank != min(comm["ranks"]):
            for attr in comm["weight_attr"]:
                copies.add(id(module._recursive_getattr(comm["module"], attr)))
    for p in module.parameters():
        p.model_parallel = id(p) not in copies


def stage_hf_state(module: TwoCircuitPipe, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """This stage's weights under their Hugging Face names (tied modules once)."""
    out = {}
    for m in module.modules():
        if isinstance(m, PIPE_LAYER_TYPES):
            sd = m.state_dict()
            for local, hf in hf_state_of(m, spec).items():
                out[hf] = sd[local].detach().to("cpu").clone()
    return out


def hf_named_parameters(module: TwoCircuitPipe, spec: ModelSpec) -> list[tuple[str, torch.nn.Parameter]]:
    """This stage's trainable parameters under their Hugging Face names, in module order: the DP
    backends key their state (and PowerSGD its random starts) by name, so a stage names its
    parameters as the single-process reference engine's model does and both compress alike."""
    out = []
    for m in module.modules():
        if isinstance(m, PIPE_LAYER_TYPES):
            names = hf_state_of(m, spec)
            out += [(names[n], p) for n, p in m.named_parameters() if p.requires_grad]
    return out
