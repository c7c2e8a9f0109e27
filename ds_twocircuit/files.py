"""Atomic file writes: a file is either absent or whole, on any POSIX filesystem.

Every marker and state file the library writes (snapshot store, anchor gradients, training
checkpoints, the anchor's run files) goes through :func:`atomic_write`: a temp file in the same
folder, fsync, ``os.replace``, fsync of the folder.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable


def fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass            # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def temp_name(path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def atomic_write(path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write ``path`` with ``write(f)`` via a temp file in the same folder, fsync, ``os.replace``,
    fsync the folder. On any failure the temp file is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text))


def atomic_write_json(path, obj: Any) -> None:
    atomic_write(path, lambda f: json.dump(obj, f, indent=1, sort_keys=True))
