"""Which anchor gradients the data-parallel replicas of a stage use, agreed without ever waiting.

Why: with DP > 1 every replica of a stage must hand the *same* anchor gradients to its optimizer
at the *same* step, or their corrected updates differ and the replicas drift apart. Deciding that
with a collective every step (one replica reads the store and broadcasts) puts a round trip on the
slow DP link into every step -- under DiLoCo, whose point is to use that link rarely, the fast
circuit would wait on the slowest replica's file system every step.

The fence: every replica reads the store itself. At fence steps (every ``every`` steps, the
snapshot cadence) a replica

1. resolves the previous vote: the newest source step that *every* replica held when voting is
   used now, by all of them (their holdings are frozen between a vote and its resolution, so each
   of them still has it);
2. loads the newest gradients it can see in the store (at most ``hold`` kept in memory);
3. votes: a vector of ``slots`` flags, flag i = "I hold the gradients of source step
   ``step - i * every``", reduced with MIN (a logical AND) over the DP group *asynchronously*; the
   result is read at the next fence step, ``every`` steps later, by which time it has long
   arrived.

Cost: ``slots`` int32 values per fence on the DP link, one anchor staleness of ``every`` more steps,
and no wait. A replica that has not seen a gradient yet simply does not vote for it; the others
use it one fence later, or a newer one.

Pure Python/torch: the adapter (:class:`~ds_twocircuit.adapters.anchor_circuit.AnchorLink`) does the
store reads and the collective.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class AnchorFence:
    """State of one replica's agreement; see the module docstring.

    Args:
        every: fence cadence in steps (the snapshot cadence: source steps are its multiples).
        slots: how many source steps back a vote can name.
        hold: anchor gradients kept in memory at most (the newest).
    """

    def __init__(self, every: int, slots: int = 8, hold: int = 2) -> None:
        if every < 1 or slots < 1 or hold < 1:
            raise ValueError(f"every, slots and hold must be >= 1, got {every}, {slots}, {hold}")
        self.every, self.slots, self.hold_max = int(every), int(slots), int(hold)
        self.held: dict[int, Any] = {}     # source step -> payload (gradients, bytes, ...)
        self.vote_step: Optional[int] = None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def newest_held(self) -> Optional[int]:
        return max(self.held) if self.held else None

    def resolve(self, result: Optional[torch.Tensor], last_used: Optional[int]):
        """The AND of every replica's previous vote -> ``(source_step, payload)`` to use now, or
        None. Drops what is no longer needed (the used step and older)."""
        if result is None or self.vote_step is None:
            return None
        flags = [int(v) for v in result.tolist()]
        agreed = None
        for i, f in enumerate(flags):  # slot 0 is the newest
            s = self.vote_step - i * self.every
            if f and s >= 0 and (last_used is None or s > last_used):
                agreed = s
                break
        self.vote_step = None
        if agreed is None or agreed not in self.held:  # cannot happen: holdings were frozen
            return None
        payload = self.held[agreed]
        self.held = {s: p for s, p in self.held.items() if s > agreed}
        return agreed, payload

    def offer(self, source_step: int, payload: Any, last_used: Optional[int]) -> None:
        """Keep gradients read from the store (only between a resolution and the next vote)."""
        if last_used is not None and source_step <= last_used:
            return
        self.held[int(source_step)] = payload
        for s in sorted(self.held)[:-self.hold_max]:
            del self.held[s]

    def vote(self, step: int) -> torch.Tensor:
        """Flags of the held source steps relative to ``step`` (int32, ``slots`` values); held
        steps older than the window are dropped (nobody can name them any more)."""
        flags = torch.zeros(self.slots, dtype=torch.int32)
        for s in list(self.held):
            i, r = divmod(step - s, self.every)
            if r == 0 and 0 <= i < self.slots:
                flags[i] = 1
            else:
                del self.held[s]
        self.vote_step = int(step)
        return flags
