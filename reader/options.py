"""``ReadOptions``: how to turn a cache into batches (nothing here is baked into the cache)."""

from __future__ import annotations

import dataclasses
from typing import Any

from reader.format.spec import TABLE_VERSION
from reader.order.packing import WINDOW_TOKENS
from reader.order.passes import PASS_RULES
from reader.order.shuffle import ShuffleConfig
from reader.storage.view_syntax import parse_view

LAYOUTS = ("arrays", "flat")  # how a batch's tokens are laid out: reader.batch.schema defines each
# How documents become rows: windows of the stream, best-fit rows of a chunk, or one document piece per row.
PACKINGS = ("concat", "best_fit", "unpacked")
# Continuation pieces a best-fit row may hold by default (ReadOptions.best_fit_continuations) in caches of
# format version 4 and later: as little padding as plain best-fit decreasing, give or take a few hundredths
# of a percent, on long documents (docs/FORMAT.md, "Best-fit packing"); older caches keep one per row.
CONTINUATIONS = 4


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How to turn a cache into batches. Nothing here is baked into the cache.

    Attributes:
      seq_len: tokens per example (L).
      batch_size: examples per GLOBAL batch (B); must be a multiple of the number of readers.
      packing: how documents become rows: ``"concat"`` (default): a stream's documents concatenated and
        cut every L tokens; ``"best_fit"``: each chunk's documents packed into rows by best-fit
        decreasing, no document of at most L tokens cut (docs/FORMAT.md, "Best-fit packing"); a chunk's
        rows are then its examples, like unpacked examples; ``"unpacked"``: one document piece per example.
      packed: the older spelling, kept as an alias: ``packed=False`` is ``packing="unpacked"`` (also beside
        ``packing="concat"``, its old default), ``packed=True`` (without ``packing``) is ``"concat"``; any other
        pair must agree. Read back, it says whether ``packing`` packs (is not ``"unpacked"``).
      drop_long: unpacked and best-fit reads: skip every document longer than ``seq_len`` (it yields no
        example) instead of cutting it into pieces of ``seq_len``; ``Reader.dropped_long`` counts them.
        For supervised data, where a cut conversation would train on a turn without its context.
      best_fit_window_tokens: best fit packs each chunk per window of consecutive whole row groups of
        about this many tokens (docs/FORMAT.md, "Best-fit packing"). Part of the order, like seq_len. A
        reader holds about one window decoded per stream; larger windows pad less (long ``seq_len``
        needs more rows per window: docs/READING.md), smaller ones hold less. Best fit only.
      ideal_readers: R*, the number of streams. Keep it fixed for a run's lifetime (the order depends on
        it). Pick a power of two >= the largest number of reader hosts you expect (hosts R with R | R* or
        R* | R read only their own chunks). Ignored in eval mode (one stream).
      eval_mode: a single pass in global chunk order: no loop, no shuffle; the last batch is padded with
        ``valid == False`` rows and iteration ends.
      shuffle_seed: if set, ``shuffled_example[i] = example[pi(i)]`` with ``pi`` the growing-window
        shuffle (:func:`reader.order.shuffle.shuffle_example_indices`, default sizes, ``lanes = R*``).
        Training only.
      shuffle: a :class:`reader.order.shuffle.ShuffleConfig` for finer control (window sizes ...); overrides
        shuffle_seed.
      memory_budget_bytes: bound on cached chunk bytes + decoded row groups.
      prefetch_batches: batches assembled ahead of the consumer by ``iter_batches`` (on one thread).
      prefetch_threads: background threads that fetch, verify and decode upcoming row groups. 0: the
        assembling thread decodes what it needs when it needs it; the least CPU per batch (planning
        ahead costs more), so the better choice when reader workers supply the parallelism on a local
        cache (``num_workers`` picks it for its workers then).
      index_cache: store the unpacked per-chunk example counts in ``ROOT/index/`` when writable.
      num_workers: 0 (default): batches are assembled in this process (on threads). W > 0: by W reader
        workers, child processes (:mod:`reader.workers.pool`) that each decode and assemble every W-th of
        this reader's rows into shared memory; ``iter_batches`` then returns views of that memory (the
        same values, bit for bit). Use it when one core cannot keep up; the batch size must be a
        multiple of ``num_readers * num_workers``, and ``memory_budget_bytes`` is split between the
        workers. ``Reader.iter_batches`` and ``reader.jax.JaxLoader.iter_batches`` use the workers (the
        loader's workers each serve every W-th of the rows its process's devices hold, so W must
        divide that number of rows); ``rows``/``batch``/``examples`` and ``JaxLoader.global_batch``
        stay in-process.
      layout: ``"arrays"`` (default): the five ``[rows, L]`` arrays of ``reader.batch.schema.BATCH_KEYS``.
        ``"flat"`` (packed only): one ``uint32 [rows, L+1]`` array in seqax's flat-tokens encoding
        plus two per-row ints (``reader.batch.schema.FLAT_KEYS``); about 4x fewer bytes to assemble and to
        send to an accelerator, where :func:`reader.expand_flat` (numpy) or ``reader.jax.expand_flat``
        (jit) rebuilds the five arrays exactly.
      worker_timeout_s: how long a reader may hold work without any progress (no byte range fetched,
        no poll of a running build, nothing assembled) before :class:`reader.ReaderStalled` is raised in
        the training process, naming the worker process (or the slab) that stalled; stuck workers are
        killed. A SIGSTOPped worker or a storage read that never returns then fails the run instead of
        hanging it. Not ``wait_timeout_s`` (a ``Reader`` argument): how long to wait for chunks a
        running build has not written yet; a worker waiting for them polls, which is progress. The
        default, 10 minutes, is far above the longest silence of a healthy reader (one range read with
        the storage client's retries, one listing of a running build, a worker's start-up: seconds to a
        minute or two) and still reports a hang in minutes. ``reader.torch.token_loader`` sets the
        DataLoader's ``timeout`` from it.
      pass_rule: how a training read covers the data (docs/FORMAT.md, "Passes"). ``"spans"``: every pass
        (the first ``E`` examples, then the next ``E``, ..., ``E`` the rows of an eval pass at these options)
        serves every row of the eval pass exactly once, shuffled or not; a read of a cache whose build
        is still running waits for it to finish. ``"streams"``: ``R*`` streams loop over the chunks
        (``loop(all_chunks)[s::R*]``); it follows a running build, but repeats rows within a pass when
        the cache has fewer chunks than ``R*`` or unequal streams. None (default): ``"spans"`` for caches of
        format version 4 and later, ``"streams"`` for older ones, so their batches never change. Eval
        reads are the same under both.
      best_fit_continuations: best fit: the continuation pieces (tails of documents longer than
        ``seq_len``) one row may hold. None (default): :data:`CONTINUATIONS` (4) for a cache of format
        version 4 or later, 1 (the rule such caches were first read with) for older ones, so an older
        cache keeps serving its rows. Part of the order, like ``seq_len``. More pack tighter on long
        documents; the flat layout carries that many minus one per row (``continuation_*`` fields).
      max_segments: at most this many document pieces (segments) per row; None: no cap. Best fit packs
        within it, an unpacked row always holds one; concat windows cut the stream every ``seq_len``
        tokens whatever they hold, so a concat read refuses it. Part of the order of a best-fit read.
      varlen: add ``cu_seqlens`` ``[rows, max_segments + 1]`` and ``max_seqlen`` ``[rows]`` to every batch,
        the rows' document pieces in the form varlen attention kernels take (``reader.batch.schema``);
        needs ``max_segments`` (the static width).
      view: which documents the read keeps (docs/CURATION.md, "Views"): a string such as ``"not
        exact_duplicate and language_score >= 0.9"``, or a list of such clauses (all must hold). None
        (default): every document. The read then sees the same chunks with only the kept documents, in
        every layout, packing, pass rule and mixture; a view of kept fields follows a running build, one
        of duplicate marks needs the finished cache and its marks (``python -m pipelines.dedup``).
    """

    seq_len: int = 2048
    batch_size: int = 64
    packed: bool | None = None
    packing: str | None = None
    drop_long: bool = False
    best_fit_window_tokens: int = WINDOW_TOKENS
    ideal_readers: int = 16
    eval_mode: bool = False
    shuffle_seed: int | None = None
    shuffle: Any = None
    memory_budget_bytes: int = 1 << 30
    prefetch_batches: int = 2
    prefetch_threads: int = 2
    index_cache: bool = True
    layout: str = "arrays"
    num_workers: int = 0
    worker_timeout_s: float = 600.0
    pass_rule: str | None = None
    best_fit_continuations: int | None = None
    max_segments: int | None = None
    varlen: bool = False
    view: Any = None

    def __post_init__(self):
        packing, packed = self.packing, self.packed
        if packed is not None and not packed and packing in (None, "concat"):
            # (beside packed=False, packing="concat" was the default: dataclasses.replace(opts, packed=False) passes it)
            packing = "unpacked"
        packing = packing or "concat"
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        if packed is not None and bool(packed) != (packing != "unpacked"):
            raise ValueError(f"packing={packing!r} and packed={packed!r} disagree (packed=False is the older "
                             "spelling of packing='unpacked'): drop packed")
        # (normalized, so that equal reads compare equal: ReadOptions(packed=False) == ReadOptions(packing="unpacked"))
        object.__setattr__(self, "packing", packing)
        object.__setattr__(self, "packed", packing != "unpacked")
        if self.drop_long and self.packing == "concat":
            raise ValueError("drop_long skips documents longer than seq_len in unpacked and best-fit reads; "
                             "concat windows cut documents anywhere. Use packing='best_fit' or packing='unpacked' "
                             "with it.")
        if isinstance(self.best_fit_window_tokens, bool) or not isinstance(self.best_fit_window_tokens, int) \
                or self.best_fit_window_tokens < 1:
            raise ValueError(f"best_fit_window_tokens must be an integer >= 1, got {self.best_fit_window_tokens!r}")
        if self.best_fit_window_tokens != WINDOW_TOKENS and self.packing != "best_fit":
            raise ValueError(f"best_fit_window_tokens={self.best_fit_window_tokens} applies to packing='best_fit' "
                             f"only (this read is {self.packing!r}). Drop it or set packing='best_fit'.")
        for name in ("best_fit_continuations", "max_segments"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {v!r}")
        if self.best_fit_continuations is not None and self.packing != "best_fit":
            raise ValueError(f"best_fit_continuations={self.best_fit_continuations} applies to packing='best_fit' "
                             f"only (this read is {self.packing!r}). Drop it or set packing='best_fit'.")
        if self.max_segments is not None and self.packing == "concat":
            raise ValueError(f"max_segments={self.max_segments}: concat rows cut the stream every seq_len tokens "
                             "whatever documents they hold, so they cannot keep to a cap. Use packing='best_fit' "
                             "(it packs within the cap) or packing='unpacked' (one piece per row), or drop max_segments.")
        if self.varlen and self.max_segments is None:
            raise ValueError("varlen=True writes cu_seqlens with max_segments + 1 entries per row (a static "
                             "shape): set max_segments too, e.g. ReadOptions(packing='best_fit', "
                             "max_segments=64, varlen=True)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "flat" and self.packing == "unpacked":
            raise ValueError("layout='flat' encodes packed windows (document starts as a bit per token); "
                             "unpacked examples use layout='arrays'")
        if self.prefetch_threads < 0:
            raise ValueError(f"prefetch_threads must be >= 0, got {self.prefetch_threads}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0 seconds, got {self.worker_timeout_s}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.ideal_readers < 1:
            raise ValueError(f"ideal_readers must be >= 1, got {self.ideal_readers}")
        if self.pass_rule is not None and self.pass_rule not in PASS_RULES:
            raise ValueError(f"pass_rule must be one of {PASS_RULES} or None (by the cache's format version), "
                             f"got {self.pass_rule!r}")
        parse_view(self.view)  # (a syntax error is raised here, naming the clause)
        if isinstance(self.view, list):  # (options stay hashable)
            object.__setattr__(self, "view", tuple(self.view))
        if self.eval_mode and (self.shuffle_seed is not None or self.shuffle is not None):
            raise ValueError("eval_mode reads every document once in global order; it never shuffles. "
                             "Drop shuffle_seed/shuffle or eval_mode.")

    def pass_rule_for(self, format_version: int) -> str:
        """The pass rule of a read of a cache of ``format_version``: ``pass_rule``, or by the version."""
        if self.pass_rule is not None:
            return self.pass_rule
        return "spans" if format_version >= TABLE_VERSION else "streams"
    def continuations(self, format_version: int) -> int:
        """Continuation pieces a best-fit row of a cache of ``format_version`` holds at most: the
        ``best_fit_continuations`` option resolved (None: by the version), within ``max_segments``."""
        c = self.best_fit_continuations
        if c is None:
            c = CONTINUATIONS if format_version >= TABLE_VERSION else 1
        return c if self.max_segments is None else min(c, self.max_segments)

    def continuation_slots(self, format_versions) -> int:
        """Columns of the flat layout's ``continuation_*`` fields for caches of ``format_versions`` (a
        mixture's components): the continuation pieces a best-fit row may hold past column 0."""
        if self.packing != "best_fit":
            return 0
        return max((self.continuations(v) for v in format_versions), default=1) - 1

    @property
    def varlen_segments(self) -> int | None:
        """``max_segments`` when the batches carry varlen fields, else None."""
        return self.max_segments if self.varlen else None

    @property
    def effective_ideal_readers(self) -> int:
        """R* as the order uses it: ``ideal_readers``, or 1 in eval mode (one stream, one span)."""
        return 1 if self.eval_mode else self.ideal_readers

    @property
    def num_streams(self) -> int:
        """The older name of :attr:`effective_ideal_readers`, kept as an alias."""
        return self.effective_ideal_readers

    def shuffle_config(self) -> ShuffleConfig | None:
        """The shuffle config, or None when not shuffling."""
        if self.shuffle is not None:
            return self.shuffle
        if self.shuffle_seed is None:
            return None
        # lanes = R*: every example stays in its stream, so hosts keep reading only their own chunks.
        return ShuffleConfig(seed=int(self.shuffle_seed), lanes=self.effective_ideal_readers)
