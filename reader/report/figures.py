"""The numbers behind each figure and table of the ``report`` page, as pure functions (no I/O, no plotting).

:mod:`reader.report.collect` gathers their inputs from a cache; :mod:`reader.report.page` draws them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from reader.order.passes import Spans
from reader.order.shuffle import ShuffleConfig, shuffle_example_indices


@dataclasses.dataclass(frozen=True)
class Histogram:
    """``counts[i]`` values in ``[edges[i], edges[i+1])`` (the last bin includes its right edge)."""

    edges: np.ndarray
    counts: np.ndarray
    log: bool = False

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def log_histogram(values: Sequence[float], bins: int = 30) -> Histogram:
    """Counts of ``values`` in ``bins`` bins of equal width on a log scale, from 1 to the largest value
    (values below 1, such as documents of zero tokens, count in the first bin)."""
    v = np.maximum(np.asarray(values, dtype=np.float64), 1.0)
    if v.size == 0:
        return Histogram(np.array([1.0, 10.0]), np.zeros(1, np.int64), log=True)
    top = max(float(v.max()), 2.0)
    edges = np.geomspace(1.0, top, bins + 1)
    counts, _ = np.histogram(v, bins=edges)
    return Histogram(edges, counts.astype(np.int64), log=True)


def linear_histogram(values: Sequence[float], bins: int = 30) -> Histogram:
    """Counts of ``values`` in ``bins`` equal bins from the smallest to the largest value."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return Histogram(np.array([0.0, 1.0]), np.zeros(1, np.int64))
    lo, hi = float(v.min()), float(v.max())
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    return Histogram(edges, counts.astype(np.int64))


def tokens_per_shard(shard: Sequence[int], tokens: Sequence[int], num_shards: int) -> np.ndarray:
    """Tokens of each input shard (int64 [num_shards]) from per-chunk shard numbers and token counts."""
    s = np.asarray(shard, dtype=np.int64)
    t = np.asarray(tokens, dtype=np.int64)
    out = np.zeros(num_shards, np.int64)
    np.add.at(out, s, t)
    return out


def top_values(counts: Mapping[Any, int], top: int = 20) -> list[tuple[str, int]]:
    """The ``top`` largest of ``value -> count`` as ``(label, count)``, largest first (ties by label), the
    rest summed as ``"other (k values)"``; a None value is labelled ``(none)``."""
    items = sorted(((("(none)" if v is None else str(v)), int(n)) for v, n in counts.items()),
                   key=lambda x: (-x[1], x[0]))
    head, rest = items[:top], items[top:]
    if rest:
        head.append((f"other ({len(rest)} values)", sum(n for _, n in rest)))
    return head


def tokens_per_value(tally: Mapping[Any, Any], top: int = 20) -> list[tuple[str, int]]:
    """Tokens per value of a kept metadata field (``--keep_fields``), for its bar chart: ``tally`` maps each
    value to its tokens, or to ``(documents, tokens)`` as ``reader.storage.fields.tally`` gives them."""
    return top_values({v: (n[1] if isinstance(n, (tuple, list)) else n) for v, n in tally.items()}, top)


def field_note(tally: Mapping[Any, Any], top: int = 20, share: float = 0.5) -> str | None:
    """None when a bar chart of a kept field's tokens per value says something: at most ``top`` values, or the
    ``top`` largest holding at least ``share`` of the tokens. Else (a field like ``url``, nearly one value
    per document) the one line the page shows instead of near-empty bars."""
    tokens = sorted(((n[1] if isinstance(n, (tuple, list)) else n) for n in tally.values()), reverse=True)
    total = sum(tokens)
    if len(tokens) <= top or not total or sum(tokens[:top]) >= share * total:
        return None
    return (f"{len(tokens):,} distinct values in the sampled chunks; the {top} most frequent hold "
            f"{sum(tokens[:top]) / total:.1%} of the tokens, the largest {tokens[0] / total:.2%} (no chart)")


def bad_record_rows(reasons: Mapping[str, int]) -> list[tuple[str, int, float]]:
    """``(reason, count, share of all bad records)``, most frequent first."""
    total = sum(int(n) for n in reasons.values())
    return [(r, int(n), int(n) / total if total else 0.0)
            for r, n in sorted(reasons.items(), key=lambda x: (-int(x[1]), x[0])) if int(n)]


@dataclasses.dataclass(frozen=True)
class RowPacking:
    """How full the rows of some batches are: ``rows`` real rows (not eval padding), ``padding`` the share of
    their tokens that are padding, and the document pieces (segments) per row, on average and at most."""

    rows: int
    padding: float
    pieces_mean: float
    pieces_max: int

    def describe(self) -> str:
        return (f"{self.rows:,} rows: padding {self.padding:.2%}, document pieces per row {self.pieces_mean:.2f} on "
                f"average, at most {self.pieces_max}")


