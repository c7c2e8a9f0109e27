"""The software throttle's arithmetic (fake clock) and its collective wrappers (real futures)."""
import time

import pytest
import torch

from ds_twocircuit import pacing
from ds_twocircuit.dp.base import Collective, Communicator


F = pacing.FRAMING


class FakeClock:
    def __init__(self):
        self.t = 100.0
        self.slept = []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def test_a_link_serialises_sends_at_its_rate():
    c = FakeClock()
    link = pacing.Link(8.0, c, c.sleep)             # 8 Mbit/s = 1 MB/s of packets; payload 1 MB / F
    link.send(1_000_000)
    assert F == pytest.approx(1500 / 1448)          # 52 bytes of headers per 1448 of payload
    assert c.slept == [pytest.approx(F)] and c() == pytest.approx(100 + F)
    # two bookings back to back: the second waits for the first
    end1, end2 = link.book(500_000), link.book(500_000)
    assert end1 == pytest.approx(100 + 1.5 * F) and end2 == pytest.approx(100 + 2 * F)
    link.wait_until(end2)
    assert c() == pytest.approx(100 + 2 * F)
    c.t += 10.0                                     # an idle link does not bank credit
    link.send(250_000)
    assert c() == pytest.approx(110 + 2.25 * F)
    assert link.bytes == 2_250_000 and link.waited_s == pytest.approx(2.25 * F)
    link.send(0)                                    # nothing sent: no wait
    assert c() == pytest.approx(110 + 2.25 * F)


def test_links_are_independent_and_rates_are_checked():
    c = FakeClock()
    p = pacing.Pacer(80.0, c, c.sleep)
    p.send("pp->1", 1_000_000)                      # 0.1 F s
    t = c()
    assert p.link("pp->0").book(1_000_000) == pytest.approx(t + 0.1 * F)   # the other link is free
    assert p.summary()["links"]["pp->1"] == {"bytes": 1_000_000, "waited_s": round(0.1 * F, 3)}
    for bad in (0, -5, "200", None):
        with pytest.raises(ValueError, match="rate > 0"):
            pacing.Link(bad)


def test_configuration_from_flag_and_environment(monkeypatch):
    monkeypatch.setattr(pacing, "_configured", False)
    monkeypatch.setattr(pacing, "_pacer", None)
    monkeypatch.delenv(pacing.ENV, raising=False)
    assert pacing.current() is None
    pacing.send("pp->1", 10 ** 9)                   # no pacer: returns at once
    monkeypatch.setattr(pacing, "_configured", False)
    monkeypatch.setenv(pacing.ENV, "25")
    assert pacing.current().mbit == 25.0
    pacing.configure(0)
    assert pacing.current() is None
    for bad, msg in (("fast", "expected a rate"), ("-3", "must be >= 0")):
        monkeypatch.setattr(pacing, "_configured", False)
        monkeypatch.setenv(pacing.ENV, bad)
        with pytest.raises(ValueError, match=msg):
            pacing.current()
    pacing.configure(None)


class _Done:
    """A completed collective (what gloo returns once it has finished)."""

    def __init__(self):
        self._f = torch.futures.Future()
        self._f.set_result(None)

    def wait(self):
        return True

    def get_future(self):
        return self._f


class TwoReplicas(Communicator):
    world_size, rank = 2, 0

    def __init__(self):
        self.calls = 0

    def all_reduce_sum(self, t, async_op=False):
        self.calls += 1
        t.mul_(2)                                   # the other replica holds the same values
        return _Done() if async_op else None


def test_paced_all_reduce_takes_its_ring_bytes_time():
    c = FakeClock()
    comm = pacing.PacedComm(TwoReplicas(), pacing.Link(8.0, c, c.sleep))
    t = torch.ones(250_000)                         # 1 MB; a ring of 2 sends 1 MB per rank
    comm.all_reduce_sum(t)
    assert comm.inner.calls == 1 and torch.equal(t, torch.full_like(t, 2.0))
    assert c.slept == [pytest.approx(F)]
    assert (comm.world_size, comm.rank) == (2, 0)


class FourGatherers(Communicator):
    world_size, rank = 4, 1

    def all_gather_into(self, out, t, async_op=False):
        out.copy_(torch.cat([t + r for r in range(self.world_size)]))
        return _Done() if async_op else None


