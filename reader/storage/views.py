"""Views (``ReadOptions.view``): the same chunks with some documents left out, for the order and the store.

A view changes which documents exist and nothing else. So a read of a view sees the cache's chunks with
kept counts (:class:`ViewedCache`, whose ``table`` has each chunk's kept documents and tokens), and a chunk's
decoded row groups hold only its kept documents (``ChunkStore`` applies :meth:`View.chunk`'s mask after
decoding; its layout's row-group offsets are those of the kept documents). Everything the order computes
(streams, spans, shuffle, packing, best fit, mixtures) then works on the view unchanged, and with it
R-invariance, seek and resume.

Which documents a chunk keeps (:meth:`View.chunk`) comes from its attribute files (duplicate marks,
:class:`reader.storage.attributes.AttributeSet`) and its ``num_tokens`` and ``fields`` columns. The kept
counts of every chunk are an index file, ``ROOT/index/view-KEY.bin`` (KEY: the view's canonical text's
hash), recording a fingerprint of the chunk table, the view and the attribute manifests it used; a file of
another fingerprint, or damaged, is counted again, and a chunk whose mask disagrees with the file is refused
naming it.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import hashlib
import threading
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from reader.format import attributes as attrs
from reader.format import blocks
from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.storage import files
from reader.storage.attributes import AttributeSet
from reader.storage.cache import Cache
from reader.storage.fields import kept_fields
from reader.storage.index import chunk_columns
from reader.storage.view_syntax import Clause, ViewError, ViewSpec, parse_view

INDEX_DIR = "index"
_MASKS = 64  # chunks whose masks are kept


@dataclasses.dataclass(frozen=True)
class ChunkKeep:
    """Chunk ``c`` under a view: ``keep`` (bool per stored document), the stored documents' ``lengths`` and
    its row groups' stored document counts ``rg_docs``."""

    keep: np.ndarray
    lengths: np.ndarray
    rg_docs: np.ndarray

    @property
    def docs(self) -> int:
        return int(self.keep.sum())

    @property
    def tokens(self) -> int:
        return int(self.lengths[self.keep].sum())

    def kept(self) -> tuple[np.ndarray, np.ndarray]:
        """``(kept documents per row group, kept documents' lengths)``: the chunk as the view's reads see it."""
        starts = np.concatenate([[0], np.cumsum(self.rg_docs)])
        cum = np.concatenate([[0], np.cumsum(self.keep, dtype=np.int64)])
        return cum[starts[1:]] - cum[starts[:-1]], self.lengths[self.keep]


