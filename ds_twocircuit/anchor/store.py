"""Folder-backed exchange of weight snapshots and anchor gradients between the two circuits.

Paper: "Communication-Efficient LLM Adaptation over Decentralized GPU Meshes" (Ramasinghe et al.,
arXiv 2609.14339): the anchor circuit computes unmasked gradients on *stale* weight snapshots of
the fast circuit and sends them back (method.md s. 2). This module is the mailbox between them,
on a local or shared filesystem; nothing in it ever blocks or waits.

Invariant: **a reader only ever sees complete entries.** A snapshot is visible only once its
``COMMITTED.json`` exists and every file it lists exists with the listed size (and sha256, when
``checksums=True``); an anchor gradient only once its ``.pt`` was renamed into place and its
per-stage ``COMMITTED.json`` lists its size. Markers are written to a temp file, fsynced and
``os.replace``d, so a marker is either absent or whole. Incomplete or corrupt entries are skipped
with a :class:`StoreWarning` and the previous complete one is used.

Layout under ``root``::

    snapshots/<tag>/...               DeepSpeed checkpoint: engine.save_checkpoint(store.snapshots_dir, tag)
    snapshots/<tag>/COMMITTED.json    written by commit_snapshot(): files + sizes, step, batch id
    snapshots/<tag>/RETIRED.json      the marker after retention retired the tag (invisible to readers)
    LATEST                            pointer {"tag", "step"} to the newest commit (a hint; markers rule)
    leases/<tag>/<reader_id>.json     a reader's hold on a snapshot; retention never deletes it
    grads/step_XXXXXXXX/stage_XX.pt              anchor gradients of one stage (torch.save, weights only)
    grads/step_XXXXXXXX/stage_XX.COMMITTED.json  its marker: size, source step, batch id, stage

Retention of snapshots (after each commit, ``keep`` newest committed tags stay): an older tag is
first *retired* (``COMMITTED.json`` renamed to ``RETIRED.json``, so no new reader can pick it),
then deleted unless a live lease names it; a leased retired tag is deleted by a later prune once
its leases are released or stale (older than ``lease_ttl_s``). A reader takes a lease, then checks
that the tag is still committed: either the check fails (it retries with another tag) or the lease
was written before the retirement and the writer sees it. Leases are files, not hardlink copies,
so they work on filesystems without hardlinks and cost no space; the price is a TTL (keep it far
above the clock skew between the writer's and readers' hosts) and ``renew()`` for long holds.

Byte accounting: committed snapshot bytes (once, by the committer) and published gradient file
bytes are counted as ``"anchor"`` traffic in :mod:`ds_twocircuit.wire`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from ds_twocircuit import wire
from ds_twocircuit.files import atomic_write, atomic_write_json

COMMITTED = "COMMITTED.json"
RETIRED = "RETIRED.json"
LATEST = "LATEST"
_FORMAT = 1
_MARKER_NAMES = (COMMITTED, RETIRED)


class StoreWarning(UserWarning):
    """An entry of the store was skipped because it is incomplete or corrupt."""


# ------------------------------------------------------------------------------------------------
# Atomic file helpers
# ------------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------
# Public records
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot: a DeepSpeed checkpoint folder and what the fast circuit trained on."""
    tag: str
    step: int
    batch_id: Any
    path: Path                          # the tag folder (load_checkpoint(path.parent, tag))
    files: dict[str, int]               # relative path -> size in bytes
    total_bytes: int
    committed_at: float

    def file_paths(self) -> list[Path]:
        return [self.path / rel for rel in sorted(self.files)]


@dataclass(frozen=True)
class AnchorGradients:
    """The anchor gradients of one pipeline stage, computed on the snapshot of ``source_step``."""
    source_step: int
    stage: int
    batch_id: Any
    grads: dict[str, torch.Tensor]
    nbytes: int                         # size of the file they came from
    path: Path


