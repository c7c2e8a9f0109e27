"""MaskedPipelineEngine: DeepSpeed's PipelineEngine with compressed stage boundaries.

A thin adapter. The four boundary instructions (send/recv activations, send/recv gradients)
hand their tensor to a codec (``ds_twocircuit.codecs``) and put only the codec's wire tensors on the link;
the data-parallel gradient all-reduce is delegated to a pluggable DP backend (``dp/``). Every
byte sent is counted where it is sent (``wire.py``).

Message identity: messages on one (link, direction) are FIFO in micro-batch order on both ends
(1F1B), so a per-step counter per (kind, direction) gives the micro-batch index without any
coordination. The PRF key is (mask seed, boundary, global step, global micro-batch index, H)
with the global micro-batch index = dp_rank * gas + local index (see ``data.MicroBatchStream``).
DeepSpeed's buffer ids differ between sender and receiver and are never used for keys.
"""
from __future__ import annotations

import time

import torch
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from .. import masks, pacing, wire
from ..codecs import DENSE, Message, build_codec, make_codec

EVAL_STEP_OFFSET = masks.EVAL_STEP_OFFSET  # eval_batch keys live apart from training keys
META_BYTES = 256 * 4        # DeepSpeed's TENSOR_META_SIZE int32 handshake


class MaskedPipelineEngine(PipelineEngine):
    """Configure with :meth:`setup_twocircuit` right after construction."""

    start_broadcast_bytes = 0   # what this rank received in the start-up broadcast

    def _broadcast_model(self):
        """At start-up DeepSpeed broadcasts every parameter from each DP group's first replica:
        the whole model over the DP links (0.4 GB for SmolLM2-135M's two fp32 stages, 4 minutes at
        13 Mbit/s; 5 GB for a 1B model's fp32 weights). Replicas that loaded the same weights (the
        same checkpoint, or the same seed) skip it: each compares a SHA-256 of its weights with its
        DP group's (64 bytes per rank cross the wire), and only a group whose replicas differ
        broadcasts, as DeepSpeed would. Called from DeepSpeedEngine.__init__ (checked against
        DeepSpeed 0.19.8, adapters/deepspeed_private.py), before ``self.grid`` exists."""
        import deepspeed.comm as ds_dist
        from .dist import group_agrees, weights_digest
        size = self.dp_world_size
        if self.dist_backend is None or size == 1:
            return super()._broadcast_model()
        group = self.seq_data_parallel_group
        if group_agrees(weights_digest(self.module.named_parameters()), group, size):
            return
        if ds_dist.get_rank(group=group) != 0:
            self.start_broadcast_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        super()._broadcast_model()

    def setup_twocircuit(self, tc, mask_seed: int, dp_backend=None):
        self.tc = tc
        self.mask_seed = int(mask_seed)
        # one codec per link end: a middle stage receives on one link and sends on another, and a
        # stateful codec's state (mean, basis) belongs to one link
        self.codec_out = make_codec(tc)   # activations out, gradients in
        self.codec_in = make_codec(tc)    # activations in, gradients out
        self._ref_prefix = None
        if self.codec_out.needs_reference:
            self._setup_reference()
        self.dp_backend = dp_backend
        self.dp_rank = self.grid.get_data_parallel_id()
        self._key_step = 0
        self._counters = {}
        self._evaluating = False
        self.timing = {"codec_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "dp_s": 0.0}
        self.step_stats: dict = {}
        self._paced_senders: dict[int, pacing.DeferredSender] = {}   # software throttle, per peer stage

    # ------------------------------------------------------------------ the base model's boundary
    def _setup_reference(self):
        """``twocircuit.codec.reference = "base"``: both ends of a link compute the base model's
        activation at that boundary for the micro-batch's tokens, from the pretrained weights in the
        model folder (frozen, forward only; loaded once, no link traffic). Stage s holds the base
        model's pipeline layers up to its last boundary (its outbound one, or its inbound one on the
        last stage): the compute and memory of a frozen copy of everything before it, a share that
        grows with the stage's depth. The first stage reads the token ids from its inputs, the last
        from its labels (the same ids); a middle stage reads them from its own copy of the data
        stream (every rank has one: no byte crosses a link for them)."""
        import torch.nn as nn
        from ..models.layers import DecoderPipe, EmbedPipe, WeightReader, load_layer_weights
        if self.num_stages == 1:              # no boundary to code
            return
        spec = self.module._tc_spec
        parts = self.module.parts
        s, last = self.stage_id, self.num_stages - 1
        stop = parts[s + 1] if s < last else parts[s]   # pipeline layers [0, stop): embedding + stop - 1 decoders
        layers = [EmbedPipe(spec)] + [DecoderPipe(spec, i) for i in range(stop - 1)]
        reader = WeightReader(spec.folder)
        for m in layers:
            load_layer_weights(m, spec, reader)
        ref = next(self.module.parameters())
        self._ref_prefix = nn.Sequential(*layers).to(device=ref.device).eval().requires_grad_(False)
        _mirror_dtypes(self._ref_prefix, self.module)
        self._ref_split = parts[s] if 0 < s < last else None   # a middle stage: where its inbound boundary is
        self._ref_pending = set()             # buffers whose input still lacks the base activation
        self._ref_outbound = {}               # a middle stage: buffer -> the base activation it sends against

    def _reference(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._ref_prefix(ids.to(next(self._ref_prefix.parameters()).device))

    def _reference_both(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A middle stage: the base activations at its inbound and its outbound boundary."""
        with torch.no_grad():
            x = self._ref_prefix[:self._ref_split](ids.to(next(self._ref_prefix.parameters()).device))
            return x, self._ref_prefix[self._ref_split:](x)

    def _reads_ids(self) -> bool:
        return getattr(self, "_ref_split", None) is not None

    def set_dataiterator(self, iterator):
        """DeepSpeed gives the data stream to the first and last stages only; a middle stage that
        computes the base model's activations reads its token ids from it too."""
        super().set_dataiterator(iterator)
        if self._reads_ids():
            self.training_dataloader = None
            self.data_iterator = iterator

    def _next_ids(self) -> torch.Tensor:
        if self.data_iterator is None:
            raise RuntimeError("twocircuit.codec.reference = \"base\": a middle pipeline stage reads its token ids "
                               "from the data stream, but none was given (pass it to train_batch / eval_batch)")
        batch = self._next_batch()
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def _uses_reference(self, codec) -> bool:
        return self._ref_prefix is not None and codec.needs_reference

    # ------------------------------------------------------------------ message identity
    def _message(self, kind: str, boundary: int, shape) -> Message:
        n = self._counters.get(kind, 0)
        self._counters[kind] = n + 1
        micro = self.dp_rank * self.micro_batches + n
        key = masks.mask_key(self.mask_seed, boundary, self._key_step, micro, int(shape[-1]))
        # stateful codecs: the first activation message of a refresh step carries new state
        return self.codec_out.message(key, shape, self._key_step % EVAL_STEP_OFFSET, first_of_step=n == 0,
                                      train=not self._evaluating, kind="act" if kind.startswith("act") else "grad")

    def _begin(self, key_step: int):
        self._key_step = key_step
        self._counters = {}
        self.codec_out.reset()
        self.codec_in.reset()

    def keep_fraction(self, step: int, hidden: int) -> float:
        return self.codec_out.keep(step, hidden) / hidden

    def clean_step(self, step: int) -> bool:
        """``twocircuit.clean_every`` K: every K-th step trains through dense boundaries (a control:
        what a true dense step now and then buys, its bytes counted as they are sent)."""
        k = self.tc.clean_every
        return bool(k) and step % k == k - 1

    def train_batch(self, data_iter=None):
        self._begin(self.global_steps)
        step = self.global_steps
        coded = self.codec_out, self.codec_in
        if self.clean_step(step):   # the run's codecs neither see nor ship anything this step
            self.codec_out, self.codec_in = (build_codec(DENSE, self.tc.wire_dtype),
                                             build_codec(DENSE, self.tc.wire_dtype))
        try:
            out = super().train_batch(data_iter)
            self._flush_sends()
        finally:
            self.codec_out, self.codec_in = coded
        if self.dp_backend is not None:
            self.step_stats = self.dp_backend.pop_step_stats()
        self.step_stats["step"] = step
        return out

    def eval_batch(self, data_iter, dense: bool = False, **kw):
        """``dense=True``: uncoded boundaries (how a user scores the trained model); else through
        the run's codec (how the mesh serves it). The codec's state is left untouched."""
        coded = self.codec_out, self.codec_in
        if dense:
            self.codec_out, self.codec_in = (build_codec(DENSE, self.tc.wire_dtype),
                                             build_codec(DENSE, self.tc.wire_dtype))
        self._begin(EVAL_STEP_OFFSET + self.global_steps)
        self._evaluating = True
        try:
            out = super().eval_batch(data_iter, **kw)
            self._flush_sends()
            return out
        finally:
            self._evaluating = False
            self.codec_out, self.codec_in = coded

    # ------------------------------------------------------------------ boundary instructions
    def _send(self, tensors, stage, kind):
        if self._evaluating:
            kind = "pp_eval"
        pacer = pacing.current()
        for t in tensors:
            if pacer is None:
                p2p.send(t, stage)
            else:  # software throttle: sent from a thread when the capped link would deliver it
                self._paced_sender(stage, pacer).put(t.detach().clone(), wire.tensor_bytes(t))
            wire.count(kind, wire.tensor_bytes(t))

    def _paced_sender(self, stage, pacer) -> pacing.DeferredSender:
        if stage not in self._paced_senders:
            self._paced_senders[stage] = pacing.DeferredSender(
                pacer.link(f"pp->{stage}"), lambda t, s=stage: p2p.send(t, s), f"paced-send-to-stage{stage}")
        return self._paced_senders[stage]

    def _flush_sends(self):
        """The software throttle's queued sends are out (the batch's last one included)."""
        for sender in self._paced_senders.values():
            sender.flush()

    def _exec_send_activations(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if not torch.is_tensor(outputs):
            raise TypeError("MaskedPipelineEngine passes exactly one tensor between stages")
        if self.first_output_send:
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
            wire.count("pp_eval" if self._evaluating else "pp_handshake", META_BYTES)
        msg = self._message("act_send", self.stage_id, outputs.shape)
        n_state = self.codec_out.state_tensor_count(msg) if self.codec_out.stateful else 0
        t0 = time.perf_counter()
        kw = {}
        if self._uses_reference(self.codec_out):
            # the first stage's inputs are the token ids; a middle stage computed it in its forward pass
            base = (self._ref_outbound.pop(buffer_id) if self._reads_ids()
                    else self._reference(self.pipe_buffers["inputs"][buffer_id]))
            kw["ref"] = base.to(outputs.dtype)
        payload = self.codec_out.pack_activation(outputs, msg, **kw)
        self.timing["codec_s"] += time.perf_counter() - t0
        if n_state:  # mean / basis of a stateful codec, counted apart
            self._send(payload[:n_state], self.next_stage, "pp_codec_state")
        self._send(payload[n_state:], self.next_stage, "pp_activations")

    def _exec_recv_activations(self, buffer_id):
        if self.pipe_recv_buf is None:
            self.pipe_recv_buf = self._recv_tensor_meta(self.prev_stage)
        ref = self.pipe_recv_buf
        msg = self._message("act_recv", self.stage_id - 1, ref.shape)
        bufs = self.codec_in.activation_buffers(msg, ref.dtype, ref.device)
        for b in bufs:
            p2p.recv(b, self.prev_stage)
        t0 = time.perf_counter()
        if self._uses_reference(self.codec_in):
            # the token ids arrive after this instruction (the last stage's labels, a middle stage's
            # own read of the data stream): the base activation is added in the forward pass (the
            # codec adds it last, so adding zero here and it there is the same sum)
            # (decoded in fp32 and rounded to the stage's dtype once, after the base activation is added)
            x = self.codec_in.unpack_activation(bufs, msg, torch.float32,
                                                ref=torch.zeros(ref.shape, device=ref.device))
            self._ref_pending.add(buffer_id)
        else:
            x = self.codec_in.unpack_activation(bufs, msg, ref.dtype)
        self.timing["codec_s"] += time.perf_counter() - t0
        x = x.detach().contiguous()
        x.requires_grad = x.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = x

    def _exec_send_grads(self, buffer_id):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        assert inputs.grad is not None, "boundary input received no gradient"
        msg = self._message("grad_send", self.stage_id - 1, inputs.shape)
        t0 = time.perf_counter()
        n_state = self.codec_in.grad_state_tensor_count(msg)
        payload = self.codec_in.pack_gradient(inputs.grad, msg)
        self.codec_in.forget(msg)
        self.timing["codec_s"] += time.perf_counter() - t0
        if n_state:  # state sent back (the lowrank codec's gradient metric), counted apart
            self._send(payload[:n_state], self.prev_stage, "pp_grad_state")
        self._send(payload[n_state:], self.prev_stage, "pp_gradients")
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        msg = self._message("grad_recv", self.stage_id, outputs.shape)
        bufs = self.codec_out.gradient_buffers(msg, outputs.dtype, outputs.device)
        for b in bufs:
            p2p.recv(b, self.next_stage)
        t0 = time.perf_counter()
        self.grad_layer = self.codec_out.unpack_gradient(bufs, msg, outputs.dtype)
        self.codec_out.forget(msg)
        self.timing["codec_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ compute timing
    def _exec_forward_pass(self, buffer_id):
        t0 = time.perf_counter()
        base_in = None
        if self._reads_ids():
            # one micro-batch of the stream per forward pass, whether or not this pass codes (a dense
            # evaluation or clean step), so the stream stays in step with the first stage's
            ids = self._next_ids()
            if buffer_id in self._ref_pending or self._uses_reference(self.codec_out):
                base_in, base_out = self._reference_both(ids)
                if self._uses_reference(self.codec_out):
                    self._ref_outbound[buffer_id] = base_out
        if self._ref_prefix is not None and buffer_id in self._ref_pending:
            self._ref_pending.discard(buffer_id)
            drift = self.pipe_buffers["inputs"][buffer_id]
            if base_in is None:
                base_in = self._reference(self.pipe_buffers["labels"][buffer_id])
            x = (drift.detach().float() + base_in.float()).to(self.pipe_recv_buf.dtype).contiguous()
            x.requires_grad = x.is_floating_point()
            self.pipe_buffers["inputs"][buffer_id] = x
        super()._exec_forward_pass(buffer_id)
        self.timing["forward_s"] += time.perf_counter() - t0

    def _exec_backward_pass(self, buffer_id):
        t0 = time.perf_counter()
        super()._exec_backward_pass(buffer_id)
        self.timing["backward_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ data parallel
    def _exec_reduce_tied_grads(self):
        tied = 0
        for weight, group in self.module.get_tied_weights_and_groups():
            grad = weight._hp_grad if self.using_bf16_optimizer else weight.grad
            if grad is not None:
                n = torch.distributed.get_world_size(group=group)
                nbytes = wire.ring_allreduce_bytes(wire.tensor_bytes(grad), n)
                wire.count("pp_tied", nbytes)
                tied += nbytes
        super()._exec_reduce_tied_grads()
        pacing.send("pp_tied", tied)          # software throttle: after the collective, as PacedComm

    def _exec_reduce_grads(self):
        t0 = time.perf_counter()
        self._force_grad_boundary = True
        if self.dp_backend is not None:
            self.dp_backend.reduce_gradients(self.global_steps)
        elif self.pipeline_enable_backward_allreduce:
            raise RuntimeError("MaskedPipelineEngine needs a DP backend (setup_twocircuit)")
        self._force_grad_boundary = False
        self.timing["dp_s"] += time.perf_counter() - t0

    def _exec_optimizer_step(self, lr_kwargs=None):
        step = self.global_steps
        super()._exec_optimizer_step(lr_kwargs)
        if self.dp_backend is not None:
            t0 = time.perf_counter()
            self.dp_backend.after_optimizer_step(step)
            self.timing["dp_s"] += time.perf_counter() - t0

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: _exec_send_grads,
        schedule.RecvGrad: _exec_recv_grads,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedule.ReduceGrads: _exec_reduce_grads,
        schedule.OptimizerStep: _exec_optimizer_step,
    }


def _mirror_dtypes(copy, live) -> None:
    """Give every tensor of the base model's frozen ``copy`` the dtype its counterpart has in the
    ``live`` stage, so that at step 0 both compute bit-alike and the drift is exactly zero. A bf16
    or fp16 DeepSpeed engine casts parameters only: buffers such as the rotary ``inv_freq`` stay
    fp32 (as do ``keep_in_fp32_modules``' buffers), which a blanket ``.to(dtype)`` would round.
    Layers this stage does not hold take the dtypes of a layer of the same type here, else the
    stage's parameter and buffer dtypes."""
    from ..models.layers import DecoderPipe, EmbedPipe
    kinds = (EmbedPipe, DecoderPipe)
    seen = {}
    for m in live.modules():
        if isinstance(m, kinds):
            for n, t in list(m.named_parameters()) + list(m.named_buffers()):
                seen.setdefault((type(m), n), t.dtype)
    param_dtype = next(live.parameters()).dtype
    buffer_dtype = next((b.dtype for b in live.buffers() if b.is_floating_point()), param_dtype)
    for layer in copy:
        for n, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if not t.is_floating_point():
                continue
            is_param = isinstance(t, torch.nn.Parameter)
            dtype = seen.get((type(layer), n), param_dtype if is_param else buffer_dtype)
            owner, _, leaf = n.rpartition(".")
            mod = layer.get_submodule(owner) if owner else layer
            if is_param:
                t.data = t.data.to(dtype)
            else:
                mod._buffers[leaf] = t.to(dtype)
