"""Byte accounting for everything the project sends over the network.

Every send site calls :func:`count` with the kind of traffic and the number of payload bytes
it put on the wire, from the rank that sent it.  Totals are per process; :func:`totals` returns
a snapshot and the trainer sums the snapshots of all ranks at the end of a run.

Kinds used by the project:
  pp_activations, pp_gradients  -- pipeline boundary payloads (values, plus indices for Top-K)
  pp_codec_state                -- a stateful codec's state shipped with the activations (basis, mean)
  pp_grad_state                 -- state a codec's receiver sends back with the gradients (the
                                   lowrank codec's gradient metric)
  pp_handshake                  -- DeepSpeed's dense shape/dtype meta messages
  pp_tied                       -- tied-embedding gradient all-reduce between first/last stage
  pp_eval                       -- boundary traffic of evaluation passes (not training traffic)
  dp                            -- data-parallel synchronisation (all-reduce, PowerSGD, DiLoCo)
  anchor                        -- anchor-circuit snapshots and anchor gradients
  export                        -- the end-of-run model export (adapters/export.py): what is sent to
                                   rank 0 (LoRA adapters; shard metadata when rank 0 cannot see a
                                   stage's shard); each stage writes its own weights (not training
                                   traffic: outside TRAINING_KINDS and bytes_per_token)
  catch_up                      -- at --resume auto, the checkpoint files a node without the shared
                                   output folder fetches from its peers (adapters/catchup.py), and
                                   the inventories that decide it; not training traffic
"""
from __future__ import annotations

import threading
from collections import defaultdict

KINDS = ("pp_activations", "pp_gradients", "pp_codec_state", "pp_grad_state", "pp_handshake", "pp_tied", "pp_eval",
         "dp", "anchor", "export", "catch_up")
TRAINING_KINDS = ("pp_activations", "pp_gradients", "pp_codec_state", "pp_grad_state", "pp_handshake", "pp_tied", "dp",
                  "anchor")

_lock = threading.Lock()
_bytes: dict[str, int] = defaultdict(int)
_messages: dict[str, int] = defaultdict(int)


def count(kind: str, nbytes: int, messages: int = 1) -> None:
    """Record ``nbytes`` sent by this process as traffic of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown wire kind {kind!r}; allowed: {', '.join(KINDS)}")
    with _lock:
        _bytes[kind] += int(nbytes)
        _messages[kind] += int(messages)


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def ring_allreduce_bytes(payload_bytes: int, world: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) all-reduce of ``payload_bytes``."""
    if world <= 1:
        return 0
    return (2 * (world - 1) * payload_bytes) // world


def ring_allgather_bytes(payload_bytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-gather where each rank contributes ``payload_bytes``."""
    return (world - 1) * payload_bytes if world > 1 else 0


def alltoall_bytes(payload_bytes: int, world: int) -> int:
    """Bytes one rank sends in an all-to-all of ``payload_bytes`` split in ``world`` equal parts
    (it keeps its own part)."""
    return (world - 1) * payload_bytes // world if world > 1 else 0


def totals() -> dict[str, int]:
    with _lock:
        return {k: int(_bytes.get(k, 0)) for k in KINDS}


def message_totals() -> dict[str, int]:
    with _lock:
        return {k: int(_messages.get(k, 0)) for k in KINDS}


def reset() -> None:
    with _lock:
        _bytes.clear()
        _messages.clear()