class View:
    """The view ``spec`` of ``cache``. Raises :class:`ViewError` naming the clause for a field the cache does
    not keep, an attribute set it lacks or of another kind, or marks wanted of a build still running."""

    def __init__(self, cache: Cache, spec: ViewSpec | str, *, index_cache: bool = True, threads: int = 8):
        self.cache = cache
        self.spec = spec = parse_view(spec) if not isinstance(spec, ViewSpec) else spec
        self.index_cache = index_cache
        self.threads = threads
        have = kept_fields(cache)
        for c in spec.clauses:
            if c.mark is None and c.field not in have:
                raise ViewError(f"view clause {c.source!r}: {cache.url} keeps no field {c.field!r} (it keeps: "
                                f"{', '.join(have) or 'none; build it with --keep_fields'})")
        self.sets: dict[str, AttributeSet] = {}
        for c in spec.clauses:
            if c.mark is not None and c.attr_set not in self.sets:
                self.sets[c.attr_set] = self._open_set(c)
        self._lock = threading.Lock()
        self._counting = threading.Lock()  # (one thread counts new chunks; the others wait for its counts)
        self._n = 0
        self._docs = np.zeros(0, np.int64)
        self._tokens = np.zeros(0, np.int64)
        self._masks: collections.OrderedDict[int, ChunkKeep] = collections.OrderedDict()
        self._tables: tuple[Any, fmt.ChunkTable] | None = None

    def _open_set(self, c: Clause) -> AttributeSet:
        cache, near = self.cache, c.mark == "near_duplicate"
        how = f"python -m pipelines.dedup {cache.url}{' --near' * near}"
        if not cache.complete:
            raise ViewError(f"view clause {c.source!r} needs duplicate marks, which are computed over a finished "
                            f"cache; the build of {cache.url} is still running (a view of kept fields alone follows "
                            f"a build). Wait for it, then compute them with {how}")
        try:
            s = AttributeSet(cache, c.attr_set)
        except FileNotFoundError:
            raise ViewError(f"view clause {c.source!r}: {cache.display(attrs.manifest_path(c.attr_set))} is missing: "
                            f"compute them with {how}") from None
        want = attrs.NEAR if near else attrs.EXACT
        if s.manifest.kind != want:
            raise ViewError(f"view clause {c.source!r}: attribute set {c.attr_set!r} holds {s.manifest.kind}, not "
                            f"{want}")
        floor = s.manifest.raw["params"].get("threshold")
        if near and isinstance(floor, (int, float)) and c.threshold < floor:
            raise ViewError(f"view clause {c.source!r}: the marks were verified at Jaccard >= {floor}; a threshold "
                            f"below it would miss pairs (use {floor} or more)")
        return s

    # -- one chunk ------------------------------------------------------------------------------------
    def chunk(self, c: int, file_meta: Any = None) -> ChunkKeep:
        """Chunk ``c``'s mask (kept for a few recent chunks), checked against the counts of the index file.
        ``file_meta``: the chunk's parsed Parquet footer, when the caller has it."""
        with self._lock:
            got = self._masks.get(c)
            if got is not None:
                self._masks.move_to_end(c)
                return got
        got = self._compute(c, file_meta)
        if c < self._n and (got.docs, got.tokens) != (int(self._docs[c]), int(self._tokens[c])):
            raise fmt.DamagedCache(
                f"{self.cache.display(self.index_file)}: chunk {c} keeps {got.docs} documents / {got.tokens} tokens "
                f"under the view {self.spec.text!r}, the file says {int(self._docs[c])} / {int(self._tokens[c])}: "
                "it was changed after it was written; delete it (readers make it again)")
        with self._lock:
            self._masks[c] = got
            while len(self._masks) > _MASKS:
                self._masks.popitem(last=False)
        return got

    def _compute(self, c: int, file_meta: Any = None) -> ChunkKeep:
        cache = self.cache
        fields = self.spec.fields
        # (only the fields the view names, a struct of just them; a kept field with a dot in its name (a nested
        # key) is read with the whole struct, as pyarrow would take the dot for a level)
        cols = [f"{fmt.FIELDS_COLUMN}.{n}" for n in fields] if not any("." in n for n in fields) else \
            [fmt.FIELDS_COLUMN] * bool(fields)
        rg_docs, lengths, extra = chunk_columns(cache, cache.table, c, cols, file_meta)
        keep = np.ones(lengths.size, bool)
        for cl in self.spec.clauses:
            if cl.mark is not None:
                cols = self.sets[cl.attr_set].chunk(c)
                hit = cols["keeper"] != attrs.KEPT
                if cl.threshold is not None:
                    hit &= cols["jaccard"] >= np.float32(cl.threshold)
                keep &= hit if not cl.negate else ~hit
            else:
                keep &= self._predicate(cl, extra[0].field(cl.field), c)
        return ChunkKeep(keep, lengths, np.asarray(rg_docs, np.int64))

    def _predicate(self, cl: Clause, col: pa.Array, c: int) -> np.ndarray:
        """A field clause over a chunk's values (a document without the field fails it). Compared in numpy: a
        pyarrow array or scalar made from Python values would import pandas."""
        null = _values(pc.cast(pc.is_null(col), pa.int8()), np.int8).astype(bool)
        if cl.numeric:
            try:
                x = _values(pc.cast(col, pa.float64()), np.float64)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                bad = next(v for v in col.to_pylist() if v is not None and not _is_number(v))
                raise ViewError(f"view clause {cl.source!r}: field {cl.field!r} holds {bad!r} in "
                                f"{self.cache.display(self.cache.table.paths[c])}, not a number; compare it "
                                "with a quoted string") from None
            hit = _holds(cl, x)
        else:  # each distinct value once
            enc = pc.dictionary_encode(col)
            values = np.asarray(enc.dictionary.to_pylist() + [""], dtype=object)
            idx = _values(enc.indices, np.int32)
            hit = _holds(cl, values)[np.where(null, values.size - 1, idx)]
        return hit & ~null

    # -- counts per chunk ---------------------------------------------------------------------------
    @property
    def index_file(self) -> str:
        return f"{INDEX_DIR}/view-{self.spec.key}.bin"

    def fingerprint(self, table: fmt.ChunkTable) -> str:
        """What the view's counts belong to: the chunk table's fingerprint, the view's text and the manifests of
        the attribute sets it uses."""
        h = hashlib.sha256(f"{chunk_table.fingerprint(table)}\n{self.spec.text}\n".encode())
        for name in sorted(self.sets):
            h.update(f"{name}:{fmt.checksum(attrs.manifest_bytes(self.sets[name].manifest.raw))}\n".encode())
        return h.hexdigest()

    def counts(self, table: fmt.ChunkTable) -> tuple[np.ndarray, np.ndarray]:
        """``(kept documents, kept tokens)`` of every chunk of ``table`` (the index file's, or counted)."""
        with self._counting:
            return self._counts(table)

    def _counts(self, table: fmt.ChunkTable) -> tuple[np.ndarray, np.ndarray]:
        cache = self.cache
        use_file = cache.complete and self.index_cache
        if use_file and not self._n:
            self._load(table)
        todo = range(self._n, len(table))
        if todo:
            with cf.ThreadPoolExecutor(self.threads) as pool:
                got = list(pool.map(self._compute, todo))
            with self._lock:
                self._docs = np.concatenate([self._docs, np.asarray([g.docs for g in got], np.int64)])
                self._tokens = np.concatenate([self._tokens, np.asarray([g.tokens for g in got], np.int64)])
                self._n = self._docs.size
            if use_file:
                try:
                    files.write(cache.storage, cache.path(self.index_file), self._file_bytes(table))
                except files.UnsafeFile as e:  # a symlink planted in the cache: never written through
                    warnings.warn(f"the reader's view index file is not written: {e}", stacklevel=2)
                except Exception:  # noqa: BLE001 - a read-only cache keeps the counts in memory only
                    pass
        n = len(table)
        return self._docs[:n], self._tokens[:n]

    def _file_bytes(self, table: fmt.ChunkTable) -> bytes:
        n, i64 = len(table), blocks.INT64
        head = {"format": "chunkledger-view-index", "view": self.spec.text, "fingerprint": self.fingerprint(table)}
        return blocks.write_parts(head, {"chunks": [("docs", i64, self._docs[:n]), ("tokens", i64, self._tokens[:n])]},
                                  chunk_table.BLOCK_ROWS)

    def _load(self, table: fmt.ChunkTable) -> None:
        """The index file's counts, if it is there and ours (else they are counted again)."""
        cache, n = self.cache, len(table)
        try:
            raw = cache.storage.read(cache.path(self.index_file), limit=(1 << 16) + 48 * n)
            head, data = blocks.read_parts(raw, cache.display(self.index_file))
            if (head.get("view"), head.get("fingerprint")) != (self.spec.text, self.fingerprint(table)):
                return
            docs, tokens = (np.asarray(data["chunks"][k], np.int64) for k in ("docs", "tokens"))
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError, fmt.FormatError,
                files.UnsafeFile):
            return
        if docs.shape != (n,) or tokens.shape != (n,) or (docs < 0).any() or (tokens < 0).any() \
                or (docs > table.docs).any() or (tokens > table.tokens).any():
            return
        self._docs, self._tokens, self._n = docs, tokens, n

    def table(self, table: fmt.ChunkTable) -> fmt.ChunkTable:
        """``table`` with each chunk's kept documents and tokens (the same object for the same ``table``)."""
        got = self._tables
        if got is not None and got[0] is table:
            return got[1]
        with self._counting:
            got = self._tables
            if got is not None and got[0] is table:
                return got[1]
            docs, tokens = self._counts(table)
            viewed = dataclasses.replace(table, docs=docs, tokens=tokens, loss_tokens=None)
            self._tables = (table, viewed)
            return viewed

    def check_not_empty(self) -> None:
        """A finished cache of which the view keeps nothing: :class:`ViewError` naming the view."""
        if self.cache.complete and not int(self.counts(self.cache.table)[1].sum()):
            t = self.cache.table
            raise ViewError(f"{self.cache.url}: the view {self.spec.text!r} keeps no document of its "
                            f"{int(t.docs.sum()):,})")


