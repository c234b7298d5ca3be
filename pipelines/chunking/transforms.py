"""The builder's Beam transforms: work units -> chunks on the workers, then one finalize step.

``BuildCache`` is the whole job after planning::

    PlanRanges (Create: ranges of the unit order) -> PlanUnits (ParDo: each range's units, from the plan ledger) ->
    Spread (Reshuffle) -> BuildChunks (ParDo) -> Done -> AfterAllUnits (CombineGlobally: a count) -> Finalize

or, on the local multi-process runner, ``WorkerSlots`` (one element per worker) instead of the first three: each
worker then takes units from a shared queue until none is left (pipelines/chunking/unit_queue.py). Nothing that
grows with the corpus passes through the job graph or gathers in one element: the plan travels as the path
and checksum of its ledger, and the finalize streams the chunks' entries from the output
(:mod:`pipelines.finalize`). Only transforms every runner supports: Create, ParDo, Reshuffle, a combiner.

Counters (namespace ``chunkledger``): ``documents``, ``tokens``, ``loss_tokens`` (supervised builds),
``input_bytes``, ``output_bytes``, ``bad_records`` and ``bad_<reason>`` (all of chunks written by this run),
``chunks_written`` (built by this run), and for a rerun ``chunks_checked`` (chunks an earlier run left,
checked against their files and input), ``chunks_skipped`` (of those, complete and unchanged),
``chunks_rebuilt`` (the others) and ``chunks_input_changed`` (rebuilt because their input bytes changed).
``input_bytes_done`` counts the uncompressed input bytes of every chunk finished, built or kept: the build's
progress, against the total the launcher's progress line shows (``input_bytes`` counts only what this run
tokenized). A split build adds ``documents_train``, ``tokens_train``, ``documents_validation``,
``tokens_validation`` (``documents`` and ``tokens`` stay the totals; a chunk counts once, though written
into both splits).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from reader.format import spec as fmt
from reader.format.splits import SplitSpec, cache_names, cache_root
from reader.format.table import uses_table
from reader.storage.finish import discard, publish

from pipelines import filesystem, status, trace
from pipelines.chunking.chunk_writer import Counters
from pipelines.chunking.supervised import Supervised
from pipelines.errors import BuildError
from pipelines.finalize import Recorded, draft_table, final_inputs, remove_other_tables
from pipelines.inputs.matching import input_changed
from pipelines.ledger import check_bad_fraction_of, empty_inputs, per_shard
from pipelines.plan import BuildPlan, ChunkConfig, InputFile, UnitList, UnitResult, WorkUnit
from pipelines.plan_ledger import PlanRef, inputs_from_ledger, plan_checksum, read_plan
from pipelines.tokenize.fast_tokenizer import load_cached
from pipelines.tokenize.tokenizer import TokenizerSpec
from pipelines.chunking.unit_queue import ClaimQueue
from pipelines.chunking.units import UnitBuilder

METRICS_NAMESPACE = "chunkledger"


class _BeamCounters(Counters):
    """Chunk writers' counts as Beam metrics (looked up once per name)."""

    def __init__(self):
        self._c: dict[str, Any] = {}
        super().__init__(self._inc)

    def _inc(self, name: str, n: int) -> None:
        if n:
            c = self._c.get(name)
            if c is None:
                c = self._c[name] = Metrics.counter(METRICS_NAMESPACE, name)
            c.inc(n)


def layout_planner(config: ChunkConfig) -> Callable[[InputFile], Any]:
    """A columnar input's layout planned again from its metadata on a worker (layouts are not in the plan
    ledger, and a job graph carrying them would grow with the inputs), checked against the ledger's rows and
    chunks: a file changed since the build was planned is an error. One per input per worker process."""
    from pipelines.inputs import columnar
    from pipelines.inputs.keys import RecordShape

    shape = RecordShape.of(config.to_json())
    memo: dict[int, Any] = {}

    def layout_of(inp: InputFile):
        got = memo.get(inp.shard)
        if got is None:
            got = columnar.plan(inp.path, inp.format, text_key=config.text_key, keep_fields=config.keep_fields,
                                chunk_bytes=config.chunk_bytes, shape=shape)
            if (got.size, got.rows, len(got.chunks)) != (inp.size, inp.rows, inp.chunks):
                raise BuildError(f"input file {inp.path} changed since the build was planned ({inp.size} bytes, "
                                 f"{inp.rows} rows in {inp.chunks} chunks then; {got.size}, {got.rows} in "
                                 f"{len(got.chunks)} now); inputs must not change while a cache is built")
            memo.clear()  # units of one file come together: keep one layout
            memo[inp.shard] = got
        return got

    return layout_of


