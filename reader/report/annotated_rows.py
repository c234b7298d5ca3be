"""A batch row as annotated pieces of text: where documents start, which tokens are masked out of the loss,
where the padding is. One implementation for the ``report`` page (HTML) and ``batches --show`` (terminal).

A *piece* is a run of the row's tokens with the same segment (document piece) and the same kind: ``text``
(real tokens in the loss), ``masked`` (real tokens with ``loss_mask`` False) or ``pad`` (``segment_ids`` 0).
"""

from __future__ import annotations

import dataclasses
import html
import re
from typing import Callable, Sequence

import numpy as np

TEXT, MASKED, PAD = "text", "masked", "pad"
Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass(frozen=True)
class Piece:
    kind: str  # TEXT, MASKED or PAD
    segment: int  # the row's segment id (1, 2, ...; 0 for padding)
    start: int  # first column of the row
    ids: tuple[int, ...]
    starts_document: bool  # its first token is a document's first (position 0)
    text: str = ""  # decoded (empty for padding)


def row_pieces(targets: Sequence[int], segment_ids: Sequence[int], positions: Sequence[int],
               loss_mask: Sequence[bool], decode: Decode) -> list[Piece]:
    """The pieces of one row, in order; each run of real tokens decoded by ``decode`` (token ids -> text)."""
    t = np.asarray(targets).reshape(-1)
    seg = np.asarray(segment_ids).reshape(-1)
    pos = np.asarray(positions).reshape(-1)
    mask = np.asarray(loss_mask, dtype=bool).reshape(-1)
    kind = np.where(seg == 0, 2, np.where(mask, 0, 1))
    if t.size == 0:
        return []
    cut = np.flatnonzero((np.diff(seg) != 0) | (np.diff(kind) != 0)) + 1
    out = []
    for lo, hi in zip(np.concatenate([[0], cut]).tolist(), np.concatenate([cut, [t.size]]).tolist()):
        k = (TEXT, MASKED, PAD)[int(kind[lo])]
        ids = tuple(int(x) for x in t[lo:hi])
        out.append(Piece(kind=k, segment=int(seg[lo]), start=lo, ids=ids,
                         starts_document=k != PAD and int(pos[lo]) == 0, text="" if k == PAD else decode(ids)))
    return out


def batch_row_pieces(batch: dict, row: int, decode: Decode) -> list[Piece]:
    """:func:`row_pieces` of row ``row`` of a batch (``layout="arrays"``)."""
    return row_pieces(batch["targets"][row], batch["segment_ids"][row], batch["positions"][row],
                      batch["loss_mask"][row], decode)


def ids_decoder(decode: Decode | None) -> Decode:
    """``decode``, falling back to the ids themselves (``<12 345>``) for ids it cannot decode, or always when
    no tokenizer is available (None)."""
    def shown(ids: Sequence[int]) -> str:
        if decode is not None:
            try:
                return decode(ids)
            except (ValueError, KeyError, OverflowError):  # an id outside the tokenizer's vocabulary
                pass
        return "<" + " ".join(str(i) for i in ids) + ">"

    return shown


# --------------------------------------------------------------------------------------------------
# Terminal

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but \t and \n: never let data drive the terminal
_COLOURS = ("36", "33", "32", "35", "34", "31")  # cyan, yellow, green, magenta, blue, red: by segment
PAD_DOT = "·"


def safe_text(text: str) -> str:
    """``text`` with control characters (escape sequences) written as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def pad_marks(n: int) -> str:
    return PAD_DOT * n if n <= 8 else f"{PAD_DOT * 3}({n} padding){PAD_DOT * 3}"


def boundary(pieces: Sequence[Piece], i: int) -> str:
    """What precedes piece ``i``: ``"|"`` a document start (but the row's first), ``"…"`` a document that began
    before the row (a packed row's first piece, or an unpacked row's later piece), else ``""``."""
    p = pieces[i]
    if p.kind == PAD:
        return ""
    if p.starts_document:
        return "|" if i else ""
    return "…" if not i or pieces[i - 1].segment != p.segment else ""


def terminal_row(pieces: Sequence[Piece], colour: bool = False) -> str:
    """The row as one string: ``|`` between documents, ``…`` first if the row starts inside a document,
    masked tokens in ``[brackets]`` (dim with ``colour``), padding as ``·`` (or ``···(N padding)···``);
    with ``colour``, ANSI colours alternate by segment."""
    out = []
    for i, p in enumerate(pieces):
        if p.kind == PAD:
            out.append(f"\x1b[2m{pad_marks(len(p.ids))}\x1b[0m" if colour else pad_marks(len(p.ids)))
            continue
        out.append(boundary(pieces, i))
        text = safe_text(p.text)
        if colour:
            code = _COLOURS[(p.segment - 1) % len(_COLOURS)] + (";2" if p.kind == MASKED else "")
            out.append(f"\x1b[{code}m{text}\x1b[0m")
        else:
            out.append(f"[{text}]" if p.kind == MASKED else text)
    return "".join(out)


# --------------------------------------------------------------------------------------------------
# HTML (the page's CSS styles these classes: seg0..seg5, masked, pad, doc)


def html_row(pieces: Sequence[Piece]) -> str:
    """The row as HTML spans: ``seg{k}`` colours by segment, ``masked`` dims, ``pad`` marks padding, ``doc``
    marks a document start; every text escaped."""
    out = []
    for i, p in enumerate(pieces):
        if p.kind == PAD:
            out.append(f'<span class="pad" title="{len(p.ids)} padding tokens">{html.escape(pad_marks(len(p.ids)))}'
                       "</span>")
            continue
        classes = [f"seg{(p.segment - 1) % len(_COLOURS)}"] + (["masked"] if p.kind == MASKED else [])
        mark = boundary(pieces, i)
        if mark:
            what = "document start" if mark == "|" else "continues a document begun before"
            out.append(f'<span class="doc" title="{what}">{mark}</span>')
        title = f"segment {p.segment}, columns {p.start}-{p.start + len(p.ids) - 1}" + \
            (", masked out of the loss" if p.kind == MASKED else "")
        out.append(f'<span class="{" ".join(classes)}" title="{title}">{html.escape(safe_text(p.text))}</span>')
    return "".join(out)
