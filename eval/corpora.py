"""Local domain corpora for held-out perplexity, beyond the code corpus of ``ds_twocircuit.data``.

* ``legal``: Debian's common-licenses texts and every package's ``/usr/share/doc/*/copyright``
  file (identical texts kept once);
* ``technical``: the English man pages (``/usr/share/man/man*/*.gz``), gzip roff with the markup
  stripped by :func:`strip_roff` (pure Python, so every machine sees the same text).

Each corpus is a list of :class:`ds_twocircuit.data.Document` and is split with
:func:`ds_twocircuit.data.split_documents` (by a hash of the document name), exactly as a training
run on the same corpus would split it: held-out documents are never trained on.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import os
import re

from ds_twocircuit.data import Document

LICENSE_DIRS = ("/usr/share/common-licenses",)
COPYRIGHT_GLOB = "/usr/share/doc/*/copyright"
MAN_GLOB = "/usr/share/man/man*/*.gz"


class RoffDocument(Document):
    """A gzip-compressed man page, read and stripped on first use."""
    __slots__ = ()

    def text(self) -> str:
        if self._text is None:
            try:
                with gzip.open(self._path, "rb") as f:
                    raw = f.read(4 << 20).decode("utf-8", "replace")
            except (OSError, EOFError):
                raw = ""
            self._text = strip_roff(raw)
        return self._text


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def legal_documents() -> list[Document]:
    paths = []
    for d in LICENSE_DIRS:
        if os.path.isdir(d):
            paths += sorted(p for p in glob.glob(os.path.join(d, "*")) if os.path.isfile(p))
    paths += sorted(glob.glob(COPYRIGHT_GLOB))
    docs, seen = [], set()
    for p in paths:
        if os.path.islink(p):
            continue
        text = _read(p)
        digest = hashlib.sha1(text.encode()).hexdigest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        docs.append(Document(p, text=text))
    return docs


def man_documents() -> list[Document]:
    """English man pages (the top-level ``man<N>`` sections), named by their path."""
    return [RoffDocument(p, path=p) for p in sorted(glob.glob(MAN_GLOB)) if not os.path.islink(p)]


# --------------------------------------------------------------------------- roff stripping
_DROP = {
    "PP", "P", "LP", "TP", "TQ", "br", "sp", "fi", "nf", "RS", "RE", "TH", "ad", "na", "ne", "ds",
    "nr", "if", "ie", "el", "in", "ti", "ft", "ps", "ll", "so", "hy", "nh", "ig", "EX", "EE", "UR",
    "UE", "MT", "ME", "PD", "Dd", "Dt", "Os", "Bl", "El", "Bd", "Ed", "tr", "cc", "ec", "eo",
    "mso", "TS", "TE", "T&", "ta", "fam", "HP", "IX", "ce", "rm", "als", "rr", "lf", "pc", "bp",
    "ns", "rs", "Pp", "Lp", "Ek", "Bk", "Sm", "Db", "YS", "SY", "OP", "Ns", "ev", "vs", "ss", "cs",
}
_SPECIAL = {"em": "\u2014", "en": "\u2013", "bu": "\u2022", "aq": "'", "dq": '"', "lq": '"',
            "rq": '"', "oq": "'", "cq": "'", "co": "\u00a9", "rg": "\u00ae", "hy": "-", "mi": "-",
            "pl": "+", "mu": "\u00d7", "di": "\u00f7", "<=": "\u2264", ">=": "\u2265", "->": "\u2192",
            "<-": "\u2190", "ga": "`", "ti": "~", "ha": "^", "rs": "\\", "sl": "/", "ba": "|",
            "or": "|", "tm": "\u2122", "de": "\u00b0", "Fo": "\u00ab", "Fc": "\u00bb", "sq": "\u25a1"}
_ESCAPES = [
    (re.compile(r'\\".*$'), ""),                                   # comment to end of line
    (re.compile(r"\\f(\(..|\[[^\]]*\]|.)"), ""),                   # font changes
    (re.compile(r"\\s[+-]?(\(\d\d|\[[^\]]*\]|\d)"), ""),           # size changes
    (re.compile(r"\\[*n](\(..|\[[^\]]*\]|.)"), ""),                # strings and registers
    (re.compile(r"\\[hvwlLoDbxXSRZ]'[^']*'"), ""),                  # motions, widths, drawing
    (re.compile(r"\\k."), ""),
    (re.compile(r"\\\((..)"), lambda m: _SPECIAL.get(m.group(1), "")),
    (re.compile(r"\\\[([^\]]*)\]"), lambda m: _SPECIAL.get(m.group(1), "")),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[ ~0]"), " "),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\[&:/,%c|^)!{}]"), ""),
    (re.compile(r"\\([.'`\\])"), r"\1"),
]
_ARG = re.compile(r'"((?:[^"]|"")*)"|(\S+)')
_ALTERNATING = {"BR", "RB", "BI", "IB", "IR", "RI"}


def _unescape(s: str) -> str:
    for pat, rep in _ESCAPES:
        s = pat.sub(rep, s)
    return s


def strip_roff(src: str) -> str:
    """Plain text of a man page: requests dropped, text-bearing macros kept, escapes resolved."""
    out: list[str] = []
    skip_until = None
    for line in src.splitlines():
        if skip_until is not None:
            if line.strip() == skip_until:
                skip_until = None
            continue
        if line.startswith((".\\\"", "'\\\"", ".\\#")) or line.strip() == ".":
            continue
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            if name in ("de", "de1", "am", "ig"):
                skip_until = ".."
                continue
            if name in _DROP or not name:
                continue
            args = [a or b for a, b in _ARG.findall(rest)]
            joiner = "" if name in _ALTERNATING else " "
            text = _unescape(joiner.join(args))
            if name in ("SH", "Sh"):
                out.append("")
                out.append(text.upper())
            elif text:
                out.append(text)
            continue
        out.append(_unescape(line))
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