def keep_documents(keep: np.ndarray, padded: np.ndarray, lengths: np.ndarray, loss: np.ndarray | None):
    """A decoded row group (``padded``: a 0, then its tokens; its documents' ``lengths``; ``loss`` laid out as
    ``padded`` or None) with only the documents ``keep`` (bool per document)."""
    if keep.all():
        return padded, lengths, loss
    # runs of kept documents copied as slices (a boolean index per token costs several times more)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
    cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]) + 1
    runs = list(zip(cum[edges[0::2]].tolist(), cum[edges[1::2]].tolist()))
    out = np.concatenate([padded[:1]] + [padded[lo:hi] for lo, hi in runs])
    if loss is not None:
        loss = np.concatenate([loss[:1]] + [loss[lo:hi] for lo, hi in runs])
    return out, lengths[keep], loss


def viewed_meta(view: View, m):
    """Chunk layout ``m`` (a :class:`reader.storage.chunk.ChunkMeta`) as the view's reads see it: its row groups'
    offsets count kept documents and tokens; ``keep`` and ``stored`` (the stored offsets) tell the store what to
    decode and what to leave out."""
    k = view.chunk(m.index, m.file_meta)
    if not np.array_equal(k.rg_docs, np.diff(m.rg_doc_starts)):
        raise fmt.DamagedCache(f"{view.cache.display(m.path)}: its row groups hold {k.rg_docs.tolist()} documents, "
                               f"its sidecar says {np.diff(m.rg_doc_starts).tolist()}; run `python -m reader validate`")
    per, lengths = k.kept()
    docs = np.concatenate([[0], np.cumsum(per)])
    tokens = np.concatenate([[0], np.cumsum(lengths)])[docs]
    got = dataclasses.replace(m, rg_token_starts=tokens, rg_doc_starts=docs, keep=k.keep,
                              stored=(m.rg_token_starts, m.rg_doc_starts))
    return got, got.nbytes