class PlannedStep(beam.DoFn):
    """A step that needs the plan: it reads the first cache's ledger from the output (checked against the
    checksum the launcher recorded, :class:`pipelines.plan_ledger.PlanRef`) once per worker process, not from the
    job graph.

    Args:
      ref: where the plan is.
      config, split: the plan's parts of a fixed size (the job graph carries them).
    """

    def __init__(self, ref: PlanRef, config: ChunkConfig, split: SplitSpec | None):
        self.ref, self.config, self.split = ref, config, split

    def plan(self) -> BuildPlan:
        got = self.__dict__.get("_plan")
        if got is None:
            name = cache_names(self.split)[0]
            raw = read_plan(cache_root(self.ref.output, name), self.ref.checksum(name))
            got = BuildPlan(tokenizer=raw["tokenizer"], config=self.config, inputs=inputs_from_ledger(raw),
                            trusted=self.ref.trusted_shards(), split=self.split)
            self._plan = got
        return got

    def units(self) -> UnitList:
        got = self.__dict__.get("_units")
        if got is None:
            got = self._units = UnitList(self.plan(), layout_planner(self.config))
        return got


class ExpandUnitsFn(PlannedStep):
    """``(first, end)`` -> units ``[first, end)`` of the plan's order (:class:`pipelines.plan.UnitList`), made on
    the worker from the plan ledger (the job graph holds at most :data:`MAX_ELEMENTS` ranges, not a unit per
    chunk)."""

    def process(self, span: tuple[int, int]) -> Iterable[WorkUnit]:
        units = self.units()
        for i in range(*span):
            yield units.unit(i)


class BuildChunksFn(beam.DoFn):
    """WorkUnit -> UnitResult (one per cache of the build): the unit's chunks written, or verified and skipped,
    and their entries (what the finalize and a reader following the build read).

    A unit that must stop the build (a damaged input; on a finished cache, an input that changed) records
    the reason in ``_FAILED.json`` before it raises, so the launcher reports it on every runner.

    Args:
      output: the build's output (the cache root, or the parent of a split build's caches).
      tokenizer: the resolved tokenizer; loaded once per worker process in ``setup``.
      config: the chunking configuration of the plan.
      finished: the caches (by name: None for a plain build, "train"/"validation") that were finished when
        this run was planned: rebuilt chunks must reproduce the sidecars their ledgers record (a worker
        reads what its own units need: :class:`pipelines.finalize.Recorded`).
      split: the train/validation split of a split build, None for one cache.
    """

    def __init__(self, output: str, tokenizer: TokenizerSpec, config: ChunkConfig,
                 finished: Collection[str | None] = (), split: SplitSpec | None = None):
        self.output = output
        self.tokenizer = tokenizer
        self.config = config
        self.finished = tuple(finished)
        self.split = split

    def setup(self):
        trace.event("setup_start", proc_start=trace.process_start())
        recorded = {name: Recorded(cache_root(self.output, name)) for name in self.finished}
        self.encoder = load_cached(self.tokenizer)
        self.counters = _BeamCounters()
        self.backend_reported = False
        config = self.config.to_json()
        supervised = (Supervised(config, self.encoder, self.tokenizer.eos_id, self.tokenizer.chat_template)
                      if fmt.is_masked(config) else None)
        self.units = UnitBuilder(self.output, self.encoder, config, self.tokenizer.eos_id, self.counters,
                                 recorded=recorded, split=self.split, supervised=supervised)
        trace.event("setup_done")

    def process(self, unit: WorkUnit) -> Iterable[UnitResult]:
        trace.event("unit_start", shard=unit.shard, index=unit.index)
        if not self.backend_reported:  # once per worker (Beam drops counters sent from setup)
            self.backend_reported = True
            self.counters.inc(f"backend_{self.encoder.backend}", 1)
            self.counters.inc("backend_fast_rejected", 1 if self.encoder.fallback_reason else 0)
        try:
            results = self.units.build(unit)
        except BuildError as e:
            try:
                status.write_failure(self.output, status.WorkerFailure(text=str(e), kind=type(e).__name__))
            except Exception:  # noqa: BLE001 - e.g. a full disk: the runner's error still carries the message
                pass
            raise
        # the byte ranges of a unit's chunks: the same in every cache of a split build, so counted once
        rows = unit.columnar.file_rows if unit.columnar is not None else None
        done = sum(fmt.chunk_input_bytes(e, unit.size, rows) for e in results[0].entries)
        self.counters.inc("input_bytes_done", done)
        if trace.enabled():
            trace.event("unit_done", shard=unit.shard, index=unit.index,
                        tokens=sum(e["tokens"] for r in results for e in r.entries))
        yield from results