def test_paced_all_gather_takes_its_ring_bytes_time():
    """A ring all-gather of 4 replicas: each rank sends the 3 others' payloads on its link, 3 x its
    own bytes (the quantised DiLoCo sync), and Collective counts the same."""
    c = FakeClock()
    comm = pacing.PacedComm(FourGatherers(), pacing.Link(8.0, c, c.sleep))
    col = Collective(comm)
    payload = torch.zeros(1_000_000 // 3, dtype=torch.uint8)      # 333,333 bytes
    out, pending = col.all_gather(payload)
    pending.wait()
    assert out.shape == (4, payload.numel()) and torch.equal(out[3], torch.full_like(payload, 3))
    assert col.stats["bytes_sent"] == 3 * payload.numel() == comm.link.bytes
    assert c.slept == [pytest.approx(3 * payload.numel() * 8 / 8e6 * F)]


class FourScatterers(Communicator):
    world_size, rank = 4, 1

    def all_to_all_into(self, out, t, async_op=False):
        out.copy_(t + 1)                            # what the others sent this one
        return _Done() if async_op else None


def test_paced_all_to_all_takes_the_bytes_it_sends_away():
    """An all-to-all of 4 replicas (the quantised reduce-scatter's first phase): a rank keeps its
    own row and sends the 3 others, 3 / 4 of its payload, on its link; Collective counts the same."""
    c = FakeClock()
    comm = pacing.PacedComm(FourScatterers(), pacing.Link(8.0, c, c.sleep))
    col = Collective(comm)
    payload = torch.zeros(4, 250_000, dtype=torch.uint8)           # 1 MB, 250 kB per replica
    out, pending = col.all_to_all(payload)
    pending.wait()
    assert torch.equal(out, torch.ones_like(payload))
    assert col.stats["bytes_sent"] == 750_000 == comm.link.bytes
    assert c.slept == [pytest.approx(750_000 * 8 / 8e6 * F)]
    with pytest.raises(ValueError, match=r"\(world_size=4, k\) tensor"):
        col.all_to_all(torch.zeros(3, 5, dtype=torch.uint8))


def test_paced_async_all_reduce_overlaps_and_books_on_the_dp_stats():
    """Launched, then 0.15 s of other work, then wait: the booked 0.26 s transfer ends 0.11 s
    after the work, and Collective's stats see it as a 0.26 s collective, 0.15 s of it hidden."""
    link = pacing.Link(8.0)                         # real clock: 250 kB take 0.25 s
    col = Collective(pacing.PacedComm(TwoReplicas(), link))
    t = torch.ones(62_500)
    t0 = time.perf_counter()
    pending = col.all_reduce_sum(t, async_op=True)
    assert time.perf_counter() - t0 < 0.05          # launching does not wait
    time.sleep(0.15)
    pending.wait()
    elapsed = time.perf_counter() - t0
    assert 0.25 * F <= elapsed < 0.4, elapsed
    assert col.stats["comm_s"] == pytest.approx(0.25 * F, abs=0.06)
    assert col.stats["hidden_comm_s"] == pytest.approx(0.15, abs=0.04)
    assert col.stats["bytes_sent"] == 250_000 == link.bytes


def test_a_collective_waited_for_in_a_later_step_counts_in_that_steps_stats():
    """Streaming DiLoCo launches a sync in one step and waits for it in a later one; each step's
    stats are handed out (popped) at its end. The wait's seconds land in the stats popped after the
    wait, not in the launch step's dict already handed out (where the trainer never saw them: its
    dp_comm_s stayed 0.0)."""
    link = pacing.Link(8.0)
    col = Collective(pacing.PacedComm(TwoReplicas(), link))
    pending = col.all_reduce_sum(torch.ones(62_500), async_op=True)
    launch_step = col.pop_stats()
    time.sleep(0.15)
    pending.wait()
    wait_step = col.pop_stats()
    assert launch_step["bytes_sent"] == 250_000 and launch_step["comm_s"] == 0.0
    # bounds that hold on a busy machine too (a sleep only overshoots)
    assert wait_step["comm_s"] >= 0.25 * F - 0.01
    assert 0.15 - 0.01 <= wait_step["hidden_comm_s"] <= wait_step["comm_s"]


def test_deferred_sends_leave_in_order_at_their_booked_times():
    """The caller never waits; each message is handed to the real send when its transfer on the
    link would end (0.05 s per 50 kB at 8 Mbit/s, back to back); a failed send is raised."""
    sent = []
    link = pacing.Link(8.0)
    t0 = time.monotonic()
    s = pacing.DeferredSender(link, lambda x: sent.append((x, time.monotonic() - t0)))
    for k in range(3):
        s.put(k, 50_000)
    assert time.monotonic() - t0 < 0.04 and sent == []
    s.flush()
    assert [x for x, _ in sent] == [0, 1, 2]
    for k, (_, t) in enumerate(sent):
        assert 0.05 * F * (k + 1) - 0.005 <= t < 0.05 * F * (k + 1) + 0.15, sent   # never early

    def broken(x):
        raise ConnectionError("peer gone")
    bad = pacing.DeferredSender(pacing.Link(1e4), broken)
    bad.put("x", 10)
    with pytest.raises(RuntimeError, match="a paced send failed: peer gone"):
        bad.flush()
    bad.flush()                                     # reported once
    s.close()
    bad.close()
