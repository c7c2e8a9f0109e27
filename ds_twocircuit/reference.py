"""The pipeline's boundary masks applied in the graph of a plain Hugging Face model.

:class:`BoundaryMasker` hooks the HF submodules whose outputs cross pipeline boundaries (as
placed by :func:`models.layers.partition_parts`) and multiplies them by the same PRF masks the
:class:`~ds_twocircuit.adapters.pipeline_engine.MaskedPipelineEngine` uses, with the same wire casts. Because the
product is in the autograd graph, the backward pass gets the same sparsity pattern. Serves:

* the single-process reference the multi-process engine is tested against
  (:func:`reference_train`);
* masked inference ("the model as the mesh serves it") in evaluation.
"""
from __future__ import annotations

import torch

from . import masks
from .codec import WIRE_DTYPES
from .models.layers import boundary_layers, causal_lm_loss, layer_module_name, model_parts


class _WireCast(torch.autograd.Function):
    """Round-trip through the wire dtype in the forward and in the backward pass."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.wire_dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.wire_dtype).to(g.dtype), None


def _wire_cast(x, dtype):
    return x if dtype is None or dtype == x.dtype else _WireCast.apply(x, dtype)


class _CodecLink(torch.autograd.Function):
    """One boundary through a (sender, receiver) pair of codec objects, exactly as the engine runs
    it across two processes: the activation is packed by the sender and unpacked by the receiver,
    the gradient packed by the receiver and unpacked by the sender."""

    @staticmethod
    def forward(ctx, x, pair, msg):
        send, recv = pair
        bufs = [b.clone() for b in send.pack_activation(x, msg)]
        ctx.pair, ctx.msg = pair, msg
        return recv.unpack_activation(bufs, msg, x.dtype)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.pair
        bufs = [b.clone() for b in recv.pack_gradient(g.contiguous(), ctx.msg)]
        return send.unpack_gradient(bufs, ctx.msg, g.dtype), None, None


class BoundaryMasker:
    """Forward hooks that mask each pipeline boundary of ``model`` in the graph.

    ``set_message(step, micro_batch)`` selects the PRF key fields for the next forward pass
    (``micro_batch`` is the global micro-batch index, as in the engine)."""

    def __init__(self, model, num_stages: int, mode: str = "random", mask_rate: float = 0.95,
                 seed: int = 0, partition: str = "balanced", warmup_steps: int = 0, ramp_steps: int = 0,
                 rescale: bool = False, wire_dtype: str = "auto", parts: list[int] | None = None,
                 codec_cfg=None, gas: int = 1):
        cfg = model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.parts = list(parts) if parts is not None else model_parts(model, num_stages, partition)
        self.mode, self.seed, self.rescale = mode, int(seed), rescale
        self.schedule = masks.MaskSchedule(0.0 if mode == "dense" else mask_rate, warmup_steps, ramp_steps)
        self.wire_dtype = None if wire_dtype in (None, "auto") else WIRE_DTYPES[wire_dtype]
        self.step, self.micro = 0, 0
        self.enabled = True
        # stateful codecs (meanfill, lowrank): a (sender, receiver) codec pair per boundary and DP
        # replica, fed the same message sequence as the engine's; ``gas`` tells the first message
        # of a replica's step (micro-batch index = replica x gas + local index)
        self.codec_cfg, self.gas, self._pairs = codec_cfg, int(gas), {}
        self.wire_dtype_name = wire_dtype

        class _Spec:
            num_layers = self.num_layers
        self._handles = []
        for b, layer in enumerate(boundary_layers(self.parts)):
            mod = model.get_submodule(layer_module_name(_Spec, layer))
            self._handles.append(mod.register_forward_hook(self._hook(b)))

    def set_message(self, step: int, micro_batch: int) -> None:
        self.step, self.micro = int(step), int(micro_batch)

    def _hook(self, boundary: int):
        def hook(module, inputs, output):
            if not self.enabled:
                return None
            h = output[0] if isinstance(output, tuple) else output
            h = self.apply(h, boundary)
            return (h, *output[1:]) if isinstance(output, tuple) else h
        return hook

    def _pair(self, boundary: int, replica: int):
        from .codec import make_codec
        key = (boundary, replica)
        if key not in self._pairs:
            self._pairs[key] = tuple(make_codec(self.mode, self.wire_dtype_name, self.codec_cfg) for _ in range(2))
        return self._pairs[key]

    def _apply_stateful(self, h: torch.Tensor, boundary: int) -> torch.Tensor:
        from .codec import Message
        H = h.shape[-1]
        train = self.step < masks.EVAL_STEP_OFFSET
        replica = self.micro // self.gas if train else 0
        pair = self._pair(boundary, replica)
        keep = H if self.mode == "lowrank" else self.schedule.keep(self.step % masks.EVAL_STEP_OFFSET, H)
        scale = 1.0
        if self.rescale and keep < H:
            scale = 1.0 / (1.0 - self.schedule.rate(self.step))
        msg = Message(key=masks.mask_key(self.seed, boundary, self.step, self.micro, H),
                      shape=tuple(h.shape), keep=keep, scale=scale, train=train,
                      refresh=train and self.micro % self.gas == 0 and pair[0].refresh.due(self.step))
        return _CodecLink.apply(h, pair, msg)

    def codec_state_bytes(self) -> int:
        """Bytes of codec state the senders have shipped so far (all boundaries and replicas)."""
        return sum(p[0].state_bytes_sent for p in self._pairs.values())

    def apply(self, h: torch.Tensor, boundary: int) -> torch.Tensor:
        if self.mode in ("meanfill", "lowrank"):
            return self._apply_stateful(h, boundary)
        H = h.shape[-1]
        keep = H if self.mode == "dense" else self.schedule.keep(self.step, H)
        if keep < H:
            tokens = h.numel() // H
            if self.mode == "random":
                key = masks.mask_key(self.seed, boundary, self.step, self.micro, H)
                idx = masks.kept_indices(key, tokens, H, keep, device=h.device)
            else:  # topk: chosen from the values, not differentiated through the choice
                flat = h.detach().reshape(tokens, H)
                idx = flat.abs().topk(keep, dim=1, sorted=False).indices
            m = torch.zeros(tokens, H, dtype=h.dtype, device=h.device).scatter_(1, idx, 1.0)
            h = h * m.view(h.shape)
            if self.rescale:
                h = h * (1.0 / (1.0 - self.schedule.rate(self.step)))
        return _wire_cast(h, self.wire_dtype)

    def remove(self) -> None:
        for hd in self._handles:
            hd.remove()
        self._handles = []


def untie_head(model) -> None:
    """Give a tied HF model its own LM-head weight (what ``tied_embeddings: untie`` trains)."""
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = []
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())


def reference_train(model, stream_factory, steps: int, dp: int, gas: int, optimizer,
                    masker: BoundaryMasker | None, grad_clip: float | None = None):
    """Single-process equivalent of a (pp x dp) MaskedPipelineEngine run.

    ``stream_factory(r)`` returns replica r's ``MicroBatchStream``. Per step: loss of every
    micro-batch of every replica, scaled by 1/(dp*gas) (DeepSpeed's gradient-accumulation scaling
    plus the DP mean), backward, optional global-norm clipping, optimizer step. Returns the mean
    training loss of each step."""
    streams = [stream_factory(r) for r in range(dp)]
    losses = []
    params = [p for p in model.parameters() if p.requires_grad]
    for s in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(dp):
            for m in range(gas):
                x, y = next(streams[r])
                if masker is not None:
                    masker.set_message(s, r * gas + m)
                logits = model(input_ids=x).logits
                loss = causal_lm_loss(logits, y)
                (loss / (dp * gas)).backward()
                total += float(loss.detach())
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        losses.append(total / (dp * gas))
    return losses
