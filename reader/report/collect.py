"""Everything the ``report`` page shows, gathered from a cache or a mixture file with bounded reads.

A report reads the ledger (or, while a build runs, its plan and the sidecars written so far), the
``num_tokens`` column of at most ``max_chunks`` chunks spread over the cache (document lengths), a few
dead-letter files, and the chunks behind the rows of two batches it shows; per-shard and per-chunk figures come
from the ledger. So a cache of 100k chunks is reported in seconds, and a running build shows what exists.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable

import numpy as np

from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.format.sidecar import dead_letters_problem
from reader.tokenizers import tokenizer_lib
from reader.mixture.quotas import QuotaIndex
from reader.mixture.mixture import Mixture
from reader.mixture.mixture_file import is_mixture_path
from reader.options import ReadOptions
from reader.order.streams import NotYetAvailable
from reader.reader import Reader
from reader.report import annotated_rows as rowlib, figures, summary
from reader.storage.cache import Cache, CacheNotReady
from reader.storage.progress import Progress, read_progress
from reader.storage.views import tally
from reader.storage.validate import chunk_doc_lengths

DEAD_LETTER_FILES = 8  # dead-letter files read for examples, at most


@dataclasses.dataclass
class RowView:
    row: int
    example: int
    epoch: int
    component: str | None
    pieces: list[rowlib.Piece]


@dataclasses.dataclass
class BatchView:
    batch: int
    rows: list[RowView]
    note: str = ""  # why rows are missing (a running build has not written them yet)
    packing: figures.RowPacking | None = None  # how full the whole batch's rows are


@dataclasses.dataclass
class ReportData:
    path: str
    command: str
    options: ReadOptions
    steps: int
    summary: dict  # inspect's: summary.cache_summary or, for a mixture, summary.mixture_summary
    is_mixture: bool
    progress: Progress | None  # a single cache's build
    tokenizer: str  # the identity and EOS, or why the tokenizer could not be loaded (ids shown then)
    lengths: figures.Histogram
    length_note: str
    shard_tokens: list[tuple[str, int]]
    chunk_tokens: figures.Histogram | None
    field_tokens: dict[str, list[tuple[str, int]]]  # kept fields with few values: their bar chart
    bad: list[tuple[str, int, float]]
    dead_letters: dict[str, list[dict[str, Any]]]
    batches: list[BatchView]
    shares: tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]] | None  # steps, realised, target, names
    locality: figures.Locality | None
    chunks_read: int  # chunk files read: the length sample plus the chunks behind the rows shown
    field_notes: dict[str, str] = dataclasses.field(default_factory=dict)  # the other kept fields, in a line
    view: dict | None = None  # a single cache's view: what it keeps, in all and per input (views.tally)


class _Counted:
    """A length reader that remembers what it read: ``got[(cache url, chunk)]`` = the chunk's lengths."""

    def __init__(self, read):
        self.read, self.got, self.lock = read, {}, threading.Lock()

    def __call__(self, cache: Cache, c: int) -> np.ndarray:
        lengths = self.read(cache, c)
        with self.lock:
            self.got[(cache.url, c)] = lengths
        return lengths

    def of(self, cache: Cache) -> dict[int, np.ndarray]:
        return {c: v for (url, c), v in self.got.items() if url == cache.url}


