"""What the codecs with state share: the refresh schedule, the sender's running moments, and the
state protocol.

Invariant: both ends apply the state only from the message that carries it, so sender and receiver
hold the same (rounded) state at every message; which messages carry state is a pure function of
(step, first message of the step, state present), known to both ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..configkit import ConfigError, check_range
from .base import Codec, Message


class RefreshSchedule:
    """Which training steps refresh the codec state: the listed ``steps``, plus every ``every``
    steps after the last listed one (0: never)."""

    def __init__(self, steps=(0,), every: int = 0):
        self.steps = sorted(int(s) for s in steps)
        self.every = int(every)

    def due(self, step: int) -> bool:
        if step in self.steps:
            return True
        last = self.steps[-1] if self.steps else 0
        return self.every > 0 and step > last and (step - last) % self.every == 0

    def next_after(self, step: int):
        """The first due step after ``step``, or None when no later step is due."""
        later = [s for s in self.steps if s > step]
        if later:
            return later[0]
        last = self.steps[-1] if self.steps else 0
        return last + self.every * (max(step - last, 0) // self.every + 1) if self.every > 0 else None


@dataclass(frozen=True)
class RefreshConfig:
    """The refresh keys of a stateful codec's ``twocircuit.codec`` section."""
    refresh_steps: list = field(default_factory=lambda: [0, 1, 3])  # steps whose first message ships
                                    # new state fitted on everything the sender saw
    refresh_every: int = 0          # and every N steps after the last listed one (0: never)
    moments_halflife: float = 0     # training steps after which a token's weight in the statistics a
                                    # refresh fits on has halved (0: every token since step 0 alike)

    def validate(self, p):
        if (not isinstance(self.refresh_steps, list) or not self.refresh_steps
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.refresh_steps)):
            raise ConfigError(f"{p}.refresh_steps must be a non-empty list of step numbers >= 0 "
                              f"(the first is the step that ships the first state), got {self.refresh_steps!r}")
        check_range(self.refresh_every, f"{p}.refresh_every", 0, 1 << 30)
        if isinstance(self.moments_halflife, bool) or not isinstance(self.moments_halflife, (int, float)):
            raise ConfigError(f"{p}.moments_halflife must be a number of training steps >= 0 (0: no "
                              f"forgetting), got {self.moments_halflife!r}")
        check_range(self.moments_halflife, f"{p}.moments_halflife", 0, None)

    def schedule(self) -> RefreshSchedule:
        return RefreshSchedule(self.refresh_steps, self.refresh_every)


class RunningMoments:
    """Token count, sum and (optionally) sum of outer products of the sender's activations, in
    float64 (a covariance of H x H)."""

    def __init__(self, second: bool):
        self.second = second
        self.n = 0
        self.s1 = None
        self.s2 = None

    def add(self, flat: torch.Tensor) -> None:
        f = flat.detach().to(torch.float64)
        if self.s1 is not None and self.s1.device != f.device:   # loaded from a checkpoint on the CPU
            self.s1 = self.s1.to(f.device)
            self.s2 = self.s2.to(f.device) if self.s2 is not None else None
        if self.s1 is None:
            self.s1 = torch.zeros(f.shape[1], dtype=torch.float64, device=f.device)
            if self.second:
                self.s2 = torch.zeros(f.shape[1], f.shape[1], dtype=torch.float64, device=f.device)
        self.n += f.shape[0]
        self.s1 += f.sum(0)
        if self.second:
            self.s2 += f.T @ f

    def scale(self, factor: float) -> None:
        """Weigh everything seen so far by ``factor`` (exponential forgetting: the mean and covariance
        become those of the tokens weighted alike within each add and by ``factor`` across)."""
        if self.s1 is None:
            return
        self.n *= factor
        self.s1 *= factor
        if self.s2 is not None:
            self.s2 *= factor

    def _count(self):
        return self.n if self.n > 0 else 1

    def mean(self) -> torch.Tensor:
        return self.s1 / self._count()

    def covariance(self) -> torch.Tensor:
        m = self.mean()
        return self.s2 / self._count() - torch.outer(m, m)

    def state_dict(self):
        return {"n": self.n, "s1": self.s1, "s2": self.s2}

    def load_state_dict(self, d):
        self.n, self.s1, self.s2 = d["n"], d["s1"], d["s2"]


class StatefulCodec(Codec):
    """A codec whose sender measures its own activations and ships state on refresh (counted as
    ``pp_codec_state``). Subclasses name the state tensors in ``_STATE_FIELDS``."""

    stateful = True
    _STATE_FIELDS: tuple = ()

    def _init_state(self, second: bool):
        self.refresh = (self.cfg or RefreshConfig()).schedule()
        self.moments_halflife = float(getattr(self.cfg, "moments_halflife", 0) or 0)
        self.moments_step = None      # the training step the statistics are weighed at (halflife > 0)
        self.moments = RunningMoments(second)
        self.has_state = False
        self.state_bytes_sent = 0

    def message(self, key, shape, step: int, first_of_step: bool, train: bool, kind: str = "act") -> Message:
        if train and first_of_step and kind == "act":
            self._age_moments(step)
        return super().message(key, shape, step, first_of_step, train, kind)

    def _running_moments(self) -> list:
        """The statistics a refresh fits on (a subclass with more adds them)."""
        return [self.moments]

    def _age_moments(self, step: int) -> None:
        """``moments_halflife``: at the first training message of a step, weigh what was seen before
        by 0.5 ** (steps since / halflife). A function of the step numbers alone, so a resumed run
        (``moments_step`` is in the state) and a run with skipped steps (clean steps) agree."""
        if not self.moments_halflife:
            return
        if self.moments_step is not None and step > self.moments_step:
            factor = 0.5 ** ((step - self.moments_step) / self.moments_halflife)
            for m in self._running_moments():
                m.scale(factor)
        self.moments_step = step if self.moments_step is None else max(step, self.moments_step)

    def refresh_due(self, step: int) -> bool:
        return self.refresh.due(step)

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit-for-bit (saved per rank)."""
        return {"moments": self.moments.state_dict(), "has_state": self.has_state,
                "moments_step": self.moments_step, **{k: getattr(self, k) for k in self._STATE_FIELDS}}

    @classmethod
    def merge_states(cls, states: list[dict]) -> dict:
        """The running statistics pooled (count, sum and sum of squares each averaged: the same mean
        and covariance as all replicas' activations together, and a later merge weighs every replica
        alike again); the state on the wire (mean, basis, ...) from the first replica's link, so both
        new ends hold the same until the next refresh fits one on the pooled statistics."""
        from ..replicas import mean_state
        moments = [s["moments"] for s in states if s["moments"]["n"]]
        if not moments:
            return states[0]
        pooled = {**mean_state(moments), "n": sum(m["n"] for m in moments) / len(moments)}
        return {**states[0], "moments": pooled}

    def load_state_dict(self, d: dict) -> None:
        self.moments.load_state_dict(d["moments"])
        self.has_state = d["has_state"]
        self.moments_step = d.get("moments_step")     # absent in checkpoints from before the key
        for k in self._STATE_FIELDS:
            setattr(self, k, d[k])

    def state_tensor_count(self, msg: Message) -> int:
        return len(self._STATE_FIELDS) if self.carries_state(msg) else 0

    def carries_state(self, msg: Message) -> bool:
        """Whether this activation message carries new state (both ends answer the same)."""
        return msg.refresh or not self.has_state
