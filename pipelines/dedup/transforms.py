"""The dedup job's Beam side: duplicate marks computed over a finished cache and written as an attribute set.

Every element between steps is a batch of numpy arrays (a chunk's hashes, signatures or marks; a partition
of the keys), never one document, so a corpus of millions of documents is a few thousand elements.

Exact (:class:`ExactDuplicates`)::

    chunks -> HashDocuments (per chunk: each document's xxh3-128 of its token ids, by hash partition)
           -> GroupByHash (GroupByKey on the partition) -> FindCopies (groups of equal hash and length:
              each member but the first marked with the first) -> marks by chunk -> WriteSet

Near (:class:`NearDuplicates`)::

    chunks -> Sign (per chunk: MinHash signatures, pipelines/dedup/minhash.py) -> signatures by chunk
    signatures -> BandKeys (by key partition) -> GroupByBand (GroupByKey) -> Candidates (pairs of a
              bucket, pipelines/dedup/groups.py) by the first document's chunk
    {signatures, pairs} -> CoGroupByKey on the chunk -> AttachFirst (the first document's signature) by
              the second document's chunk
    {signatures, halves} -> CoGroupByKey on the chunk -> Verify (estimated Jaccard >= threshold: an edge)
    edges -> AllEdges (one list) -> Cluster (groups.greedy_marks, one worker) -> marks by chunk -> WriteSet

WriteSet: {every chunk, marks} -> CoGroupByKey on the chunk -> WriteFiles (one attribute file per chunk,
atomically; a file already holding these bytes is kept) -> AfterAllFiles (one list) -> Commit (the
manifest, written last).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from reader.format import attributes as attrs
from reader.format import spec as fmt
from reader.interop.export import iter_blocks
from reader.storage.cache import Cache

from pipelines.dedup import groups, minhash
from pipelines.export.job import record_failure
from pipelines import filesystem

NAMESPACE = "chunkledger"
_U = np.uint64


@dataclasses.dataclass(frozen=True)
class Job:
    """What every step needs: the cache, the set and its parameters (small and picklable).

    Attributes:
      cache_url: the cache root (as Beam's FileSystems and fsspec spell it).
      name: the attribute set's name; kind: its kind (``reader.format.attributes.KINDS``).
      params: the set's parameters (recorded in its manifest); partitions: hash partitions of a GroupByKey.
      threshold: near duplicates: the smallest estimated Jaccard of an edge.
    """

    cache_url: str
    name: str
    kind: str
    params: tuple
    partitions: int
    threshold: float = 1.0

    @property
    def set_url(self) -> str:
        return fmt.join(self.cache_url, attrs.set_dir(self.name))

    @property
    def params_hash(self) -> str:
        return attrs.params_hash(dict(self.params))


class _CacheFn(beam.DoFn):
    """A step that opens the cache once per worker and records its error for the launcher (every runner
    wraps a worker's exception in its own)."""

    def __init__(self, job: Job):
        self.job = job
        self._cache: Cache | None = None

    def setup(self):
        self._cache = None

    def cache(self) -> Cache:
        """The cache, opened on first use in this worker (a method: Beam reads a DoFn's properties when it
        inspects it, which would open the cache in the launcher and make the DoFn unpicklable)."""
        if self._cache is None:
            self._cache = Cache(self.job.cache_url)
        return self._cache

    def chunk_of(self, doc: np.ndarray) -> np.ndarray:
        """The global chunk of each global document index."""
        return np.searchsorted(self.cache().table.doc_offsets, doc, side="right") - 1

    def process(self, element) -> Iterable[Any]:
        try:
            yield from self.work(element)
        except Exception as e:
            record_failure(self.job.set_url, e)
            raise

    def work(self, element) -> Iterable[Any]:
        raise NotImplementedError


def _by_chunk(chunk: np.ndarray, *arrays: np.ndarray) -> Iterable[tuple[int, tuple]]:
    """``(c, arrays restricted to chunk c)`` for each chunk present (``chunk`` sorted or not)."""
    order = np.argsort(chunk, kind="stable")
    chunk = chunk[order]
    cuts = np.flatnonzero(np.diff(chunk)) + 1
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(chunk)]])):
        if hi > lo:
            sel = order[lo:hi]
            yield int(chunk[lo]), tuple(a[sel] for a in arrays)