class BuildQueuedUnitsFn(BuildChunksFn):
    """A worker slot -> the UnitResults of the units this worker claims from the run's shared queue
    (local multi-process runs, see pipelines/chunking/unit_queue.py). Every worker lists the plan's units
    from the plan ledger, in the same order.

    Args:
      ref: where the plan is (:class:`pipelines.plan_ledger.PlanRef`).
      claims: the run's claims directory.
      Others: see :class:`BuildChunksFn`.
    """

    def __init__(self, output: str, tokenizer: TokenizerSpec, config: ChunkConfig, finished: Collection[str | None],
                 split: SplitSpec | None, ref: PlanRef, claims: str):
        super().__init__(output, tokenizer, config, finished, split)
        self.planned = PlannedStep(ref, config, split)
        self.claims = claims

    def process(self, slot: int) -> Iterable[UnitResult]:
        units = self.planned.units()
        for i in ClaimQueue(self.claims, len(units)):
            yield from super().process(units.unit(i))


class FinalizeLedgerFn(beam.DoFn):
    """The number of units built (every unit is done) -> the job's verdict in the output, then each cache's
    totals (:mod:`pipelines.finalize`: each table streamed from the chunks' entries, never all at once).

    Writes each cache's table, then its finished ``ledger.json`` (train, then validation, in a split build),
    or, if too many lines are bad, ``_FAILED.json`` in the output (and fails the job, so the runner reports it
    too). Every file is written atomically. Yields each ledger's totals (with ``"split"`` in a split build).
    A cache that was finished in an older format version is verified by the units and left as it is.

    Also writes ``_FAILED.json`` (and fails) when an input file yields no document, unless ``allow_empty``.
    A ledger is not rewritten when the finished ledger already holds the same bytes (a verified rerun).

    Args:
      output: the build's output (the cache root, or the parent of a split build's caches).
      ref: where the plan ledgers are (:class:`pipelines.plan_ledger.PlanRef`).
      split: the train/validation split of a split build, None for one cache.
      max_bad_fraction: the largest share of bad input lines that still finishes the build.
      allow_empty: accept input files that yield no document.
      started: when the launcher started (Unix time): older temporary files are a crashed run's leftovers.
    """

    def __init__(self, output: str, ref: PlanRef, split: SplitSpec | None, max_bad_fraction: float,
                 allow_empty: bool = False, started: float | None = None):
        self.output = output
        self.ref = ref
        self.split = split
        self.max_bad_fraction = max_bad_fraction
        self.allow_empty = allow_empty
        self.started = started

    def process(self, units: int):
        trace.event("finalize_start")
        names = cache_names(self.split)
        roots = {name: cache_root(self.output, name) for name in names}
        plans = {name: read_plan(roots[name], self.ref.checksum(name)) for name in names}
        for root in dict.fromkeys([self.output, *roots.values()]):
            filesystem.remove_temp_files(root, older_than=self.started)
        inputs = final_inputs(plans[names[0]], roots[names[0]])  # (_DONE.json: the same in every cache)
        # a cache finished in an older version keeps its ledger (its readers' code may not read a newer one)
        kept = {name: plan for name, plan in plans.items() if plan.get("finished") and not uses_table(plan)}
        drafts = {name: draft_table(roots[name], plans[name], inputs) for name in names if name not in kept}
        try:
            ledgers = {name: kept.get(name) or drafts[name].ledger for name in names}
            shard_docs = sum(d.sums.shard_docs for d in drafts.values()) + sum(
                per_shard(plan, "docs") for plan in kept.values())
            shard_bad = sum(d.sums.shard_bad for d in drafts.values()) + sum(
                per_shard(plan, "bad_records") for plan in kept.values())
            failure = (check_bad_fraction_of(list(ledgers.values()), self.max_bad_fraction)
                       or (None if self.allow_empty else empty_inputs(inputs, shard_docs, shard_bad)))
            if failure is not None:
                status.write_failure(self.output, failure)
                raise BuildError(failure.message(roots[names[0]]))
            changed = input_changed(plans[names[0]]["inputs"])  # an input written to while this build read it
            if changed is not None:
                status.write_failure(self.output, status.WorkerFailure(text=changed, kind="InputChanged"))
                raise BuildError(changed)
            status.clear_failure(self.output)
            for draft in drafts.values():  # the tables first: each ledger's rename is the commit
                publish(draft)
        except BaseException:
            for draft in drafts.values():
                discard(draft)
            raise
        for name in drafts:
            text = fmt.dumps_ledger(ledgers[name]).encode()
            if filesystem.read_or_none(fmt.join(roots[name], fmt.LEDGER_NAME)) != text:
                status.write_ledger(roots[name], ledgers[name])
        for name, root in roots.items():
            remove_other_tables(root, (ledgers[name].get("table") or {}).get("path"))
        trace.event("finalize_done")
        for name, ledger in ledgers.items():
            yield ledger["totals"] if name is None else {**ledger["totals"], "split": name}


