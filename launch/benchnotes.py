"""Benchmark notes: a benchmark rewrites only its generated table inside its Markdown note.

The prose around the table is written by hand and kept; the numbers between the markers always
come from the benchmark's JSON (so they can be traced to a command)."""
from __future__ import annotations

import os


def write_section(md_path: str, begin: str, end: str, lines: list[str], title: str) -> None:
    """Replace the text between the ``begin`` and ``end`` markers of ``md_path`` with ``lines``
    (a new note titled ``title`` is created if the file does not exist; the section is appended if
    the markers are missing)."""
    section = "\n".join([begin, *lines, end])
    text = open(md_path).read() if os.path.exists(md_path) else f"# {title}\n\n{begin}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(md_path, "w") as f:
        f.write(text)