def _by_partition(keys: np.ndarray, partitions: int, *arrays: np.ndarray) -> Iterable[tuple[int, tuple]]:
    """``(p, (keys, *arrays))`` restricted to partition ``p`` (the keys' top bits) for each present."""
    part = (keys >> _U(64 - (partitions.bit_length() - 1))).astype(np.int64) if partitions > 1 else \
        np.zeros(len(keys), np.int64)
    yield from _by_chunk(part, keys, *arrays)


def chunk_tokens(cache: Cache, c: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, lengths)`` of chunk ``c``: its documents' token ids concatenated and their counts, read and
    checked as ``python -m reader export`` reads them."""
    blocks = list(iter_blocks(cache, prefetch=0, chunks=[c]))
    if not blocks:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate([b.values for b in blocks]), np.concatenate([b.lengths for b in blocks])


# --------------------------------------------------------------------------------------------------
# Exact duplicates


def document_hashes(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hi, lo)``: the two halves of each document's xxh3-128 of its token ids (int32, little-endian)."""
    import xxhash

    data = memoryview(np.ascontiguousarray(values, dtype="<i4")).cast("B")
    ends = (np.cumsum(lengths, dtype=np.int64) * 4).tolist()
    starts = [0] + ends[:-1]
    digest = xxhash.xxh3_128_intdigest
    h = [digest(data[s:e]) for s, e in zip(starts, ends)]
    mask = (1 << 64) - 1
    return (np.fromiter((x >> 64 for x in h), _U, len(h)), np.fromiter((x & mask for x in h), _U, len(h)))


class HashChunkFn(_CacheFn):
    """Chunk index -> ``(partition, (hi, lo, num_tokens, doc))`` for each hash partition present."""

    def work(self, c: int):
        values, lengths = chunk_tokens(self.cache(), c)
        hi, lo = document_hashes(values, lengths)
        doc = int(self.cache().table.doc_offsets[c]) + np.arange(len(lengths), dtype=np.int64)
        Metrics.counter(NAMESPACE, "documents_read").inc(len(lengths))
        yield from _by_partition(hi, self.job.partitions, lo, lengths.astype(np.int64), doc)


class ExactGroupsFn(_CacheFn):
    """``(partition, [hashes of each chunk])`` -> ``(chunk, (doc, keeper, jaccard, num_tokens))`` marks."""

    def work(self, element):
        _, parts = element
        hi, lo, ntok, doc = (np.concatenate([p[i] for p in parts]) for i in range(4))
        doc, keeper, ntok = groups.exact_marks(hi, lo, ntok, doc)
        yield from _by_chunk(self.chunk_of(doc), doc, keeper, np.ones(len(doc), np.float32), ntok)


class ExactDuplicates(beam.PTransform):
    """PBegin -> marks by chunk of the exact-duplicate rule (see the module docstring)."""

    def __init__(self, job: Job, chunks: int):
        super().__init__()
        self.job, self.chunks = job, chunks

    def expand(self, pbegin):
        return (pbegin
                | "Chunks" >> beam.Create(range(self.chunks), reshuffle=False)
                | "Spread" >> beam.Reshuffle()
                | "HashDocuments" >> beam.ParDo(HashChunkFn(self.job))
                | "GroupByHash" >> beam.GroupByKey()
                | "FindCopies" >> beam.ParDo(ExactGroupsFn(self.job)))


# --------------------------------------------------------------------------------------------------
# Near duplicates


