"""Run a function on N real gloo ranks (spawned processes, FileStore rendezvous) from a test.

    results = run_distributed(worker, 2, tmp_path, arg1, ...)   # worker(rank, world, arg1, ...)

``worker`` must be a module-level function of an importable module (the spawned children import
it by name).  Each rank's return value comes back through a ``torch.save`` file; if any rank
raises, the call fails with every rank's traceback; if the ranks do not finish within
``timeout`` seconds they are terminated and the call fails (no test ever hangs).
"""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn, rank, world, store_path, out_path, args, timeout_s):
    torch.set_num_threads(1)
    result = None
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # report, never hang the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, out_path)


def run_distributed(fn, world_size: int, tmp_path, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    tmp_path = str(tmp_path)
    os.makedirs(tmp_path, exist_ok=True)
    store_path = os.path.join(tmp_path, "filestore")
    outs = [os.path.join(tmp_path, f"rank{r}.pt") for r in range(world_size)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(fn, r, world_size, store_path, outs[r], args, int(timeout)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for p in procs:
        p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].terminate()
        procs[r].join(5)
    if hung:
        raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
    results, errors = [], []
    for r, path in enumerate(outs):
        if not os.path.exists(path):
            errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result")
            continue
        res = torch.load(path, weights_only=False)
        if "error" in res:
            errors.append(f"rank {r}:\n{res['error']}")
        results.append(res.get("ok"))
    if errors:
        raise AssertionError("distributed worker failed:\n" + "\n".join(errors))
    return results
