"""The pipeline's boundary codecs applied in the graph of a plain Hugging Face model.

:class:`BoundaryMasker` hooks the HF submodules whose outputs cross pipeline boundaries (as placed by
:func:`models.layers.partition_parts`) and sends each boundary tensor through a (sender, receiver)
pair of the run's codec objects, exactly as the
:class:`~ds_twocircuit.adapters.pipeline_engine.MaskedPipelineEngine` does across two processes: the
same codec classes (``ds_twocircuit.codecs``), the same messages (PRF keys, kept channels, refresh
steps), the same wire casts, and the bytes counted by the same meter (``wire.py``). Because the link
is an autograd function, the gradient goes back through the codec too. Serves:

* the single-process reference engine (``ds_twocircuit.engines.reference``);
* masked inference ("the model as the mesh serves it") in evaluation.
"""
from __future__ import annotations

import threading

import torch

from . import masks, wire
from .models.layers import boundary_layers, layer_module_name, model_parts


class _CodecLink(torch.autograd.Function):
    """One boundary through a (sender, receiver) pair of codec objects, exactly as the engine runs
    it across two processes: the activation is packed by the sender and unpacked by the receiver,
    the gradient packed by the receiver and unpacked by the sender. Counts the wire bytes by kind
    (``count``: False for a probe that is not traffic)."""

    @staticmethod
    def forward(ctx, x, pair, msg, count=True, ref=None):
        send, recv = pair
        n_state = send.state_tensor_count(msg)
        kw = {"ref": ref} if send.needs_reference else {}
        bufs = [b.clone() for b in send.pack_activation(x, msg, **kw)]
        if count:
            kind = "pp_activations" if msg.train else "pp_eval"
            wire.count("pp_codec_state" if msg.train else "pp_eval", sum(map(wire.tensor_bytes, bufs[:n_state])))
            wire.count(kind, sum(map(wire.tensor_bytes, bufs[n_state:])))
        ctx.pair, ctx.msg, ctx.count = pair, msg, count
        return recv.unpack_activation(bufs, msg, x.dtype, **kw)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.pair
        n_state = recv.grad_state_tensor_count(ctx.msg)
        bufs = [b.clone() for b in recv.pack_gradient(g.contiguous(), ctx.msg)]
        recv.forget(ctx.msg)
        if ctx.count:
            if n_state:
                wire.count("pp_grad_state", sum(map(wire.tensor_bytes, bufs[:n_state])))
            wire.count("pp_gradients", sum(map(wire.tensor_bytes, bufs[n_state:])))
        out = send.unpack_gradient(bufs, ctx.msg, g.dtype)
        send.forget(ctx.msg)
        return out, None, None, None, None


class _Stop(Exception):
    """Raised by the reference model's last boundary hook: nothing after it is needed."""