class SignChunkFn(_CacheFn):
    """Chunk index -> ``(chunk, (signatures [docs, K] uint32, has shingles, num_tokens))``."""

    def work(self, c: int):
        values, lengths = chunk_tokens(self.cache(), c)
        if not len(lengths):
            return
        sig, has = minhash.signatures(values, lengths)
        Metrics.counter(NAMESPACE, "tokens_signed").inc(len(values))
        yield c, (sig, has, lengths.astype(np.int64))


class BandKeysFn(_CacheFn):
    """``(chunk, signatures)`` -> ``(partition, (band keys, doc))`` for each key partition present."""

    def work(self, element):
        c, (sig, has, _) = element
        docs = int(self.cache().table.doc_offsets[c]) + np.flatnonzero(has)
        keys = minhash.band_keys(sig[has]).ravel()
        yield from _by_partition(keys, self.job.partitions, np.repeat(docs, minhash.BANDS))


class CandidatesFn(_CacheFn):
    """``(partition, [band keys])`` -> ``(chunk of a, (a, b))``: the candidate pairs of its buckets."""

    def work(self, element):
        _, parts = element
        keys, doc = (np.concatenate([p[i] for p in parts]) for i in range(2))
        a, b = groups.candidate_pairs(keys, doc)
        Metrics.counter(NAMESPACE, "candidate_pairs").inc(len(a))
        yield from _by_chunk(self.chunk_of(a), a, b)


def _signatures(c: int, got: dict) -> tuple:
    sigs = got["sigs"]
    if len(sigs) != 1:
        raise RuntimeError(f"chunk {c}: {len(sigs)} signature sets, expected one")
    return sigs[0]


class AttachFirstFn(_CacheFn):
    """``(chunk, {sigs, pairs})`` -> ``(chunk of b, (a, b, signature of a))``."""

    def work(self, element):
        c, got = element
        if not got["pairs"]:
            return
        sig, _, _ = _signatures(c, got)
        a, b = groups.unique_pairs(np.concatenate([p[0] for p in got["pairs"]]),
                                   np.concatenate([p[1] for p in got["pairs"]]))
        yield from _by_chunk(self.chunk_of(b), a, b, sig[a - int(self.cache().table.doc_offsets[c])])


class VerifyFn(_CacheFn):
    """``(chunk, {sigs, halves})`` -> ``(a, b, jaccard, num_tokens of b)`` of the pairs whose estimated
    Jaccard similarity is at least the threshold: the edges."""

    def work(self, element):
        c, got = element
        if not got["halves"]:
            return
        sig, _, ntok = _signatures(c, got)
        a, b, sig_a = (np.concatenate([h[i] for h in got["halves"]]) for i in range(3))
        row = b - int(self.cache().table.doc_offsets[c])
        jac = minhash.jaccard(sig_a, sig[row])
        ok = jac >= np.float32(self.job.threshold)
        Metrics.counter(NAMESPACE, "edges").inc(int(ok.sum()))
        yield a[ok], b[ok], jac[ok], ntok[row[ok]]


class ClusterFn(_CacheFn):
    """Every edge (one list) -> ``(chunk, (doc, keeper, jaccard, num_tokens))`` marks (groups.greedy_marks)."""

    def work(self, edges: list):
        if not edges:
            return
        a, b, jac, ntok = (np.concatenate([e[i] for e in edges]) for i in range(4))
        doc, keeper, jj = groups.greedy_marks(a, b, jac)
        order = np.argsort(b, kind="stable")
        tokens = ntok[order][np.searchsorted(b[order], doc)]
        yield from _by_chunk(self.chunk_of(doc), doc, keeper, jj, tokens)


