"""The anchor fence (``anchor/fence.py``): DP replicas that see anchor gradients at different
times still use the same ones at the same step, with one asynchronous vote per fence. Pure: the
replicas and the MIN all-reduce are simulated."""
import pytest
import torch

from ds_twocircuit.anchor.fence import AnchorFence


def _run(visible_at, every=4, steps=60, n=2, hold=2):
    """visible_at[r][s]: the step at which replica r first sees source step s in the store.
    Returns, per replica, the (step, source step) pairs it used, and the votes cast."""
    fences = [AnchorFence(every, slots=8, hold=hold) for _ in range(n)]
    last = [None] * n
    used = [[] for _ in range(n)]
    pending = None
    for step in range(steps):
        if step % every:
            continue
        result = None if pending is None else torch.stack(pending).min(0).values  # the MIN all-reduce
        votes = []
        for r, f in enumerate(fences):
            got = f.resolve(result, last[r])
            if got is not None:
                assert got[1] == f"grads{got[0]}"
                used[r].append((step, got[0]))
                last[r] = got[0]
            seen = [s for s, t in visible_at[r].items() if t <= step]
            newest = max([s for s in (last[r], f.newest_held()) if s is not None], default=None)
            fresh = [s for s in seen if newest is None or s > newest]
            if fresh:  # the store read returns the newest visible one
                f.offer(max(fresh), f"grads{max(fresh)}", last[r])
            votes.append(f.vote(step))
        pending = votes
    return used


def test_replicas_use_the_same_gradients_at_the_same_step_when_they_see_them_at_different_times():
    # source step s becomes visible to replica 0 at s + 5, to replica 1 at s + 9 (a slow file system)
    vis = [{s: s + 5 for s in range(0, 48, 4)}, {s: s + 9 for s in range(0, 48, 4)}]
    used = _run(vis)
    assert used[0] == used[1] and len(used[0]) >= 6
    for step, src in used[0]:
        # used one fence after the slower replica saw it, and no later than two fences after that
        assert step - src >= 9 and step - src <= 9 + 2 * 4 + 4
    srcs = [s for _, s in used[0]]
    assert srcs == sorted(set(srcs))  # strictly newer each time


def test_a_replica_that_never_sees_a_step_blocks_only_that_step():
    vis = [{s: s + 1 for s in range(0, 48, 4)}, {s: s + 1 for s in range(0, 48, 4) if s != 20}]
    used = _run(vis)
    assert used[0] == used[1]
    assert 20 not in [s for _, s in used[0]] and 24 in [s for _, s in used[0]]


def test_an_anchor_that_stops_leaves_the_replicas_in_step():
    vis = [{s: s + 2 for s in range(0, 16, 4)}, {s: s + 6 for s in range(0, 16, 4)}]
    used = _run(vis, steps=80)
    assert used[0] == used[1] and used[0][-1][1] == 12


def test_vote_window_and_hold_limit():
    f = AnchorFence(4, slots=3, hold=2)
    for s in (0, 4, 8):
        f.offer(s, s, None)
    assert sorted(f.held) == [4, 8]  # the newest two
    v = f.vote(12)
    assert v.dtype == torch.int32 and v.tolist() == [0, 1, 1]
    assert f.resolve(torch.tensor([0, 1, 1], dtype=torch.int32), None) == (8, 8)
    assert f.held == {}
    f.offer(4, 4, None)
    assert f.vote(100).tolist() == [0, 0, 0] and f.held == {}  # out of the window: dropped
    f.offer(96, 96, last_used=96)
    assert f.held == {}  # already used
    with pytest.raises(ValueError):
        AnchorFence(0)