def collect(path: str, opts: ReadOptions, steps: int, *, command: str = "", tokenizer: str | None = None,
            rows: int = 4, max_chunks: int = 64, threads: int = 8,
            read: Callable[[Cache, int], np.ndarray] = chunk_doc_lengths) -> ReportData:
    """The report of ``path`` (a cache or a mixture file) read with ``opts``: batches 0 and ``steps``
    (their first ``rows`` rows), mixture shares and shuffle locality over steps ``[0, steps]``.

    ``tokenizer``: a spec to decode with instead of the cache's own (an error if it is not the cache's).
    ``read``: one chunk's document lengths (tests count the reads through it).
    """
    counted = _Counted(read)
    mixture = is_mixture_path(path)
    mix = Mixture(path) if mixture else None
    caches = mix.caches if mix is not None else [Cache(path)]
    tok, tok_text = _tokenizer(caches[0], tokenizer)
    progress = None
    if mix is not None:
        info = summary.mixture_summary(path, opts, steps, mix)
        per = max(1, max_chunks // len(caches))
        lengths = np.concatenate([summary.cache_summary(c, c.url, max_chunks=per, threads=threads, read=counted)[1]
                                  for c in caches])
        sampled, known = len(counted.got), sum(len(c.table) for c in caches)
        shard_tokens, chunk_hist, field_tokens, field_notes, bad, dead, view = [], None, {}, {}, [], {}, None
    else:
        cache = caches[0]
        info, lengths = summary.cache_summary(cache, path, max_chunks=max_chunks, threads=threads, seq_len=opts.seq_len,
                                              read=counted)
        info["passes"] = summary.cache_passes(cache, opts, steps)
        sampled, known = len(counted.got), len(cache.table)
        progress = read_progress(cache)
        shard, tokens, entries = _chunks(cache, progress)
        names = [os.path.basename(str(inp.get("path", i))) or str(i) for i, inp in enumerate(cache.ledger.inputs)]
        shard_tokens = list(zip(names, figures.tokens_per_shard(shard, tokens, len(names)).tolist()))
        chunk_hist = figures.linear_histogram(tokens) if len(tokens) else None
        field_tokens, field_notes = kept_field_tokens(cache, counted.of(cache))
        bad = figures.bad_record_rows(progress.bad_reasons)
        dead = figures.dead_letter_examples(_dead_letters(cache, entries)) if bad else {}
        # (the kept counts a read through the view needs anyway; the clusters are inspect --view's)
        view = tally(cache, opts.view, with_clusters=False, index_cache=opts.index_cache) if opts.view else None
    note = f"{lengths.size:,} documents, from {sampled:,} of {known:,} chunks spread over the cache"
    decode = rowlib.ids_decoder(tok.decode if tok is not None else None)
    names = mix.names if mix is not None else None
    batches, opened = _batches(path, opts, [0, steps] if steps else [0], rows, decode, names)
    shares = locality = None
    if mix is not None and not opts.eval_mode:
        index = QuotaIndex(mix.spec.quotas(opts.effective_ideal_readers, opts.batch_size))
        at = figures.checkpoints(max(steps, 1))
        segs = [(g["start_batch"], [g["weights"][n] for n in mix.names]) for g in info["segments"]]
        shares = (at, figures.realised_shares(index.consumed, opts.batch_size, at), figures.target_shares(segs, at),
                  mix.names)
    cfg = opts.shuffle_config()
    if cfg is not None:
        assign = QuotaIndex(mix.spec.quotas(opts.effective_ideal_readers, opts.batch_size)).assign if mix is not None else None
        per = info["components"] if mix is not None else [info["passes"]]
        passes = [p["examples_per_pass"] if p["pass_rule"] == "spans" else None for p in per]
        locality = figures.shuffle_locality(cfg, opts.batch_size, max(steps, 1), assign=assign, passes=passes)
    return ReportData(
        path=path, command=command, options=opts, steps=steps, summary=info, is_mixture=mix is not None,
        progress=progress, tokenizer=tok_text, lengths=figures.log_histogram(lengths), length_note=note,
        shard_tokens=shard_tokens, chunk_tokens=chunk_hist, field_tokens=field_tokens, bad=bad, dead_letters=dead,
        batches=batches, shares=shares, locality=locality, chunks_read=sampled + opened, field_notes=field_notes,
        view=view)


def _tokenizer(cache: Cache, spec: str | None) -> tuple[tokenizer_lib.Tokenizer | None, str]:
    """The tokenizer to decode with and what the page says about it. A ``spec`` that fails is the user's error
    (raised); the cache's own failing leaves the rows as token ids, and says why."""
    t = cache.ledger.tokenizer
    ident = (f"{t.get('spec')} (kind {t.get('kind')}, name {t.get('name')}, vocab_size {t.get('vocab_size')}, "
             f"hash {str(t.get('hash'))[:23]}…)")
    if spec is not None:
        tok = tokenizer_lib.for_cache(cache, spec)
        return tok, f"{ident}; {tok.eos.describe()}; decoded with {spec}"
    try:
        tok = tokenizer_lib.for_cache(cache)
    except (tokenizer_lib.TokenizerError, fmt.FormatError) as e:
        return None, f"{ident}; eos_id {t.get('eos_id')}. Rows show token ids: {e}"
    return tok, f"{ident}; {tok.eos.describe()}"


def _chunks(cache: Cache, progress: Progress) -> tuple[np.ndarray, np.ndarray, list]:
    """Per-chunk shard numbers and token counts, and the entries (ledger or sidecars): every chunk of a finished
    cache, every chunk written so far of a running build."""
    if cache.complete:
        table = chunk_table.table_of(cache.table)
        if table is None:
            entries = list(cache.ledger.raw.get("chunks", []))
        else:  # a table: the chunks with bad records have their dead letters at the format's path
            t = cache.table
            bad = np.flatnonzero(table.columns(["bad_records"])["bad_records"])[:DEAD_LETTER_FILES].tolist()
            rows = chunk_table.recorded_rows(t, cache.ledger.raw, bad)  # (their sidecars' sha256: checked)
            entries = [dict(rows[c], dead_letters=fmt.dead_letter_path(int(t.shard[c]), int(t.index_in_shard[c])))
                       for c in bad]
        return cache.table.shard.astype(np.int64), cache.table.tokens, entries
    e = progress.entries
    return (np.asarray([x["shard"] for x in e], np.int64), np.asarray([x["tokens"] for x in e], np.int64), e)


def _dead_letters(cache: Cache, entries) -> list[dict]:
    """The records of the first few dead-letter files, in chunk order, each file verified first against its
    sidecar (whose own sha256 the ledger records): a file that is not the build's is a damaged cache, named,
    never shown."""
    out: list[dict] = []
    for e in [e for e in entries if e.get("dead_letters")][:DEAD_LETTER_FILES]:
        rel, side = e["dead_letters"], e
        if "dead_letters_checksum" not in e:  # a ledger entry: the sidecar holds the file's sha256
            side_rel = fmt.sidecar_path(int(e["shard"]), int(e["index_in_shard"]))
            raw = cache.cat(side_rel)
            if e.get("sidecar_checksum") not in (None, fmt.checksum(raw)):
                raise fmt.DamagedCache(f"{cache.display(side_rel)}: its sha256 is {fmt.checksum(raw)}, the ledger "
                                       f"says {e['sidecar_checksum']}; run `python -m reader validate`")
            side = fmt.load_json(raw)
        data: dict[str, bytes | None] = {}

        def read(r: str) -> bytes | None:
            try:
                data[r] = cache.cat(r)
            except FileNotFoundError:
                data[r] = None
            return data[r]

        wrong = dead_letters_problem(side, read) if isinstance(side, dict) else "its sidecar is not a JSON object"
        if wrong:
            raise fmt.DamagedCache(f"{cache.display(rel)}: {wrong}; run `python -m reader validate`")
        for n, line in enumerate(data[rel].splitlines(), 1):
            try:
                letter = fmt.load_json(line)
            except ValueError as err:
                letter = err
            if not isinstance(letter, dict):
                what = letter if isinstance(letter, ValueError) else "not a JSON object"
                raise fmt.DamagedCache(f"{cache.display(rel)}: line {n} is not a dead letter ({what}); run "
                                       "`python -m reader validate`")
            out.append(letter)
    return out


def kept_field_tokens(cache: Cache, sampled: dict[int, np.ndarray]) -> tuple[dict[str, list[tuple[str, int]]],
                                                                           dict[str, str]]:
    """Tokens per value of each kept metadata field (``--keep_fields``) over the sampled chunks (``sampled``:
    chunk -> its document lengths), by ``Cache.fields``, for the fields with few values (the bar charts); the
    others summarized in a line each (:func:`reader.report.figures.field_note`). Nothing for a cache that keeps
    no field."""
    names = tuple(cache.ledger.config.get("keep_fields") or ())
    fields = getattr(cache, "fields", None)
    if not names or fields is None:
        return {}, {}
    off = cache.table.doc_offsets
    tally: dict[str, dict[Any, int]] = {n: {} for n in names}
    for c, lengths in sorted(sampled.items()):
        got = fields(int(off[c]), int(off[c + 1]), names)
        for n in names:
            for value, k in zip(got[n], lengths.tolist()):
                tally[n][value] = tally[n].get(value, 0) + int(k)
    notes = {n: figures.field_note(t) for n, t in tally.items()}
    return ({n: figures.tokens_per_value(t) for n, t in tally.items() if notes[n] is None},
            {n: note for n, note in notes.items() if note is not None})


def _batches(path: str, opts: ReadOptions, which: list[int], rows: int, decode, names) -> tuple[list[BatchView], int]:
    """The first ``rows`` rows of each batch in ``which``, decoded, the padding and pieces per row of the
    whole batch, and how many chunks were opened for them. A running build's batch that is not written yet
    is shown as a note (the report does not wait)."""
    opts = dataclasses.replace(opts, prefetch_batches=0, prefetch_threads=0, layout="arrays")
    out = []
    with Reader(path, opts, wait_timeout_s=0.0) as r:
        want = np.arange(min(rows, opts.batch_size))
        for b in which:
            try:
                got = r.rows(b, np.arange(opts.batch_size))
            except (CacheNotReady, NotYetAvailable) as e:
                out.append(BatchView(b, [], f"not readable yet: {e}"))
                continue
            views = []
            for i, row in enumerate(want.tolist()):
                if not bool(got["valid"][i]):
                    continue
                comp = int(got["components"][i])
                views.append(RowView(row, int(got["example_ids"][i]), int(got["epochs"][i]),
                                     names[comp] if names is not None and comp >= 0 else None,
                                     rowlib.batch_row_pieces(got, i, decode)))
            out.append(BatchView(b, views, "" if views else "past the end of the eval pass", figures.row_packing([got])))
        opened = len(r.store.opened)
    return out, opened
