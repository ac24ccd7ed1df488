"""Hostile text made safe to show: every string from a record, job.json, a log, a stack or the store.

Those strings are written by processes rankwatch does not trust (any user on the node can create a job
dir; a training script names its own phases and threads; logs quote exception messages). Before one
reaches a terminal, a text file or HTML it goes through ``clean``:

* escape sequences cannot run: C0 and C1 controls (ESC, BEL, CSI, DEL, …), bidi overrides and isolates
  (U+202A–U+202E, U+2066–U+2069, which can make text read backwards), zero-width and other format
  characters, lone surrogates and unassigned/private code points become ``?`` — visibly replaced, never
  silently dropped, so a reader sees that something was there;
* line structure cannot be forged: tabs, newlines, carriage returns and other line breaks become a space
  (one field stays one line; a ``\\r`` cannot return to the start of a line to overwrite it) unless
  ``multiline`` keeps ``\\n`` for a block of lines;
* length is bounded: longer text is cut and ends with ``…``, so 10 MB in a hostname costs nothing.

Printable Unicode (accents, CJK, emoji) is kept. Pure: no I/O, standard library only.

A document that leaves rankwatch (the verdict in ``verdict.json``, a webhook's or Alertmanager's body, the
``--on-incident`` environment, the store) goes through ``clean_doc`` once where it is completed, so every
sink carries the same safe text and whatever renders it next (a chat client, a dashboard) gets no
escape sequence, line break or bidi override from a job. HTML renderers still escape markup themselves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

NAME = 128  # host names, job ids, phase and op names, thread names, states
FIELD = 512  # one frame of a stack, one table cell, one error message
PROSE = 4096  # reasons, evidence lines, "why" paragraphs
BLOCK = 512 * 1024  # a whole text block (stack groups shown in HTML)

ELLIPSIS = "…"
# characters that are always safe, for the fast path: printable ASCII
_PLAIN = re.compile(r"[\x20-\x7e]*")


def _safe(ch: str, multiline: bool) -> str:
    if ch.isprintable():
        return ch
    if ch == "\n" and multiline:
        return ch
    if ch.isspace():  # \t \n \r \v \f, U+0085, U+2028/9, no-break and other spaces
        return " "
    return "?"


def clean(value: object, limit: int = FIELD, *, multiline: bool = False) -> str:
    """``value`` as text a terminal, a file or a browser shows literally, at most ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit
    if cut:
        text = text[: max(limit - 1, 0)]
    if not _PLAIN.fullmatch(text):
        if multiline:
            text = text.replace("\r\n", "\n")
        text = "".join(_safe(ch, multiline) for ch in text)
    return text + ELLIPSIS if cut else text


def clean_doc(doc: Any, limit: int = PROSE) -> Any:
    """``doc`` (JSON-shaped: dicts, lists, tuples, scalars) with every string in it, keys included and at any
    depth, through ``clean`` with ``limit``; numbers, booleans and None as they are. A new document: the
    caller's is not changed. Idempotent, so a document cleaned by another node can be cleaned again."""
    if isinstance(doc, str):
        return clean(doc, limit)
    if isinstance(doc, Mapping):
        return {clean(k, limit) if isinstance(k, str) else k: clean_doc(v, limit) for k, v in doc.items()}
    if isinstance(doc, list):
        return [clean_doc(v, limit) for v in doc]
    if isinstance(doc, tuple):
        return tuple(clean_doc(v, limit) for v in doc)
    return doc