def tally(cache: Cache, view: Any, *, with_clusters: bool = True, index_cache: bool = False) -> dict[str, Any]:
    """What ``view`` keeps of the chunks of ``cache`` known now (``inspect --view``): its canonical text, the
    documents and tokens kept and dropped in all, and per input (the source each chunk was built from); and, if
    ``with_clusters``, each attribute set's duplicate clusters (which reads every attribute file)."""
    v = View(cache, view, index_cache=index_cache)
    t = cache.table
    docs, tokens = v.counts(t)
    paths = {int(i["shard"]): i.get("path") for i in cache.ledger.raw.get("inputs", [])}

    def row(m: np.ndarray) -> dict[str, int]:
        kd, kt, d, n = (int(x[m].sum()) for x in (docs, tokens, t.docs, t.tokens))
        return {"kept_documents": kd, "kept_tokens": kt, "dropped_documents": d - kd, "dropped_tokens": n - kt}

    shards = np.asarray(t.shard, np.int64)
    return {"view": v.spec.text, **row(np.ones(len(t), bool)),
            "by_input": [{"input": paths.get(s, f"shard {s}"), **row(shards == s)} for s in np.unique(shards).tolist()],
            "clusters": [clusters(s) for _, s in sorted(v.sets.items())] if with_clusters else []}