def row_packing(batches: Iterable[Mapping[str, np.ndarray]]) -> RowPacking:
    """:class:`RowPacking` of batches in the arrays layout (``segment_ids``, ``valid``)."""
    seg = [np.asarray(b["segment_ids"])[np.asarray(b["valid"], bool)] for b in batches]
    seg = np.concatenate(seg) if seg else np.zeros((0, 1), np.int32)
    pieces = seg.max(axis=1) if seg.size else np.zeros(0, np.int64)
    return RowPacking(rows=int(seg.shape[0]), padding=float((seg == 0).mean()) if seg.size else 0.0,
                      pieces_mean=float(pieces.mean()) if pieces.size else 0.0,
                      pieces_max=int(pieces.max()) if pieces.size else 0)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked with an ellipsis and the full length when cut."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def dead_letter_examples(records: Iterable[Mapping[str, Any]], per_reason: int = 3,
                         limit: int = 200) -> dict[str, list[dict[str, Any]]]:
    """At most ``per_reason`` dead letters of each reason, in the order given, each with its file, offset,
    where (``at byte N``, or a columnar row's ``row N``), detail and its line (or a columnar row's value) cut to
    ``limit`` characters (bytes that are not UTF-8 show their size)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        got = out.setdefault(str(r.get("reason")), [])
        if len(got) >= per_reason:
            continue
        coded = r.get("line_base64", r.get("value_base64"))
        if "line" in r:
            line = truncate(str(r["line"]), limit)
        elif coded is not None:
            line = f"(not UTF-8: {len(str(coded)) * 3 // 4:,} bytes, base64 in the dead letter)"
        else:
            value = r.get("value")
            line = truncate(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False), limit)
        where = f"row {r.get('row')}" if "row" in r else f"at byte {r.get('offset')}"
        got.append({"file": r.get("file"), "offset": r.get("offset"), "where": where,
                    "detail": truncate(str(r.get("detail") or ""), limit), "line": line})
    return out


def checkpoints(steps: int, points: int = 50) -> np.ndarray:
    """Up to ``points`` steps in ``[1, steps]``, evenly spread, ending at ``steps``."""
    if steps < 1:
        return np.zeros(0, np.int64)
    return np.unique(np.linspace(1, steps, min(points, steps)).round().astype(np.int64))


def realised_shares(consumed: Callable[[int], np.ndarray], batch_size: int, at_steps: Sequence[int]) -> np.ndarray:
    """``[len(at_steps), C]``: each component's share of the examples of the first ``s`` steps, for each ``s``
    (``consumed(n)``: examples of each component among the first ``n``, ``QuotaIndex.consumed``)."""
    rows = [np.asarray(consumed(int(s) * batch_size), dtype=np.float64) for s in at_steps]
    if not rows:
        return np.zeros((0, 0))
    got = np.stack(rows)
    return got / np.maximum(got.sum(axis=1, keepdims=True), 1)


def target_shares(segments: Sequence[tuple[int, Sequence[float]]], at_steps: Sequence[int]) -> np.ndarray:
    """``[len(at_steps), C]``: the weights the schedule asks for, averaged over the first ``s`` steps.

    ``segments``: ``(start_batch, normalised weights)`` in order, the first starting at 0.
    """
    starts = np.asarray([s for s, _ in segments], dtype=np.float64)
    w = np.asarray([list(ws) for _, ws in segments], dtype=np.float64)
    out = []
    for s in at_steps:
        ends = np.append(starts[1:], np.inf)
        span = np.clip(np.minimum(ends, s) - starts, 0, None)  # steps of [0, s) in each segment
        out.append(span @ w / s if s else w[0])
    return np.asarray(out).reshape(len(out), w.shape[1])


@dataclasses.dataclass(frozen=True)
class Locality:
    """Where the shuffled rows of some steps come from: ``steps[i]`` served ``sources[i]`` (the source
    example: its index in the unshuffled order, of its component in a mixture ``components[i]``)."""

    steps: np.ndarray
    sources: np.ndarray
    components: np.ndarray


def shuffle_locality(cfg: ShuffleConfig, batch_size: int, steps: int, *, max_points: int = 4000,
                     assign: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
                     passes: Sequence[int | None] = ()) -> Locality:
    """Source positions of the rows of steps ``[0, steps]`` under the shuffle ``cfg``, at most about
    ``max_points`` of them (evenly spread steps, evenly spread rows). ``assign``: a mixture's
    ``QuotaIndex.assign`` (global example -> component, component example); each component shuffles its own.
    ``passes``: per component, the examples of a pass of a ``"spans"`` read, which shuffles each pass on its
    own (:class:`reader.order.passes.Spans`), or None (``"streams"``)."""
    n_steps = steps + 1
    rows_per = max(1, min(batch_size, max_points // n_steps))
    step_ids = np.unique(np.linspace(0, steps, min(n_steps, max_points)).round().astype(np.int64))
    row_ids = np.unique(np.linspace(0, batch_size - 1, rows_per).round().astype(np.int64))
    ex = (step_ids[:, None] * batch_size + row_ids[None, :]).reshape(-1)
    comp, k = assign(ex) if assign is not None else (np.zeros(ex.size, np.int64), ex)
    k = np.asarray(k, dtype=np.int64)
    src = np.asarray(shuffle_example_indices(k, cfg), dtype=np.int64)
    for c, E in enumerate(passes):
        if E:
            src[comp == c] = Spans(E, cfg.lanes, cfg).sources(k[comp == c])
    return Locality(steps=ex // batch_size, sources=src, components=np.asarray(comp, dtype=np.int64))
