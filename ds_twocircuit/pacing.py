"""Software throttle: pace the project's own sends as if every link ran at a given rate.

For machines where the kernel cannot emulate a slow mesh (no network namespaces: unprivileged
containers, CI runners). Each directed link a process sends on is a :class:`Link` of ``mbit``
Mbit/s: a send of ``n`` payload bytes occupies it for ``n x FRAMING x 8 / rate`` seconds (TCP/IP
headers included, as a kernel cap counts them), starting when the link is free. As over a capped socket, a pipeline send returns at once (the kernel would buffer the
bytes) and the receiver gets the tensor when its transfer would have ended
(:class:`DeferredSender`); a blocking all-reduce returns when its ring bytes would have crossed,
counted from the moment every replica has arrived; an asynchronous one (Streaming DiLoCo's
overlapped fragments) books its time at launch and only its ``wait()`` waits, so the overlap with
compute is kept.

What is paced: every pipeline boundary payload (activations, gradients, codec state) on the link
to its peer stage, and every data-parallel all-reduce on the link to the ring neighbour (ring
bytes, as counted in ``wire.py``). Not paced: DeepSpeed's start-up weight broadcast and its tiny
meta messages, and the anchor's snapshots and gradients (files). ``tests/test_mesh.py`` compares
the throttle with the kernel cap of ``launch/mesh.py`` on the same run.

    python launch/train.py ... --pace-mbit 200          # or DS_TWOCIRCUIT_PACE_MBIT=200 in the environment
"""
from __future__ import annotations

import os
import queue
import threading
import time

ENV = "DS_TWOCIRCUIT_PACE_MBIT"
# TCP/IP over Ethernet carries 1448 payload bytes in a 1500-byte packet (+52 bytes of IP and TCP
# headers with timestamps): a link's rate is shared with them, and a kernel cap counts them.
FRAMING = 1500 / 1448


class Link:
    """One directed link at ``mbit`` Mbit/s (full duplex: the other direction is another Link);
    ``n`` payload bytes occupy it for ``n x FRAMING x 8 / rate`` seconds (headers included)."""

    def __init__(self, mbit: float, clock=time.monotonic, sleep=time.sleep):
        if not (isinstance(mbit, (int, float)) and mbit > 0):
            raise ValueError(f"a paced link needs a rate > 0 Mbit/s, got {mbit!r}")
        self.mbit, self._clock, self._sleep = float(mbit), clock, sleep
        self._free_at = 0.0
        self._lock = threading.Lock()
        self.bytes = 0
        self.waited_s = 0.0

    def book(self, nbytes: int) -> float:
        """Reserve the link for ``nbytes``; return the clock time at which the transfer ends."""
        with self._lock:
            now = self._clock()
            start = max(now, self._free_at)
            self._free_at = start + nbytes * FRAMING * 8.0 / (self.mbit * 1e6)
            self.bytes += int(nbytes)
            return self._free_at

    def wait_until(self, t: float) -> None:
        delay = t - self._clock()
        if delay > 0:
            self.waited_s += delay
            self._sleep(delay)

    def send(self, nbytes: int) -> None:
        """Block for as long as sending ``nbytes`` takes on this link (queued behind earlier sends)."""
        if nbytes > 0:
            self.wait_until(self.book(nbytes))


class Pacer:
    """The links one process sends on, by name (e.g. ``"pp->1"``, ``"dp"``), all at ``mbit``."""

    def __init__(self, mbit: float, clock=time.monotonic, sleep=time.sleep):
        Link(mbit)  # validates
        self.mbit, self._clock, self._sleep = float(mbit), clock, sleep
        self.links: dict[str, Link] = {}

    def link(self, name: str) -> Link:
        if name not in self.links:
            self.links[name] = Link(self.mbit, self._clock, self._sleep)
        return self.links[name]

    def send(self, name: str, nbytes: int) -> None:
        self.link(name).send(nbytes)

    def summary(self) -> dict:
        return {"mbit": self.mbit, "links": {k: {"bytes": l.bytes, "waited_s": round(l.waited_s, 3)}
                                             for k, l in sorted(self.links.items())}}


