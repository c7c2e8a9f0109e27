"""Tests of ds_twocircuit.anchor.store (SnapshotStore)."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import warnings
from pathlib import Path

import time

import pytest
import torch

from ds_twocircuit import wire
from ds_twocircuit.anchor.store import COMMITTED, LATEST, RETIRED, SnapshotStore, StoreWarning


def write_fake_checkpoint(store: SnapshotStore, tag: str, step: int, numel: int = 256) -> dict[str, int]:
    """Files shaped like a DeepSpeed PP checkpoint, each holding tensors filled with ``step``."""
    tag_dir = store.prepare_snapshot(tag)
    tag_dir.mkdir(parents=True)
    for name in ("layer_01-model_states.pt", "mp_rank_00_model_states.pt"):
        torch.save({"w": torch.full((numel,), float(step))}, tag_dir / name)
    return {p.name: p.stat().st_size for p in tag_dir.iterdir()}


def commit(store, step, **kw):
    sizes = write_fake_checkpoint(store, f"global_step{step}", step, **kw)
    info = store.commit_snapshot(f"global_step{step}", step, {"global_batch_index": step * 10})
    return info, sizes


def truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


# ------------------------------------------------------------------------------------------------
# snapshots
# ------------------------------------------------------------------------------------------------

def test_commit_and_read_latest(tmp_path):
    store = SnapshotStore(tmp_path)
    assert store.latest_committed_snapshot() is None
    commit(store, 2)
    info, sizes = commit(store, 4)
    latest = store.latest_committed_snapshot()
    assert latest == info
    assert (latest.tag, latest.step, latest.batch_id) == ("global_step4", 4, {"global_batch_index": 40})
    assert latest.files == sizes and latest.total_bytes == sum(sizes.values())
    assert latest.path == tmp_path / "snapshots" / "global_step4"
    record = json.loads((latest.path / COMMITTED).read_text())
    assert {e["path"]: e["size"] for e in record["files"]} == sizes and record["step"] == 4
    assert json.loads((tmp_path / LATEST).read_text()) == {"tag": "global_step4", "step": 4}
    assert not list(latest.path.glob(".*"))                      # no temp files left behind
    loaded = torch.load(latest.file_paths()[0], weights_only=True)
    assert torch.equal(loaded["w"], torch.full((256,), 4.0))


def test_snapshot_without_marker_is_invisible(tmp_path):
    store = SnapshotStore(tmp_path)
    write_fake_checkpoint(store, "global_step9", 9)               # written, never committed
    assert store.latest_committed_snapshot() is None
    assert store.acquire_latest_snapshot("anchor") is None
    commit(store, 3)
    assert store.latest_committed_snapshot().step == 3            # the newer, uncommitted one stays hidden


def test_commit_checks_reported_sizes_and_files(tmp_path):
    store = SnapshotStore(tmp_path)
    sizes = write_fake_checkpoint(store, "t", 1)
    wrong = {k: v + 1 for k, v in sizes.items()}
    with pytest.raises(RuntimeError, match="writer reported"):
        store.commit_snapshot("t", 1, {}, files=wrong)
    with pytest.raises(FileNotFoundError):
        store.commit_snapshot("t", 1, {}, files=["missing.pt"])
    with pytest.raises(TypeError):
        store.commit_snapshot("t", 1, {"not json": object()})
    assert store.latest_committed_snapshot() is None
    info = store.commit_snapshot("t", 1, {}, files=sizes)
    assert info.files == sizes


@pytest.mark.parametrize("damage", ["truncate", "delete", "bad_marker"])
def test_damaged_snapshot_is_skipped_with_warning(tmp_path, damage):
    store = SnapshotStore(tmp_path)
    commit(store, 1)
    info, _ = commit(store, 2)
    if damage == "truncate":
        truncate(info.file_paths()[0], 100)
    elif damage == "delete":
        info.file_paths()[1].unlink()
    else:
        (info.path / COMMITTED).write_text('{"format": 1, "files": [')
    with pytest.warns(StoreWarning, match="global_step2"):
        latest = store.latest_committed_snapshot()
    assert latest.step == 1
    lease = store.acquire_latest_snapshot("anchor")
    assert lease.info.step == 1
    lease.release()


def test_checksums_catch_same_size_corruption(tmp_path):
    store = SnapshotStore(tmp_path, checksums=True)
    commit(store, 1)
    info, _ = commit(store, 2)
    assert all("sha256" in e for e in json.loads((info.path / COMMITTED).read_text())["files"])
    path = info.file_paths()[0]
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(StoreWarning, match="sha256"):
        assert store.latest_committed_snapshot().step == 1


def test_retention_keeps_last_n(tmp_path):
    store = SnapshotStore(tmp_path, keep=2)
    for step in range(1, 6):
        commit(store, step)
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == ["global_step4", "global_step5"]
    assert store.latest_committed_snapshot().step == 5


def test_retention_never_deletes_a_leased_snapshot(tmp_path):
    store = SnapshotStore(tmp_path, keep=2)
    info1, _ = commit(store, 1)
    lease = store.acquire_latest_snapshot("anchor")
    assert lease.info == info1
    for step in range(2, 6):
        commit(store, step)
    # retired (invisible to new readers), but the holder can still read every file
    assert (info1.path / RETIRED).exists() and not (info1.path / COMMITTED).exists()
    assert all(torch.equal(torch.load(p, weights_only=True)["w"], torch.full((256,), 1.0)) for p in lease.info.file_paths())
    assert store.latest_committed_snapshot().step == 5
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == ["global_step1", "global_step4", "global_step5"]
    lease.release()
    commit(store, 6)
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == ["global_step5", "global_step6"]
    assert not (store.leases_dir / "global_step1").exists()


def test_stale_lease_expires(tmp_path):
    now = [1000.0]
    store = SnapshotStore(tmp_path, keep=1, lease_ttl_s=60.0, clock=lambda: now[0])
    commit(store, 1)
    lease = store.acquire_latest_snapshot("crashed-reader")          # never released
    now[0] += 30.0
    commit(store, 2)
    assert (store.snapshots_dir / "global_step1").exists()           # lease still live
    now[0] += 20.0
    lease.renew()                                                   # renewed at t = 1050
    now[0] += 50.0
    commit(store, 3)
    assert (store.snapshots_dir / "global_step1").exists()           # 50 s after renewal: live
    now[0] += 11.0
    commit(store, 4)
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == ["global_step4"]


def test_acquire_retries_when_the_tag_is_retired_after_the_lease(tmp_path):
    """The writer retires the chosen tag between the reader's choice and its lease: the reader
    must notice and take the next complete snapshot instead."""

    class RacingStore(SnapshotStore):
        raced = False

        def _write_lease(self, path, tag, reader_id):
            super()._write_lease(path, tag, reader_id)
            if not self.raced:
                self.raced = True
                os.replace(self.snapshots_dir / tag / COMMITTED, self.snapshots_dir / tag / RETIRED)

    store = RacingStore(tmp_path, keep=3)
    commit(store, 1)
    commit(store, 2)
    lease = store.acquire_latest_snapshot("anchor")
    assert store.raced and lease.info.step == 1
    assert [p.name for p in (store.leases_dir / "global_step2").iterdir()] == []
    assert [p.name for p in (store.leases_dir / "global_step1").iterdir()] == ["anchor.json"]


def test_prepare_snapshot_invalidates_a_resaved_tag(tmp_path):
    store = SnapshotStore(tmp_path)
    commit(store, 1)
    commit(store, 2)
    store.prepare_snapshot("global_step2")                          # about to be overwritten
    assert store.latest_committed_snapshot().step == 1
    lease = store.acquire_latest_snapshot("anchor")
    with pytest.raises(RuntimeError, match="holds it"):
        store.prepare_snapshot("global_step1")
    lease.release()


def test_discard_after_forgets_a_dead_timeline(tmp_path):
    store = SnapshotStore(tmp_path, keep=5)
    for step in (1, 2, 3):
        commit(store, step)
        store.publish_anchor_gradients(0, step, {"w": torch.ones(2)})
    store.discard_after(1)
    assert store.latest_committed_snapshot().step == 1
    assert json.loads((tmp_path / LATEST).read_text())["tag"] == "global_step1"
    assert store.poll_anchor_gradients(0).source_step == 1


# ------------------------------------------------------------------------------------------------
# anchor gradients
# ------------------------------------------------------------------------------------------------

def grads_for(step, stage):
    return {"layers.0.q_proj.weight": torch.full((4, 3), float(step + 100 * stage)),
            "layers.0.o_proj.weight": torch.full((3, 4), -float(step)).bfloat16()}


def test_poll_gradients(tmp_path):
    store = SnapshotStore(tmp_path, keep_grads=10)
    assert store.poll_anchor_gradients(0, after_step=-1) is None
    for step in (10, 20, 30):
        store.publish_anchor_gradients(0, step, grads_for(step, 0), batch_id={"global_batch_index": step})
    store.publish_anchor_gradients(1, 20, grads_for(20, 1))
    got = store.poll_anchor_gradients(0, after_step=None)
    assert (got.source_step, got.stage, got.batch_id) == (30, 0, {"global_batch_index": 30})
    assert torch.equal(got.grads["layers.0.q_proj.weight"], torch.full((4, 3), 30.0))
    assert got.grads["layers.0.o_proj.weight"].dtype == torch.bfloat16
    assert store.poll_anchor_gradients(0, after_step=25).source_step == 30
    assert store.poll_anchor_gradients(0, after_step=30) is None
    got1 = store.poll_anchor_gradients(1, after_step=0)
    assert got1.source_step == 20 and torch.equal(got1.grads["layers.0.q_proj.weight"], torch.full((4, 3), 120.0))
    assert store.poll_anchor_gradients(1, after_step=20) is None
    assert store.poll_anchor_gradients(2, after_step=None) is None


def test_uncommitted_gradient_file_is_invisible(tmp_path):
    store = SnapshotStore(tmp_path)
    store.publish_anchor_gradients(0, 5, grads_for(5, 0))
    folder = store.grads_dir / "step_00000009"
    folder.mkdir()
    torch.save({"format": 1, "source_step": 9, "stage": 0, "batch_id": None, "grads": grads_for(9, 0)},
               folder / "stage_00.pt")                               # no marker
    assert store.poll_anchor_gradients(0, after_step=None).source_step == 5


@pytest.mark.parametrize("damage", ["truncate", "same_size_garbage"])
def test_corrupt_gradient_file_is_skipped_with_warning(tmp_path, damage):
    store = SnapshotStore(tmp_path)
    store.publish_anchor_gradients(0, 10, grads_for(10, 0))
    path = store.publish_anchor_gradients(0, 20, grads_for(20, 0))
    if damage == "truncate":
        truncate(path, path.stat().st_size // 2)
    else:
        path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.warns(StoreWarning, match="step_00000020"):
        got = store.poll_anchor_gradients(0, after_step=5)
    assert got.source_step == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")                             # warned once, not on every poll
        assert store.poll_anchor_gradients(0, after_step=5).source_step == 10
        assert store.poll_anchor_gradients(0, after_step=10) is None


def test_old_gradients_are_pruned(tmp_path):
    store = SnapshotStore(tmp_path, keep_grads=2)
    for step in range(1, 6):
        for stage in (0, 1):
            store.publish_anchor_gradients(stage, step, grads_for(step, stage))
    assert sorted(p.name for p in store.grads_dir.iterdir()) == ["step_00000004", "step_00000005"]


def test_anchor_bytes_counted_equal_file_sizes(tmp_path):
    store = SnapshotStore(tmp_path)
    before = wire.totals()["anchor"]
    info, sizes = commit(store, 1, numel=1000)
    after_snapshot = wire.totals()["anchor"]
    assert after_snapshot - before == sum(sizes.values()) == info.total_bytes > 8000
    p0 = store.publish_anchor_gradients(0, 1, grads_for(1, 0))
    p1 = store.publish_anchor_gradients(1, 1, grads_for(1, 1))
    assert wire.totals()["anchor"] - after_snapshot == p0.stat().st_size + p1.stat().st_size
    # reading costs nothing here: the bytes were counted once, by the writer
    store.latest_committed_snapshot()
    store.poll_anchor_gradients(0)
    assert wire.totals()["anchor"] - after_snapshot == p0.stat().st_size + p1.stat().st_size


# ------------------------------------------------------------------------------------------------
# concurrency: a writer process and a reader never see a partial entry
# ------------------------------------------------------------------------------------------------

N_SNAPSHOTS = 40


def _writer_process(root: str, ready, done) -> None:
    store = SnapshotStore(root, keep=1, keep_grads=2)
    ready.set()
    for step in range(1, N_SNAPSHOTS + 1):
        tag = f"global_step{step}"
        tag_dir = store.prepare_snapshot(tag)
        tag_dir.mkdir(parents=True)
        for name in ("layer_01-model_states.pt", "mp_rank_00_model_states.pt"):
            # like DeepSpeed: written in place, in pieces, no temp file and no rename
            with open(tag_dir / name, "wb") as f:
                torch.save({"w": torch.full((4096,), float(step))}, f)
        store.commit_snapshot(tag, step, {"global_batch_index": step})
        store.publish_anchor_gradients(0, step, {"w": torch.full((64, 64), float(step))}, batch_id=step)
    done.set()


def test_concurrent_reader_never_sees_a_partial_entry(tmp_path):
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_writer_process, args=(str(tmp_path), ready, done))
    writer.start()
    try:
        assert ready.wait(timeout=120), "writer did not start"
        store = SnapshotStore(tmp_path, keep=1, keep_grads=2)
        snapshot_loads, grad_loads, last_grad = 0, 0, -1
        with warnings.catch_warnings():
            warnings.simplefilter("error", StoreWarning)           # any skipped entry fails the test
            while True:
                finished = done.is_set() or not writer.is_alive()
                lease = store.acquire_latest_snapshot("reader")
                if lease is not None:
                    with lease:
                        for path in lease.info.file_paths():
                            w = torch.load(path, weights_only=True)["w"]
                            assert torch.equal(w, torch.full((4096,), float(lease.info.step)))
                        snapshot_loads += 1
                got = store.poll_anchor_gradients(0, after_step=last_grad)
                if got is not None:
                    assert got.batch_id == got.source_step > last_grad
                    assert torch.equal(got.grads["w"], torch.full((64, 64), float(got.source_step)))
                    last_grad = got.source_step
                    grad_loads += 1
                if finished:
                    break
        writer.join(timeout=60)
        assert writer.exitcode == 0
        assert snapshot_loads >= 2 and grad_loads >= 2
        assert last_grad == N_SNAPSHOTS
        assert store.latest_committed_snapshot().step == N_SNAPSHOTS
        # a tag leased during the writer's last prune is only retired; with every lease released the
        # next prune (any process may run it) leaves exactly `keep`
        store.prune_snapshots()
        assert [p.name for p in store.snapshots_dir.iterdir()] == [f"global_step{N_SNAPSHOTS}"]
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join()


def test_layer_file_index_parses_any_number_of_digits():
    from ds_twocircuit.adapters.anchor_circuit import layer_file_index
    assert layer_file_index("layer_07-model_states.pt") == 7
    assert layer_file_index("layer_123-model_states.pt") == 123
    with pytest.raises(ValueError):
        layer_file_index("mp_rank_00_model_states.pt")


def _run_snapshot(store, step, run="r1"):
    tag = f"step{step:08d}"
    sizes = write_fake_checkpoint(store, tag, step)
    return store.commit_snapshot(tag, step, {"run": run, "step": step}, files=sizes)


def test_anchor_loads_under_a_lease_that_retention_respects(tmp_path):
    from ds_twocircuit.adapters.anchor_circuit import pick_snapshot
    store = SnapshotStore(tmp_path, keep=1)
    _run_snapshot(store, 20)
    lease = pick_snapshot(store, "r1", -1, set(), "anchor-t")
    assert lease is not None and lease.info.step == 20
    _run_snapshot(store, 40)          # retention would retire and delete step 20 now ...
    store.prune_snapshots()
    assert lease.path.is_dir() and all(p.exists() for p in lease.info.file_paths())  # ... but it is leased
    lease.release()
    store.prune_snapshots()
    assert not (tmp_path / "snapshots" / "step00000020").exists()
    # a snapshot of another run, or not newer than the last one processed, is not picked (and not held)
    assert pick_snapshot(store, "other-run", -1, set(), "anchor-t") is None
    assert pick_snapshot(store, "r1", 40, set(), "anchor-t") is None
    assert not any((tmp_path / "leases").rglob("*.json"))


def test_a_bad_tag_committed_again_is_a_new_snapshot(tmp_path):
    from ds_twocircuit.adapters.anchor_circuit import pick_snapshot
    store = SnapshotStore(tmp_path, keep=2)
    info = _run_snapshot(store, 20)
    bad = {(info.tag, info.committed_at)}   # the anchor could not read it
    assert pick_snapshot(store, "r1", -1, bad, "anchor-t") is None
    time.sleep(0.01)
    again = _run_snapshot(store, 20)          # committed again after a resume (same tag)
    assert again.committed_at != info.committed_at
    lease = pick_snapshot(store, "r1", -1, bad, "anchor-t")
    assert lease is not None and lease.info.committed_at == again.committed_at
    lease.release()


def test_a_failing_commit_does_not_reach_the_fast_circuit(tmp_path):
    from ds_twocircuit.adapters.anchor_circuit import commit_snapshot_safely
    store = SnapshotStore(tmp_path)
    sizes = write_fake_checkpoint(store, "step00000020", 20)
    wrong = {k: v + 1 for k, v in sizes.items()}   # what a lagging network filesystem reports
    with pytest.warns(RuntimeWarning, match="not published .*training goes on"):
        assert commit_snapshot_safely(store, "step00000020", 20, {"run": "r1"}, wrong) is False
    assert store.latest_committed_snapshot() is None
    assert commit_snapshot_safely(store, "step00000020", 20, {"run": "r1"}, sizes) is True
    assert store.latest_committed_snapshot().step == 20


def test_two_anchor_stages_pruning_the_same_gradient_step_at_once(tmp_path, monkeypatch):
    """Both anchor stage ranks publish the same step and then prune the same old step folder: the
    other rank's rmtree may land between this rank's listing and its glob of the folder's markers.
    That must not raise (it killed the anchor worker after a publish: the fast circuit then waited
    anchor.max_wait_s on every later step)."""
    import shutil
    mine, peer = SnapshotStore(tmp_path, keep_grads=2), SnapshotStore(tmp_path, keep_grads=2)
    g = {"w": torch.ones(2, 2)}
    for step in (0, 4):
        mine.publish_anchor_gradients(0, step, g, batch_id={"run": "r1"})
        peer.publish_anchor_gradients(1, step, g, batch_id={"run": "r1"})
    victim = tmp_path / "grads" / "step_00000000"
    real_scandir, fired = os.scandir, []

    def scandir(path=".", *a):
        if not fired and not isinstance(path, int) and Path(path) == victim:
            fired.append(path)
            shutil.rmtree(victim)     # the peer's prune, between our is_dir and our listing
        return real_scandir(path, *a)
    monkeypatch.setattr(os, "scandir", scandir)
    mine.publish_anchor_gradients(0, 8, g, batch_id={"run": "r1"})   # prunes step 0
    assert fired and not victim.exists()
    got = mine.poll_anchor_gradients(0)
    assert got is not None and got.source_step == 8


def test_in_order_anchor_skips_a_bad_snapshot_instead_of_stalling(tmp_path):
    from ds_twocircuit.adapters.anchor_circuit import pick_snapshot
    store = SnapshotStore(tmp_path, keep=3)
    bad_info = _run_snapshot(store, 24)
    _run_snapshot(store, 28)
    bad = {(bad_info.tag, bad_info.committed_at)}    # unreadable on one stage: skipped once
    lease = pick_snapshot(store, "r1", 20, bad, "anchor-t", in_order=True)
    assert lease is not None and lease.info.step == 28
    lease.release()
