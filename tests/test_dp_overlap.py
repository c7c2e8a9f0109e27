"""Streaming DiLoCo's overlap window: the PowerSGD Q all-reduce in flight, and the merge rules.

Two replicas in one process (the reference engine's InProcessGroup: real sums, taking turns), a toy
model, every value compared exactly."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_twocircuit.dp.base import Collective
from ds_twocircuit.dp.powersgd import PowerSGDCompressor
from ds_twocircuit.dp.registry import build_backend
from ds_twocircuit.engines.reference import InProcessGroup, run_replicas

PSGD2 = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}


def _model(square=False):
    torch.manual_seed(0)
    if square:   # two fragments alike: a 16 x 16 matrix (compressed at rank 2) and a bias each
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


class _Replicas:
    """n replicas of (model, SGD, backend) on one in-process group; ``step(s)`` runs optimizer
    step s on each. ``before_dp(r, s)`` is called after the optimizer step, before the backend's
    ``after_optimizer_step`` (what the merge rule sees as the live weights)."""

    def __init__(self, cfg, n=2, lr=0.05, square=False):
        self.group = InProcessGroup(n)
        self.n = n
        self.models = [_model(square) for _ in range(n)]
        self.opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in self.models]
        self.backends = [build_backend(list(m.named_parameters()), self.group.comm(r), cfg)
                         for r, m in enumerate(self.models)]
        self.calls = [0] * n    # all-reduces issued, per replica
        for r, b in enumerate(self.backends):
            inner = b.comm.comm.all_reduce_sum

            def counted(t, async_op=False, r=r, inner=inner):
                self.calls[r] += 1
                return inner(t, async_op)
            b.comm.comm.all_reduce_sum = counted

    def step(self, s, before_dp=None):
        def one(r):
            m, opt, b = self.models[r], self.opts[r], self.backends[r]
            x, y = _batch(r, s)
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            b.reduce_gradients(s)
            opt.step()
            if before_dp is not None:
                before_dp(r, s)
            b.after_optimizer_step(s)
        run_replicas(self.group, one, self.n)

    def flat(self, r):
        return torch.cat([p.detach().reshape(-1) for p in self.models[r].parameters()])

    def state(self):
        bufs = []
        for m, o, b in zip(self.models, self.opts, self.backends):
            buf = io.BytesIO()
            torch.save({"m": m.state_dict(), "o": o.state_dict(), "b": b.state_dict()}, buf)
            bufs.append(buf.getvalue())
        return bufs

    def load(self, bufs):
        for m, o, b, raw in zip(self.models, self.opts, self.backends, bufs):
            st = torch.load(io.BytesIO(raw), weights_only=False)
            m.load_state_dict(st["m"])
            o.load_state_dict(st["o"])
            b.load_state_dict(st["b"])


# ------------------------------------------------------------------------------------------
# PowerSGD: when Q is launched changes no value

def _rounds(mode):
    """Two compressed averaging rounds of the same tensors on two replicas, the second with warm
    start and error feedback from the first; returns each replica's outputs and error buffers."""
    group = InProcessGroup(2)
    comps = [PowerSGDCompressor({"matrix_approximation_rank": 3, "warm_start": True}) for _ in range(2)]
    out = [[], []]

    def tensors(r, k):
        g = torch.Generator().manual_seed(100 * r + k)
        return [torch.randn(12, 10, generator=g), torch.randn(7, generator=g),
                torch.randn(9, 3, 4, generator=g)]

    for k in range(2):
        def one(r):
            comm = Collective(group.comm(r))
            ts = tensors(r, k)
            rnd = comps[r].start(ts, ["a", "b", "c"], comm, async_op=True)
            if mode in ("launch_q", "save_after_q"):
                rnd.launch_q()
            if mode in ("save_before_q", "save_after_q"):
                st = torch.load(io.BytesIO(_saved(rnd.state())), weights_only=False)
                ts = [torch.zeros_like(t) for t in ts]
                rnd = comps[r].restore_round(st, ts, comm)
            rnd.finish()
            out[r].append([t.clone() for t in ts])
            return None
        run_replicas(group, one, 2)
    return out, [{k: v.clone() for k, v in c.error.items()} for c in comps], [c.q for c in comps]


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["launch_q", "save_before_q", "save_after_q"])
def test_q_in_flight_and_saved_rounds_give_the_same_values(mode):
    ref_out, ref_err, ref_q = _rounds("finish")
    out, err, q = _rounds(mode)
    for r in range(2):
        for a, b in zip(ref_out[r], out[r]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        assert ref_err[r].keys() == err[r].keys() and all(torch.equal(ref_err[r][k], err[r][k]) for k in err[r])
        assert all(torch.equal(ref_q[r][k], q[r][k]) for k in q[r])
    # the two replicas agree on the compressed mean, which is not either replica's own tensor
    assert all(torch.equal(x, y) for x, y in zip(out[0][1], out[1][1]))


def test_q_all_reduce_is_launched_half_way_through_the_overlap_window():
    """H 8, 2 fragments, tau 4: fragment 0 launches P after step 7, Q after step 9 (7 + ceil(4/2)),
    and finishes after step 11 without a collective of its own; fragment 1 after steps 11, 13, 15.
    With tau 1 the Q all-reduce is issued when the sync finishes, one step after P."""
    def calls_per_step(tau):
        reps = _Replicas({"backend": "streaming_diloco", "inner_steps": 8, "num_fragments": 2,
                          "overlap_steps": tau, "outer_momentum": 0.0, "outer_lr": 1.0,
                          "compression": "powersgd", "powersgd": PSGD2}, square=True)
        b = reps.backends[0]
        comp = b.compressor
        for frag in b.fragments:   # each fragment: one coalesced bucket (uncompressed) + P, then Q
            ranks = [comp.rank_for(b.params[i].shape) for i in frag]
            assert any(ranks) and not all(ranks)
        per = []
        for s in range(18):
            before = reps.calls[0]
            reps.step(s)
            assert reps.calls[0] == reps.calls[1]
            per.append(reps.calls[0] - before)
        return per
    # each fragment's first all-reduce is one coalesced bucket (its vectors) plus P: 2 calls; Q: 1
    per = calls_per_step(4)
    assert {s: n for s, n in enumerate(per) if n} == {7: 2, 9: 1, 11: 2, 13: 1, 15: 2, 17: 1}
    per = calls_per_step(1)
    assert {s: n for s, n in enumerate(per) if n} == {7: 2, 8: 1, 11: 2, 12: 1, 15: 2, 16: 1}


# ------------------------------------------------------------------------------------------
# merge rules

@pytest.mark.parametrize("rule,outer_lr,compression", [("delayed", 1.0, None), ("delayed", 1.5, None),
                                                       ("delayed", 1.0, "powersgd"), ("mix", 1.0, None)])
def test_merge_rules_are_what_the_docstring_says(rule, outer_lr, compression):
    """One fragment, H 4, tau 2: the sync launched after step 3 lands after step 5. delayed:
    local <- backup_new + (local - local_at_launch); mix: local <- lerp(backup_new, local, alpha)."""
    cfg = {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 1, "overlap_steps": 2,
           "outer_momentum": 0.0, "outer_lr": outer_lr, "merge_rule": rule}
    if rule == "mix":
        cfg["merge_alpha"] = 0.25
    if compression:
        cfg.update(compression="powersgd", powersgd={"matrix_approximation_rank": 16, "start_powerSGD_iter": 0})
    reps = _Replicas(cfg)
    b_old = reps.flat(0)
    seen = {}
    for s in range(6):
        reps.step(s, before_dp=lambda r, s: seen.__setitem__((r, s), reps.flat(r)))
    launch = [seen[(r, 3)] for r in range(2)]
    now = [seen[(r, 5)] for r in range(2)]
    mean_delta = sum(b_old - x for x in launch) / 2
    b_new = b_old - outer_lr * mean_delta
    backup = torch.cat([t.reshape(-1) for t in reps.backends[0].backup])
    # rank 16 >= every matrix's rank here: PowerSGD's mean is exact up to rounding
    tol = dict(atol=1e-6, rtol=0) if compression else dict(atol=1e-7, rtol=0)
    assert torch.allclose(backup, b_new, **tol)
    for r in range(2):
        want = b_new + (now[r] - launch[r]) if rule == "delayed" else torch.lerp(b_new, now[r], 0.25)
        assert torch.allclose(reps.flat(r), want, **tol)
        # both rules keep the local steps' progress: the replicas still differ
        assert reps.backends[r].dirty == [True]
    assert not torch.equal(reps.flat(0), reps.flat(1))


def test_delayed_rule_keeps_every_local_step_that_mix_halves():
    """The replicas' mean after a landed sync: delayed = the outer update + the mean of the tau
    local steps taken since the launch; mix (alpha 0.5) = the outer update + half of them."""
    out = {}
    for rule in ("delayed", "mix"):
        cfg = {"backend": "streaming_diloco", "inner_steps": 4, "num_fragments": 1, "overlap_steps": 3,
               "outer_momentum": 0.0, "outer_lr": 1.0, "merge_rule": rule}
        reps = _Replicas(cfg)
        seen = {}
        for s in range(7):
            reps.step(s, before_dp=lambda r, s: seen.__setitem__((r, s), reps.flat(r)))
        b_new = torch.cat([t.reshape(-1) for t in reps.backends[0].backup])
        steps = sum(seen[(r, 6)] - seen[(r, 3)] for r in range(2)) / 2
        mean = (reps.flat(0) + reps.flat(1)) / 2
        out[rule] = (mean - b_new, steps)
    d, steps = out["delayed"]
    assert steps.abs().max() > 1e-3 and torch.allclose(d, steps, atol=1e-7)
    m, steps = out["mix"]
    assert torch.allclose(m, 0.5 * steps, atol=1e-7)


@pytest.mark.parametrize("cfg", [
    {"merge_rule": "delayed", "overlap_steps": 3, "compression": "powersgd", "powersgd": PSGD2},
    {"merge_rule": "delayed", "overlap_steps": 3},
    {"overlap_steps": 3, "compression": "powersgd", "powersgd": PSGD2},
])
@pytest.mark.parametrize("save_after", [7, 8])
def test_resume_in_the_overlap_window_is_exact(cfg, save_after):
    """H 6, 2 fragments, tau 3: fragment 0 launches after step 5, its Q after step 7, lands after
    step 8. A checkpoint after step 7 (Q in flight) or 8 (fragment 1 just launched) resumes into the
    same weights as the uninterrupted run, for both merge rules."""
    full = {"backend": "streaming_diloco", "inner_steps": 6, "num_fragments": 2,
            "outer_momentum": 0.0, "outer_lr": 1.0, **cfg}
    a = _Replicas(full)
    for s in range(16):
        a.step(s)
    b = _Replicas(full)
    for s in range(save_after):
        b.step(s)
    assert len(b.backends[0].pending) == 1
    saved = b.state()
    c = _Replicas(full)
    c.load(saved)
    for s in range(save_after, 16):
        c.step(s)
    for r in range(2):
        assert torch.equal(a.flat(r), c.flat(r))


def test_a_delayed_sync_cannot_resume_from_a_checkpoint_without_its_local_deltas():
    mix = {"backend": "streaming_diloco", "inner_steps": 6, "num_fragments": 2, "overlap_steps": 3,
           "outer_momentum": 0.0, "outer_lr": 1.0}
    b = _Replicas(mix)
    for s in range(7):
        b.step(s)
    saved = b.state()
    c = _Replicas({**mix, "merge_rule": "delayed"})
    with pytest.raises(ValueError, match="merge_rule"):
        c.load(saved)