class DeferredSender:
    """Blocking point-to-point sends on a paced link, as a capped socket makes them: the call
    returns at once (the kernel buffers the bytes), the bytes leave one message after another at
    the link's rate, and the receiver gets each message when its transfer would have ended. A
    thread does the real sends (``send_fn``), in order, each at its booked end time.

    ``flush()`` waits until everything queued has been sent and raises a send's error, if any;
    a send that failed also makes the next ``put`` raise."""

    def __init__(self, link: Link, send_fn, name: str = "paced-sender"):
        self.link, self._send_fn = link, send_fn
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                payload, nbytes, done_at = item
                if self._error is None:
                    self.link.wait_until(done_at)
                    self._send_fn(payload)
            except BaseException as e:  # reported to the caller by flush() / put()
                self._error = e
            finally:
                self._q.task_done()

    def _raise(self):
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"a paced send failed: {e}") from e

    def put(self, payload, nbytes: int) -> None:
        """Queue ``payload`` (not to be modified afterwards: pass a copy) for sending."""
        self._raise()
        self._q.put((payload, int(nbytes), self.link.book(nbytes)))

    def flush(self) -> None:
        self._q.join()
        self._raise()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


class PacedWork:
    """An asynchronous collective's handle that completes no earlier than its booked end time.

    ``wait()`` and ``get_future()`` as a ``torch.distributed`` work object; the future is set
    when both the collective and the booked transfer time are over."""

    def __init__(self, work, link: Link, done_at: float):
        import torch
        self._work, self._link, self._done_at = work, link, done_at
        self._fut = torch.futures.Future()
        self._lock = threading.Lock()      # the timer thread and wait() may both finish it
        work.get_future().then(self._inner_done)

    def _inner_done(self, fut):  # the comm thread, when the collective itself completes
        delay = self._done_at - self._link._clock()
        if delay > 0:
            t = threading.Timer(delay, self._finish)
            t.daemon = True
            t.start()
        else:
            self._finish()

    def _finish(self):
        with self._lock:
            if not self._fut.done():
                self._fut.set_result(None)

    def wait(self) -> bool:
        self._work.wait()
        self._link.wait_until(self._done_at)
        self._finish()
        return True

    def get_future(self):
        return self._fut


class PacedComm:
    """A DP :class:`~ds_twocircuit.dp.base.Communicator` whose all-reduces, all-gathers and all-to-alls take as
    long as their ring bytes need on ``link``. Blocking: the transfer starts when every replica has arrived (the
    collective itself is the barrier), then the caller waits its time. Asynchronous: booked at
    launch, waited for in ``wait()``."""

    def __init__(self, inner, link: Link):
        self.inner, self.link = inner, link
        self.world_size, self.rank = inner.world_size, inner.rank

    def _paced(self, nbytes: int, call, async_op: bool):
        if not async_op:
            call(False)
            self.link.send(nbytes)
            return None
        done_at = self.link.book(nbytes)
        return PacedWork(call(True), self.link, done_at)

    def all_reduce_sum(self, t, async_op: bool = False):
        from .wire import ring_allreduce_bytes, tensor_bytes
        return self._paced(ring_allreduce_bytes(tensor_bytes(t), self.world_size),
                           lambda a: self.inner.all_reduce_sum(t, async_op=a), async_op)

    def all_gather_into(self, out, t, async_op: bool = False):
        from .wire import ring_allgather_bytes, tensor_bytes
        return self._paced(ring_allgather_bytes(tensor_bytes(t), self.world_size),
                           lambda a: self.inner.all_gather_into(out, t, async_op=a), async_op)

    def all_to_all_into(self, out, t, async_op: bool = False):
        from .wire import alltoall_bytes, tensor_bytes
        return self._paced(alltoall_bytes(tensor_bytes(t), self.world_size),
                           lambda a: self.inner.all_to_all_into(out, t, async_op=a), async_op)


_pacer: Pacer | None = None
_configured = False


def configure(mbit: float | None) -> Pacer | None:
    """Pace this process's sends at ``mbit`` (None or 0: no pacing). Returns the pacer."""
    global _pacer, _configured
    _pacer = Pacer(mbit) if mbit else None
    _configured = True
    return _pacer


def current() -> Pacer | None:
    """This process's pacer: the one configured, else from ``DS_TWOCIRCUIT_PACE_MBIT``, else None."""
    global _configured
    if not _configured:
        raw = os.environ.get(ENV, "").strip()
        if raw:
            try:
                mbit = float(raw)
            except ValueError:
                raise ValueError(f"{ENV}={raw!r}: expected a rate in Mbit/s, e.g. 200") from None
            if mbit < 0:
                raise ValueError(f"{ENV}={raw!r}: the rate must be >= 0 (0: no pacing)")
            configure(mbit)
        _configured = True
    return _pacer


def send(link: str, nbytes: int) -> None:
    """After a collective that sent ``nbytes`` on ``link``: wait as the capped link would."""
    p = current()
    if p is not None:
        p.send(link, nbytes)