class SnapshotLease:
    """A reader's hold on a snapshot: retention does not delete it until released or stale."""

    def __init__(self, store: "SnapshotStore", info: SnapshotInfo, reader_id: str, path: Path):
        self.store, self.info, self.reader_id, self.lease_path = store, info, reader_id, path
        self.released = False

    @property
    def path(self) -> Path:
        return self.info.path

    def renew(self) -> None:
        """Refresh the lease's timestamp (for holds longer than ``lease_ttl_s``)."""
        if self.released:
            raise RuntimeError("lease already released")
        self.store._write_lease(self.lease_path, self.info.tag, self.reader_id)

    def release(self) -> None:
        if not self.released:
            self.released = True
            try:
                self.lease_path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> "SnapshotLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SnapshotLease(tag={self.info.tag!r}, step={self.info.step}, reader={self.reader_id!r})"


# ------------------------------------------------------------------------------------------------
# The store
# ------------------------------------------------------------------------------------------------

class SnapshotStore:
    """Mailbox of weight snapshots (fast -> anchor) and anchor gradients (anchor -> fast).

    Args:
        root: the store's folder (local, or shared by both circuits).
        keep: committed snapshots kept by retention (>= 1).
        keep_grads: gradient steps (folders ``grads/step_*``) kept when the anchor publishes.
        lease_ttl_s: a lease older than this (by its timestamp) is stale and ignored.
        checksums: also record and verify sha256 of every file (reads every byte on both sides);
            by default only sizes are checked, which catches the half-written-checkpoint race.
        clock: time source for lease timestamps (tests inject a fake one).

    Writer side (fast circuit, one rank): ``prepare_snapshot(tag)`` -> every rank
    ``engine.save_checkpoint(store.snapshots_dir, tag, save_latest=False)`` -> one rank
    ``commit_snapshot(tag, step, batch_id)``; and ``poll_anchor_gradients(stage, after_step)``
    on every rank of stage ``stage``.
    Anchor side: ``acquire_latest_snapshot()`` -> load -> ``lease.release()`` -> compute ->
    ``publish_anchor_gradients(stage, source_step, grads, batch_id)``.
    """

    def __init__(self, root: Union[str, os.PathLike], keep: int = 3, keep_grads: int = 4,
                 lease_ttl_s: float = 600.0, checksums: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if keep_grads < 1:
            raise ValueError(f"keep_grads must be >= 1, got {keep_grads}")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.root = Path(root)
        self.keep = int(keep)
        self.keep_grads = int(keep_grads)
        self.lease_ttl_s = float(lease_ttl_s)
        self.checksums = bool(checksums)
        self.clock = clock
        self.snapshots_dir = self.root / "snapshots"
        self.leases_dir = self.root / "leases"
        self.grads_dir = self.root / "grads"
        for d in (self.snapshots_dir, self.leases_dir, self.grads_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._warned: set[tuple] = set()
        self._bad_grads: set[tuple] = set()      # (path, marker mtime_ns, size) known to be corrupt
        self._hashed: set[tuple] = set()         # snapshot commits whose sha256 already matched

    # --- warnings -----------------------------------------------------------------------------
    def _warn(self, key: tuple, message: str) -> None:
        """Warn once per store and entry version (a poll loop would repeat it every step)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, StoreWarning, stacklevel=3)

    # ==========================================================================================
    # Snapshots: writer
    # ==========================================================================================
    def prepare_snapshot(self, tag: str) -> Path:
        """Make ``tag`` ready to be written (call on the committing rank before save_checkpoint).

        Tags must be unique; if ``tag`` already exists (a re-save after a crash) it is retired
        and its old folder deleted, so no reader trusts files that are about to be overwritten.
        Raises if a live lease holds the old version. Returns the tag folder.
        """
        _check_tag(tag)
        tag_dir = self.snapshots_dir / tag
        if tag_dir.exists():
            try:        # retire before looking at leases: the same order as prune_snapshots
                os.replace(tag_dir / COMMITTED, tag_dir / RETIRED)
            except FileNotFoundError:
                pass
            if self._live_leases(tag):
                raise RuntimeError(f"snapshot {tag!r} is being re-saved while a reader holds it; use a new tag")
            shutil.rmtree(tag_dir)
        return tag_dir

    def commit_snapshot(self, tag: str, step: int, batch_id: Any,
                        files: Optional[Union[Iterable[str], Mapping[str, int]]] = None) -> SnapshotInfo:
        """Publish the checkpoint ``snapshots/<tag>`` written by ``save_checkpoint`` on all ranks.

        Call on one rank, after ``save_checkpoint`` returned everywhere. ``files``: None = every
        file under the tag folder; a list of paths relative to it; or a mapping relpath -> size
        as reported by the ranks that wrote them (best on a shared filesystem whose attribute
        cache may lag: a mismatch with what this rank sees raises). ``batch_id`` must be
        JSON-serialisable. Writes ``COMMITTED.json``, then ``LATEST``, counts the snapshot's
        bytes as anchor traffic, and applies retention.
        """
        _check_tag(tag)
        tag_dir = self.snapshots_dir / tag
        if not tag_dir.is_dir():
            raise FileNotFoundError(f"snapshot folder {tag_dir} does not exist (save_checkpoint first)")
        json.dumps(batch_id)            # fail now, not in a reader
        if files is None:
            rels = sorted(str(p.relative_to(tag_dir)) for p in tag_dir.rglob("*")
                          if p.is_file() and not _is_store_file(p))
            expected: dict[str, Optional[int]] = {rel: None for rel in rels}
        elif isinstance(files, Mapping):
            expected = {str(rel): int(size) for rel, size in files.items()}
        else:
            expected = {str(rel): None for rel in files}
        if not expected:
            raise ValueError(f"snapshot {tag!r} has no files")
        entries = []
        for rel in sorted(expected):
            path = tag_dir / rel
            if not path.is_file():
                raise FileNotFoundError(f"snapshot {tag!r}: listed file {rel} does not exist")
            size = path.stat().st_size
            if expected[rel] is not None and expected[rel] != size:
                raise RuntimeError(f"snapshot {tag!r}: {rel} has {size} bytes here, its writer reported "
                                   f"{expected[rel]} (incomplete write or stale attribute cache)")
            entry = {"path": rel, "size": size}
            if self.checksums:
                entry["sha256"] = _sha256(path)
            entries.append(entry)
        total = sum(e["size"] for e in entries)
        record = {"format": _FORMAT, "tag": tag, "step": int(step), "batch_id": batch_id, "files": entries,
                  "total_bytes": total, "committed_at": self.clock()}
        retired = tag_dir / RETIRED
        if retired.exists():
            retired.unlink()
        atomic_write_json(tag_dir / COMMITTED, record)
        atomic_write_json(self.root / LATEST, {"tag": tag, "step": int(step)})
        wire.count("anchor", total)
        self.prune_snapshots()
        return _info_from_record(tag_dir, record)

    def prune_snapshots(self) -> list[str]:
        """Retire committed snapshots beyond the newest ``keep``; delete retired, unleased ones.

        Returns the tags deleted. Also removes stale lease files.
        """
        committed = sorted(self._committed_records(), key=lambda r: (r[1]["step"], r[1]["committed_at"]),
                           reverse=True)
        for tag_dir, _ in committed[self.keep:]:
            try:
                os.replace(tag_dir / COMMITTED, tag_dir / RETIRED)
            except FileNotFoundError:
                pass
        deleted = []
        for tag_dir in sorted(self.snapshots_dir.iterdir()):
            if not (tag_dir / RETIRED).exists() or (tag_dir / COMMITTED).exists():
                continue
            if self._live_leases(tag_dir.name):
                continue                # a reader holds it; a later prune deletes it
            shutil.rmtree(tag_dir, ignore_errors=True)
            deleted.append(tag_dir.name)
        self._sweep_lease_dirs()
        return deleted

    def _sweep_lease_dirs(self) -> None:
        """Remove lease folders of deleted tags once empty. Only ``rmdir``: a reader may be
        writing a lease there right now (it then fails validation and retries elsewhere)."""
        for folder in self.leases_dir.iterdir():
            if folder.is_dir() and not (self.snapshots_dir / folder.name).exists():
                self._live_leases(folder.name)          # drops stale ones
                try:
                    folder.rmdir()
                except OSError:
                    pass                                # not empty: a live lease or one being written

    # ==========================================================================================
    # Snapshots: reader
    # ==========================================================================================
    def latest_committed_snapshot(self) -> Optional[SnapshotInfo]:
        """The newest complete snapshot, or None. Does not hold it: use acquire_latest_snapshot
        to load it (retention may delete an unleased snapshot at any time)."""
        return self._latest_valid(exclude=set())

    def acquire_latest_snapshot(self, reader_id: Optional[str] = None,
                                oldest_after: Optional[int] = None) -> Optional[SnapshotLease]:
        """Lease the newest complete snapshot (None if there is none). Release it after loading.
        ``oldest_after``: the oldest complete one with a step above it instead (a reader that must
        see every snapshot in order)."""
        reader_id = reader_id or f"{socket.gethostname()}-{os.getpid()}"
        _check_tag(reader_id)
        exclude: set[str] = set()
        while True:
            info = self._latest_valid(exclude, oldest_after)
            if info is None:
                return None
            lease_path = self.leases_dir / info.tag / f"{reader_id}.json"
            for attempt in range(100):
                lease_path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self._write_lease(lease_path, info.tag, reader_id)
                    break
                except FileNotFoundError:
                    if attempt == 99:    # the writer's sweep keeps removing the (empty) folder
                        raise
            # Re-check after the lease is visible: the tag may have been retired in between.
            if self._validate(self.snapshots_dir / info.tag) is not None:
                return SnapshotLease(self, info, reader_id, lease_path)
            lease_path.unlink(missing_ok=True)
            exclude.add(info.tag)

    def _write_lease(self, path: Path, tag: str, reader_id: str) -> None:
        atomic_write_json(path, {"tag": tag, "reader_id": reader_id, "host": socket.gethostname(),
                                  "pid": os.getpid(), "time": self.clock()})

    def _live_leases(self, tag: str) -> list[Path]:
        """Lease files of ``tag`` that are not stale; stale ones are removed."""
        folder = self.leases_dir / tag
        if not folder.is_dir():
            return []
        live, now = [], self.clock()
        for lease in folder.glob("*.json"):
            try:
                stamp = float(_read_json(lease)["time"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                stamp = lease.stat().st_mtime if lease.exists() else -float("inf")
            if now - stamp > self.lease_ttl_s:
                lease.unlink(missing_ok=True)
            else:
                live.append(lease)
        return live

    def _committed_records(self) -> list[tuple[Path, dict]]:
        """(tag folder, COMMITTED.json record) for every tag with a readable marker (sizes unchecked)."""
        out = []
        for tag_dir in self.snapshots_dir.iterdir():
            marker = tag_dir / COMMITTED
            if not tag_dir.is_dir() or not marker.is_file():
                continue        # no marker yet: a checkpoint still being written, or a retired one
            try:
                record = _read_json(marker)
                record["step"] = int(record["step"])
                record["committed_at"] = float(record["committed_at"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._warn(("marker", str(marker), _mtime_ns(marker)),
                           f"snapshot {tag_dir.name!r}: unreadable {COMMITTED} ({e}); skipped")
                continue
            out.append((tag_dir, record))
        return out

    def _validate(self, tag_dir: Path, record: Optional[dict] = None) -> Optional[SnapshotInfo]:
        """SnapshotInfo if ``tag_dir`` is committed and every listed file is complete, else None."""
        marker = tag_dir / COMMITTED
        if record is None:
            try:
                record = _read_json(marker)
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as e:
                self._warn(("marker", str(marker), _mtime_ns(marker)),
                           f"snapshot {tag_dir.name!r}: unreadable {COMMITTED} ({e}); skipped")
                return None
        key = ("snapshot", str(tag_dir), record.get("committed_at"))
        try:
            if record.get("format") != _FORMAT:
                raise ValueError(f"unknown format {record.get('format')!r}")
            for entry in record["files"]:
                path = tag_dir / entry["path"]
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    if not marker.exists():
                        return None                 # retired and deleted while we looked
                    raise ValueError(f"listed file {entry['path']} is missing")
                if size != int(entry["size"]):
                    raise ValueError(f"{entry['path']} has {size} bytes, {COMMITTED} lists {entry['size']}")
            if self.checksums and key not in self._hashed:      # hash each commit once per store, not per poll
                for entry in record["files"]:
                    try:
                        digest = _sha256(tag_dir / entry["path"]) if "sha256" in entry else None
                    except FileNotFoundError:
                        if not marker.exists():
                            return None
                        raise ValueError(f"listed file {entry['path']} is missing")
                    if digest is not None and digest != entry["sha256"]:
                        raise ValueError(f"{entry['path']} fails its sha256 check")
                self._hashed.add(key)
            info = _info_from_record(tag_dir, record)
        except (ValueError, KeyError, TypeError) as e:
            self._warn(key, f"snapshot {tag_dir.name!r} is incomplete or corrupt ({e}); falling back to an older one")
            return None
        return info

    def _latest_valid(self, exclude: set[str], oldest_after: Optional[int] = None) -> Optional[SnapshotInfo]:
        # The markers are the source of truth; LATEST is only a hint for people and tools (a
        # writer that dies between the two leaves it one commit behind).
        records = sorted(self._committed_records(), key=lambda r: (r[1]["step"], r[1]["committed_at"]),
                         reverse=oldest_after is None)
        for tag_dir, record in records:
            if tag_dir.name in exclude or (oldest_after is not None and record["step"] <= oldest_after):
                continue
            info = self._validate(tag_dir, record)
            if info is not None:
                return info
        return None

    def discard_after(self, step: int) -> None:
        """Forget snapshots and anchor gradients newer than ``step`` (call when the fast circuit
        resumes from an older checkpoint, so the anchor never reads a dead timeline). Snapshots
        are retired (deleted by the next prune unless leased); gradient steps are deleted."""
        for tag_dir, record in self._committed_records():
            if record["step"] > step:
                try:
                    os.replace(tag_dir / COMMITTED, tag_dir / RETIRED)
                except FileNotFoundError:
                    pass
        for grad_step, folder in self._gradient_steps():
            if grad_step > step:
                _remove_gradient_step(folder)
        self.prune_snapshots()
        newest = self.latest_committed_snapshot()
        if newest is None:
            (self.root / LATEST).unlink(missing_ok=True)
        else:
            atomic_write_json(self.root / LATEST, {"tag": newest.tag, "step": newest.step})

    # ==========================================================================================
    # Anchor gradients
    # ==========================================================================================
    def _grad_paths(self, source_step: int, stage: int) -> tuple[Path, Path]:
        folder = self.grads_dir / f"step_{source_step:08d}"
        return folder / f"stage_{stage:02d}.pt", folder / f"stage_{stage:02d}.{COMMITTED}"

    def publish_anchor_gradients(self, stage: int, source_step: int, grads: Mapping[str, torch.Tensor],
                                 batch_id: Any = None) -> Path:
        """Write one stage's anchor gradients atomically (anchor side) and count their bytes.

        The ``.pt`` file goes to a temp name, is fsynced and renamed into place; then its marker
        is written the same way. Old gradient steps beyond ``keep_grads`` are pruned.
        """
        stage, source_step = int(stage), int(source_step)
        if stage < 0 or source_step < 0:
            raise ValueError("stage and source_step must be >= 0")
        json.dumps(batch_id)
        payload = {"format": _FORMAT, "source_step": source_step, "stage": stage, "batch_id": batch_id,
                   "grads": {str(k): v.detach().to("cpu").contiguous() for k, v in grads.items()}}
        pt_path, marker = self._grad_paths(source_step, stage)
        pt_path.parent.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)                   # re-publish: never pair an old marker with a new file
        atomic_write(pt_path, lambda f: torch.save(payload, f), binary=True)
        size = pt_path.stat().st_size
        record = {"format": _FORMAT, "source_step": source_step, "stage": stage, "batch_id": batch_id,
                  "file": pt_path.name, "size": size, "committed_at": self.clock()}
        if self.checksums:
            record["sha256"] = _sha256(pt_path)
        atomic_write_json(marker, record)
        wire.count("anchor", size)
        self.prune_gradients()
        return pt_path

    def _gradient_steps(self) -> list[tuple[int, Path]]:
        steps = []
        for folder in self.grads_dir.iterdir():
            name = folder.name
            if folder.is_dir() and name.startswith("step_") and name[5:].isdigit():
                steps.append((int(name[5:]), folder))
        return sorted(steps, reverse=True)

    def prune_gradients(self) -> list[int]:
        """Delete gradient steps beyond the newest ``keep_grads`` (markers first). Returns them."""
        removed = []
        for step, folder in self._gradient_steps()[self.keep_grads:]:
            _remove_gradient_step(folder)
            removed.append(step)
        return removed

    def poll_anchor_gradients(self, stage: int, after_step: Optional[int] = None,
                              max_step: Optional[int] = None) -> Optional[AnchorGradients]:
        """The newest complete anchor gradients of ``stage`` with source step > ``after_step``
        (and <= ``max_step`` when given: a consumer that takes gradients on a schedule).

        Never blocks: returns None when there is none. Incomplete or corrupt files are skipped
        with a warning (once per file version) and the next older one is tried.
        ``after_step=None`` accepts any step.
        """
        stage = int(stage)
        for step, folder in self._gradient_steps():
            if after_step is not None and step <= after_step:
                break
            if max_step is not None and step > max_step:
                continue
            pt_path, marker = self._grad_paths(step, stage)
            try:
                record = _read_json(marker)
                marker_version = _mtime_ns(marker)
            except FileNotFoundError:
                continue        # not committed (yet), or pruned while we looked
            except (OSError, ValueError) as e:
                self._warn(("gmarker", str(marker), _mtime_ns(marker)),
                           f"anchor gradients {pt_path}: unreadable marker ({e}); skipped")
                continue
            bad_key = (str(pt_path), marker_version, record.get("size"))
            if bad_key in self._bad_grads:
                continue
            try:
                size = pt_path.stat().st_size
                if size != int(record["size"]):
                    raise ValueError(f"file has {size} bytes, its marker lists {record['size']}")
                if "sha256" in record and self.checksums and _sha256(pt_path) != record["sha256"]:
                    raise ValueError("sha256 mismatch")
                payload = torch.load(pt_path, map_location="cpu", weights_only=True)
                if int(payload["source_step"]) != step or int(payload["stage"]) != stage:
                    raise ValueError(f"file says step {payload['source_step']} stage {payload['stage']}")
                grads = payload["grads"]
                if not isinstance(grads, dict) or not all(isinstance(t, torch.Tensor) for t in grads.values()):
                    raise ValueError("payload 'grads' is not a dict of tensors")
            except FileNotFoundError:
                continue        # pruned between marker and file: an older one will do
            except Exception as e:      # torch.load raises RuntimeError/EOFError/UnpicklingError/...
                self._bad_grads.add(bad_key)
                self._warn(("grad",) + bad_key,
                           f"anchor gradients {pt_path} are incomplete or corrupt ({type(e).__name__}: {e}); skipped")
                continue
            return AnchorGradients(source_step=step, stage=stage, batch_id=payload.get("batch_id"), grads=grads,
                                   nbytes=size, path=pt_path)
        return None


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _valid_tag(tag: str) -> bool:
    return bool(tag) and tag not in (".", "..") and "/" not in tag and "\\" not in tag and not tag.startswith(".")


def _check_tag(tag: str) -> None:
    if not _valid_tag(tag):
        raise ValueError(f"invalid tag or reader id {tag!r} (a plain folder name not starting with '.')")


def _is_store_file(path: Path) -> bool:
    return path.name in _MARKER_NAMES or path.name.startswith(".")


def _remove_gradient_step(folder: Path) -> None:
    """Delete a gradient step folder, markers first. Every anchor stage rank prunes after its own
    publish, so another rank may remove the same folder at any moment: that is not an error."""
    try:
        markers = list(folder.glob(f"*.{COMMITTED}"))
    except FileNotFoundError:   # removed between the listing and this glob (Path.glob raises then)
        return
    for marker in markers:
        marker.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def _mtime_ns(path: Path) -> Optional[int]:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _info_from_record(tag_dir: Path, record: dict) -> SnapshotInfo:
    files = {str(e["path"]): int(e["size"]) for e in record["files"]}
    return SnapshotInfo(tag=tag_dir.name, step=int(record["step"]), batch_id=record.get("batch_id"), path=tag_dir,
                        files=files, total_bytes=int(record.get("total_bytes", sum(files.values()))),
                        committed_at=float(record["committed_at"]))