class NearDuplicates(beam.PTransform):
    """PBegin -> marks by chunk of the near-duplicate rule (see the module docstring)."""

    def __init__(self, job: Job, chunks: int):
        super().__init__()
        self.job, self.chunks = job, chunks

    def expand(self, pbegin):
        job = self.job
        sigs = (pbegin
                | "Chunks" >> beam.Create(range(self.chunks), reshuffle=False)
                | "Spread" >> beam.Reshuffle()
                | "Sign" >> beam.ParDo(SignChunkFn(job)))
        pairs = (sigs
                 | "BandKeys" >> beam.ParDo(BandKeysFn(job))
                 | "GroupByBand" >> beam.GroupByKey()
                 | "Candidates" >> beam.ParDo(CandidatesFn(job)))
        halves = ({"sigs": sigs, "pairs": pairs}
                  | "JoinFirst" >> beam.CoGroupByKey()
                  | "AttachFirst" >> beam.ParDo(AttachFirstFn(job)))
        return ({"sigs": sigs, "halves": halves}
                | "JoinSecond" >> beam.CoGroupByKey()
                | "Verify" >> beam.ParDo(VerifyFn(job))
                | "AllEdges" >> beam.combiners.ToList()
                | "Cluster" >> beam.ParDo(ClusterFn(job)))


# --------------------------------------------------------------------------------------------------
# Writing the set


@dataclasses.dataclass(frozen=True)
class FileResult:
    """One chunk's attribute file: its manifest entry (``attrs.CHUNK_FIELDS``) and whether it was kept."""

    chunk: int
    entry: tuple
    kept: bool


class WriteFileFn(_CacheFn):
    """``(chunk, {chunk, marks})`` -> :class:`FileResult`: the chunk's attribute file written atomically,
    or kept if an earlier run left exactly these bytes."""

    def work(self, element):
        c, got = element
        job, table = self.job, self.cache().table
        docs, first = int(table.docs[c]), int(table.doc_offsets[c])
        keeper = np.full(docs, attrs.KEPT, np.int64)
        jac = np.zeros(docs, np.float32)
        marked_tokens = 0
        for doc, kp, jj, ntok in got["marks"]:
            if (keeper[doc - first] != attrs.KEPT).any():
                raise RuntimeError(f"chunk {c}: a document marked twice")
            keeper[doc - first], jac[doc - first] = kp, jj
            marked_tokens += int(ntok.sum())
        data = attrs.file_bytes(job.kind, {"keeper": keeper, "jaccard": jac},
                                attrs.file_meta(job.name, job.kind, job.params_hash, table.checksums[c], docs))
        path = fmt.join(job.cache_url, attrs.file_path(job.name, int(table.shard[c]), int(table.index_in_shard[c])))
        kept = filesystem.read_or_none(path) == data
        if not kept:
            filesystem.write_atomic(path, data)
        Metrics.counter(NAMESPACE, "files_kept" if kept else "files_written").inc()
        yield FileResult(c, (len(data), fmt.checksum(data), int((keeper != attrs.KEPT).sum()), marked_tokens), kept)


class CommitFn(_CacheFn):
    """Every chunk's :class:`FileResult` (one list) -> the manifest, written last; yields its totals."""

    def work(self, results: list):
        job, table = self.job, self.cache().table
        results = sorted(results, key=lambda r: r.chunk)
        if [r.chunk for r in results] != list(range(len(table))):
            raise RuntimeError(f"{len(results)} attribute files for {len(table)} chunks")
        m = attrs.manifest(job.name, job.kind, dict(job.params), table, [r.entry for r in results])
        filesystem.write_atomic(fmt.join(job.cache_url, attrs.manifest_path(job.name)), attrs.manifest_bytes(m))
        yield m["totals"]


class WriteSet(beam.PTransform):
    """Marks by chunk -> the set's totals: every chunk's file, then the manifest (see the module docstring)."""

    def __init__(self, job: Job, chunks: int):
        super().__init__()
        self.job, self.chunks = job, chunks

    def expand(self, marks):
        every = marks.pipeline | "EveryChunk" >> beam.Create([(c, None) for c in range(self.chunks)])
        return ({"chunk": every, "marks": marks}
                | "MarksByChunk" >> beam.CoGroupByKey()
                | "WriteFiles" >> beam.ParDo(WriteFileFn(self.job))
                | "AfterAllFiles" >> beam.combiners.ToList()
                | "Commit" >> beam.ParDo(CommitFn(self.job)))