def clusters(s: AttributeSet, top: int = 3, show: int = 12) -> dict[str, Any]:
    """The duplicate clusters of attribute set ``s`` (a keeper and the documents marked with it): how many, how
    many of each size, and the ``top`` largest, each with its keeper's first ``show`` tokens beside one copy's
    (the first marked with it) and that copy's Jaccard estimate (exact duplicates: 1)."""
    t, off = s.cache.table, s.cache.table.doc_offsets
    keeper, member, jac = [], [], []
    for c in range(len(t)):
        cols = s.chunk(c)
        m = np.flatnonzero(cols["keeper"] != attrs.KEPT)
        keeper.append(cols["keeper"][m])
        member.append(m + int(off[c]))
        jac.append(cols["jaccard"][m] if "jaccard" in cols else np.ones(m.size, np.float32))
    keeper, member, jac = (np.concatenate(x) if x else np.zeros(0) for x in (keeper, member, jac))
    ids, counts = np.unique(keeper, return_counts=True)
    sizes, many = np.unique(counts + 1, return_counts=True)
    largest = []
    for i in np.argsort(-counts, kind="stable")[:top].tolist():
        k = int(ids[i])
        first = int(np.flatnonzero(keeper == k)[0])
        copy = int(member[first])
        largest.append({"keeper": k, "size": int(counts[i]) + 1, "copy": copy, "jaccard": round(float(jac[first]), 4),
                        "keeper_tokens": document_tokens(s.cache, k)[:show].tolist(),
                        "copy_tokens": document_tokens(s.cache, copy)[:show].tolist()})
    return {"set": s.name, "kind": s.manifest.kind, "clusters": int(ids.size), "marked": int(keeper.size),
            "sizes": {int(a): int(b) for a, b in zip(sizes, many)}, "largest": largest}


def document_tokens(cache: Cache, d: int) -> np.ndarray:
    """The tokens of document ``d`` (global order), from the row group of its chunk that holds it."""
    import pyarrow.parquet as pq

    off = cache.table.doc_offsets
    c = int(np.searchsorted(off, d, side="right")) - 1
    with cache.storage.open(cache.path(cache.table.paths[c])) as f:
        pf = pq.ParquetFile(f)
        row = d - int(off[c])
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if row < n:
                col = pf.read_row_group(g, columns=[fmt.TOKEN_COLUMN], use_threads=False).column(0).combine_chunks()
                return _values(col.values, np.int32)[col.offsets[row].as_py():col.offsets[row + 1].as_py()]
            row -= n
    raise IndexError(f"document {d} is not in {cache.url}")


def describe(t: dict[str, Any]) -> list[str]:
    """:func:`tally`'s lines for ``inspect``."""
    rows = [("all", t)] + [(str(r["input"]), r) for r in t["by_input"]]
    w = max(len(name) for name, _ in rows)
    out = [f"view        {t['view']}", f"  {'':<{w}}  {'documents kept':>24}  {'tokens kept':>32}"]
    for name, r in rows:
        d, n = r["kept_documents"] + r["dropped_documents"], r["kept_tokens"] + r["dropped_tokens"]
        out.append(f"  {name:<{w}}  {r['kept_documents']:>10,} of {d:<10,}  {r['kept_tokens']:>14,} of {n:<14,} "
                   f"({r['kept_tokens'] / max(1, n):.1%})")
    for c in t["clusters"]:
        sizes = ", ".join(f"{n:,} of {s}" for s, n in sorted(c["sizes"].items()))
        out.append(f"clusters    {c['set']} ({c['kind']}): {c['clusters']:,} clusters, {c['marked']:,} documents marked; "
                   f"sizes (documents): {sizes or 'none'}")
        for x in c["largest"]:
            out.append(f"  keeper {x['keeper']:,} (cluster of {x['size']}): {x['keeper_tokens']}")
            out.append(f"  copy   {x['copy']:,} (Jaccard {x['jaccard']}): {x['copy_tokens']}")
    return out