# The job graph lists at most this many ranges of the unit order (each its own Dask partition: a small build's
# units still spread over the workers); workers make the units.
MAX_ELEMENTS = 1024


def _one(_result) -> int:
    return 1


class BuildCache(beam.PTransform):
    """PBegin -> a PCollection of totals dicts (one per cache): every work unit built, then the ledgers finished.

    The job graph holds no list of units or inputs: it holds ranges of the unit order (each made into its units
    on a worker from the plan ledger) and the plan ledgers' checksums (:class:`pipelines.plan_ledger.PlanRef`), so its
    size does not grow with the corpus.

    Args:
      output: the cache root (the parent of the train and validation caches of a split build), holding the
        plan ledger(s) already.
      plan: the build plan.
      tokenizer: the resolved tokenizer (as workers should load it).
      max_bad_fraction, allow_empty, started: see :class:`FinalizeLedgerFn`.
      finished: see :class:`BuildChunksFn`.
      queue: ``(claims directory, workers)`` for a local multi-process run: each worker gets one slot and
        takes units from a shared queue (see pipelines/chunking/unit_queue.py); None: one element per unit, dealt out
        by the runner.
    """

    def __init__(self, output: str, plan: BuildPlan, tokenizer: TokenizerSpec, max_bad_fraction: float,
                 allow_empty: bool = False, finished: Collection[str | None] = (), started: float | None = None,
                 queue: tuple[str, int] | None = None):
        super().__init__()
        self.output, self.plan, self.tokenizer, self.max_bad_fraction = output, plan, tokenizer, max_bad_fraction
        self.allow_empty, self.finished, self.started, self.queue = allow_empty, finished, started, queue

    def plan_ref(self) -> PlanRef:
        """Where the workers find the plan: the ledgers in the output now (the launcher has written them)."""
        sums = []
        for name in cache_names(self.plan.split):
            got = plan_checksum(cache_root(self.output, name))
            if got is None:
                raise BuildError(f"internal: no plan ledger in {cache_root(self.output, name)}")
            sums.append((name, got))
        n = len(self.plan.inputs)
        return PlanRef(output=self.output, checksums=tuple(sums), trusted=PlanRef.packed(self.plan.trusted, n), shards=n)

    def expand(self, pbegin):
        ref = self.plan_ref()
        config, split = self.plan.config, self.plan.split
        if self.queue is None:
            n = len(UnitList(self.plan))
            cuts = np.linspace(0, n, min(n, MAX_ELEMENTS) + 1).round().astype(int).tolist()
            built = (pbegin
                     | "PlanRanges" >> beam.Create(list(zip(cuts[:-1], cuts[1:])), reshuffle=False)
                     | "PlanUnits" >> beam.ParDo(ExpandUnitsFn(ref, config, split))
                     | "Spread" >> beam.Reshuffle()
                     | "BuildChunks" >> beam.ParDo(BuildChunksFn(self.output, self.tokenizer, config,
                                                                 self.finished, split)))
        else:
            claims, workers = self.queue
            built = (pbegin
                     | "WorkerSlots" >> beam.Create(list(range(workers)), reshuffle=False)
                     | "Spread" >> beam.Reshuffle()
                     | "BuildChunks" >> beam.ParDo(BuildQueuedUnitsFn(self.output, self.tokenizer, config,
                                                                      self.finished, split, ref, claims)))
        return (
            built
            | "Done" >> beam.Map(_one)
            | "AfterAllUnits" >> beam.CombineGlobally(sum)
            | "Finalize" >> beam.ParDo(FinalizeLedgerFn(self.output, ref, split, self.max_bad_fraction,
                                                        self.allow_empty, self.started))
        )