class BoundaryMasker:
    """Forward hooks that code each pipeline boundary of ``model`` in the graph.

    ``codec_factory()`` makes one end of a link (``codecs.make_codec(tc)``); a (sender, receiver)
    pair is made per boundary, fed the same message sequence as the engine's (one masker per model
    replica: a DP replica's links are its own). ``set_message(step, micro_batch)`` selects the PRF key
    fields for the next forward pass (``micro_batch`` is the global micro-batch index, replica x gas +
    local index, as in the engine); steps from ``masks.EVAL_STEP_OFFSET`` on are evaluation messages.
    ``dense = True`` sends the boundary through a dense codec pair instead (``dense_factory``: the
    run's wire dtype, its bytes counted), as the engine does for dense evaluation and clean steps;
    ``enabled = False`` lets it through untouched and uncounted (the anchor's own dense pass, not
    fast-circuit traffic).

    ``reference_model``: for a codec that ``needs_reference``, a frozen copy of the base model (the
    same architecture, its pretrained weights): its activation at each boundary for the tokens of the
    current forward pass is the codec's ``ref``, as each end of a real link computes it for itself.
    It runs forward only, under ``no_grad``, and stops at the last boundary."""

    def __init__(self, model, num_stages: int, codec_factory, seed: int = 0, partition: str = "balanced",
                 parts: list[int] | None = None, gas: int = 1, dense_factory=None, reference_model=None):
        cfg = model.config
        self.model = model
        self.num_layers = int(cfg.num_hidden_layers)
        self.parts = list(parts) if parts is not None else model_parts(model, num_stages, partition)
        self.codec_factory, self.seed, self.gas = codec_factory, int(seed), int(gas)
        if dense_factory is None:
            from .codecs import DENSE, build_codec
            dense_factory = lambda: build_codec(DENSE)  # noqa: E731
        self.dense_factory = dense_factory
        self.step, self.micro = 0, 0
        self.enabled = True
        self.dense = False
        self.count = True
        self._pairs: dict = {}
        self._dense_pairs: dict = {}
        self._handles = []
        self.reference_model = reference_model
        self._ids = None          # the input ids of the forward pass in flight
        self._refs: dict = {}     # boundary -> the reference model's activation for them
        self._ref_handles = []
        self._ref_thread = None   # the thread whose reference call is in flight
        self.attach()

    def attach(self) -> None:
        """(Re-)register the hooks (after :meth:`remove`)."""
        class _Spec:
            num_layers = self.num_layers
        self.remove()
        for b, layer in enumerate(boundary_layers(self.parts)):
            mod = self.model.get_submodule(layer_module_name(_Spec, layer))
            self._handles.append(mod.register_forward_hook(self._hook(b)))
        self._handles.append(self.model.register_forward_pre_hook(self._capture_ids, with_kwargs=True))
        if self.reference_model is not None and not self._ref_handles:
            layers = boundary_layers(self.parts)
            for b, layer in enumerate(layers):
                mod = self.reference_model.get_submodule(layer_module_name(_Spec, layer))
                self._ref_handles.append(mod.register_forward_hook(self._ref_hook(b, b == len(layers) - 1)))

    def _capture_ids(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._ids = ids
        self._refs = {}

    def _ref_hook(self, boundary: int, last: bool):
        def hook(module, inputs, output):
            # the reference model may be shared by DP replicas' maskers, each stepping in its own
            # thread: only the call this masker made is its own
            if self._ref_thread != threading.get_ident():
                return None
            h = output[0] if isinstance(output, tuple) else output
            self._refs[boundary] = h.detach()
            if last:
                raise _Stop
        return hook

    def reference(self, boundary: int) -> torch.Tensor:
        """The reference model's activation at ``boundary`` for the current forward pass's tokens."""
        if self.reference_model is None:
            raise ValueError("this boundary codec codes the drift from the base model (reference = 'base'), "
                             "but no reference model was given to the BoundaryMasker")
        if boundary not in self._refs:
            if self._ids is None:
                raise ValueError("reference = 'base': the model was not called with input_ids, so the base "
                                 "model's activation cannot be computed")
            self._ref_thread = threading.get_ident()
            try:
                with torch.no_grad():
                    self.reference_model(input_ids=self._ids)
            except _Stop:
                pass
            finally:
                self._ref_thread = None
        return self._refs[boundary]

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

    def pair(self, boundary: int):
        """The (sender, receiver) codec pair of one boundary link."""
        if boundary not in self._pairs:
            self._pairs[boundary] = (self.codec_factory(), self.codec_factory())
        return self._pairs[boundary]

    def pairs(self):
        return sorted(self._pairs.items())

    def apply(self, h: torch.Tensor, boundary: int) -> torch.Tensor:
        train = self.step < masks.EVAL_STEP_OFFSET
        if self.dense:
            if boundary not in self._dense_pairs:
                self._dense_pairs[boundary] = (self.dense_factory(), self.dense_factory())
            pair = self._dense_pairs[boundary]
        else:
            pair = self.pair(boundary)
        first = self.micro % self.gas == 0
        if first or not train:  # the engine resets its codecs at the start of every batch
            pair[0].reset()
            pair[1].reset()
        key = masks.mask_key(self.seed, boundary, self.step, self.micro, h.shape[-1])
        msg = pair[0].message(key, h.shape, self.step % masks.EVAL_STEP_OFFSET, first_of_step=first, train=train)
        ref = self.reference(boundary).to(h.dtype) if pair[0].needs_reference else None
        return _CodecLink.apply(h, pair, msg, self.count, ref)

    def remove(self) -> None:
        for hd in self._handles + self._ref_handles:
            hd.remove()
        self._handles, self._ref_handles = [], []


def untie_head(model) -> None:
    """Give a tied HF model its own LM-head weight (what ``tied_embeddings: untie`` trains)."""
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = []
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