def _values(arr: pa.Array, dtype) -> np.ndarray:
    """A fixed-width Arrow array's values as numpy, nulls included as whatever their slots hold."""
    if len(arr) == 0:
        return np.zeros(0, dtype)
    width = np.dtype(dtype).itemsize
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * width)


def _holds(cl: Clause, x: np.ndarray) -> np.ndarray:
    """Clause ``cl``'s comparison over ``x`` (floats, or Python strings as objects)."""
    if cl.op in ("in", "not in"):
        got = np.isin(x, np.asarray(cl.value, dtype=x.dtype))
        return ~got if cl.op == "not in" else got
    v = cl.value
    return {">=": x >= v, ">": x > v, "<=": x <= v, "<": x < v, "==": x == v, "!=": x != v}[cl.op]


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


class ViewedCache:
    """``cache`` as a read of ``view`` sees it: ``table`` holds the kept counts; everything else is the cache's."""

    def __init__(self, cache: Cache, view: View):
        self._cache, self.view = cache, view

    @property
    def table(self) -> fmt.ChunkTable:
        return self.view.table(self._cache.table)

    def __getattr__(self, name: str):
        return getattr(self._cache, name)


def check_view_files(cache: Cache) -> tuple[list[str], dict[str, tuple[View, ViewedCache]]]:
    """Problems of the views' count files ``ROOT/index/view-KEY.bin`` (``validate``): each file made for this
    cache is counted again from the chunks and must say the same (one made for other chunks or attribute sets,
    or unreadable, is ignored by readers, who count again, and here); and ``{KEY: (view, cache as it sees it)}``
    of the files checked, whose example index files ``check_index_files`` then checks."""
    if not cache.complete:
        return [], {}
    problems, found, table = [], {}, cache.table
    for e in cache.storage.list(cache.path(INDEX_DIR)):
        name = e.path.rstrip("/").rsplit("/", 1)[-1]
        if not (name.startswith("view-") and name.endswith(".bin")):
            continue
        rel = f"{INDEX_DIR}/{name}"
        try:
            head, _ = blocks.read_parts(cache.storage.read(cache.path(rel)), cache.display(rel))
            view = View(cache, head["view"])
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError, fmt.FormatError, files.UnsafeFile):
            continue  # (ViewError is a ValueError: a view this cache can no longer answer)
        if view.index_file != rel:
            continue
        view._load(table)
        if view._n != len(table):
            continue
        try:
            for c in range(len(table)):  # (each chunk's keep is checked against the file's counts)
                view.chunk(c)
        except fmt.DamagedCache as err:
            problems.append(str(err))
            continue
        found[view.spec.key] = (view, ViewedCache(cache, view))
    return problems, found


def open_view(cache: Cache, view: Any, *, index_cache: bool = True) -> tuple[View | None, Cache | ViewedCache]:
    """``(view, cache as its reads see it)`` of ``view`` (``ReadOptions.view``'s syntax) over ``cache``;
    ``(None, cache)`` without one. A view that keeps nothing of a finished cache is an error naming it."""
    spec = parse_view(view)
    if spec is None:
        return None, cache
    view = View(cache, spec, index_cache=index_cache)
    view.check_not_empty()
    return view, ViewedCache(cache, view)
