"""The builder's Beam transforms: work units -> chunks on the workers, then one finalize step.

``BuildCache`` is the whole job after planning::

    PlanUnits (Create) -> Spread (Reshuffle) -> BuildChunks (ParDo) -> AfterAllUnits (ToList) -> Finalize

or, on the local multi-process runner, ``WorkerSlots`` (one element per worker) instead of ``PlanUnits``: each
worker then takes units from a shared queue until none is left (pipelines/chunking/unit_queue.py).

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

from typing import Any, Collection, Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics

from reader.format import spec as fmt
from reader.format.splits import SplitSpec, cache_root

from pipelines import filesystem, status, trace
from pipelines.chunking.chunk_writer import Counters
from pipelines.chunking.supervised import Supervised
from pipelines.errors import BuildError
from pipelines.inputs.matching import input_changed
from pipelines.ledger import check_bad_fraction_of, check_empty_of, finished_ledger
from pipelines.plan import BuildPlan, ChunkConfig, UnitResult, WorkUnit, work_units
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


class BuildChunksFn(beam.DoFn):
    """WorkUnit -> UnitResult (one per cache of the build): the unit's chunks written, or verified and skipped.

    A unit that must stop the build (a damaged input; on a finished cache, an input that changed) records
    the reason in ``_FAILED.json`` before it raises, so the launcher reports it on every runner.

    Args:
      output: the build's output (the cache root, or the parent of a split build's caches).
      tokenizer: the resolved tokenizer; loaded once per worker process in ``setup``.
      config: the chunking configuration of the plan.
      finished: the caches (by name: None for a plain build, "train"/"validation") that were finished when
        this run was planned: rebuilt chunks must reproduce the sidecars their ledgers record (read once
        per worker in ``setup``).
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
        recorded = {}
        for name in self.finished:
            ledger = status.read_ledger(cache_root(self.output, name)) or {}
            recorded[name] = {(c["shard"], c["index_in_shard"]): c.get("sidecar_checksum")
                              for c in ledger.get("chunks", [])}
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
        done = sum(fmt.chunk_input_bytes(sc, unit.size, rows) for sc in results[0].sidecars)
        self.counters.inc("input_bytes_done", done)
        if trace.enabled():
            trace.event("unit_done", shard=unit.shard, index=unit.index,
                        tokens=sum(sc["tokens"] for r in results for sc in r.sidecars))
        yield from results


class BuildQueuedUnitsFn(BuildChunksFn):
    """A worker slot -> the UnitResults of the units this worker claims from the run's shared queue
    (local multi-process runs, see pipelines/chunking/unit_queue.py).

    Args:
      units: every work unit of the plan, in its order.
      claims: the run's claims directory.
      Others: see :class:`BuildChunksFn`.
    """

    def __init__(self, output: str, tokenizer: TokenizerSpec, config: ChunkConfig, finished: Collection[str | None],
                 split: SplitSpec | None, units: list[WorkUnit], claims: str):
        super().__init__(output, tokenizer, config, finished, split)
        self.all_units = units
        self.claims = claims

    def process(self, slot: int) -> Iterable[UnitResult]:
        for i in ClaimQueue(self.claims, len(self.all_units)):
            yield from super().process(self.all_units[i])


class FinalizeLedgerFn(beam.DoFn):
    """Every unit's result (one list) -> the job's verdict in the output, then each cache's totals.

    Writes the finished ``ledger.json`` of each cache (train, then validation, in a split build), or, if
    too many lines are bad, ``_FAILED.json`` in the output (and fails the job, so the runner reports it
    too). Every file is written atomically. Yields each ledger's totals (with ``"split"`` in a split build).

    Also writes ``_FAILED.json`` (and fails) when an input file yields no document, unless ``allow_empty``.
    A ledger is not rewritten when the finished ledger already holds the same bytes (a verified rerun).

    Args:
      output: the build's output (the cache root, or the parent of a split build's caches).
      plan: the build plan.
      max_bad_fraction: the largest share of bad input lines that still finishes the build.
      allow_empty: accept input files that yield no document.
      started: when the launcher started (Unix time): older temporary files are a crashed run's leftovers.
    """

    def __init__(self, output: str, plan: BuildPlan, max_bad_fraction: float, allow_empty: bool = False,
                 started: float | None = None):
        self.output = output
        self.plan = plan
        self.max_bad_fraction = max_bad_fraction
        self.allow_empty = allow_empty
        self.started = started

    def process(self, results: list[UnitResult]):
        trace.event("finalize_start")
        caches = self.plan.caches()
        roots = {name: cache_root(self.output, name) for name, _ in caches}
        ledgers = {name: finished_ledger(plan, [r for r in results if r.split == name]) for name, plan in caches}
        for root in dict.fromkeys([self.output, *roots.values()]):
            filesystem.remove_temp_files(root, older_than=self.started)
        failure = (check_bad_fraction_of(list(ledgers.values()), self.max_bad_fraction)
                   or check_empty_of(list(ledgers.values()), self.allow_empty))
        if failure is not None:
            status.write_failure(self.output, failure)
            raise BuildError(failure.message(roots[caches[0][0]]))
        changed = input_changed(self.plan.inputs)  # an input written to while this build read it
        if changed is not None:
            status.write_failure(self.output, status.WorkerFailure(text=changed, kind="InputChanged"))
            raise BuildError(changed)
        for name, plan in caches:
            self._check_same_build(roots[name], plan)
        status.clear_failure(self.output)
        for name, ledger in ledgers.items():
            text = fmt.dumps_ledger(ledger).encode()
            if filesystem.read_or_none(fmt.join(roots[name], fmt.LEDGER_NAME)) != text:
                status.write_ledger(roots[name], ledger)
        trace.event("finalize_done")
        for name, ledger in ledgers.items():
            yield ledger["totals"] if name is None else {**ledger["totals"], "split": name}

    @staticmethod
    def _check_same_build(root: str, plan: BuildPlan) -> None:
        """The ledger in the cache is still this build's (guards against another build started meanwhile)."""
        on_disk = status.read_ledger(root)
        if on_disk is None:
            return
        mine = plan.ledger()
        same = (fmt.config_fingerprint(on_disk["tokenizer"], on_disk["config"])
                == fmt.config_fingerprint(mine["tokenizer"], mine["config"])
                and [(i["path"], i["size"]) for i in on_disk["inputs"]]
                == [(i["path"], i["size"]) for i in mine["inputs"]])
        if not same:
            raise BuildError(f"{root}/ledger.json was replaced by another build while this one ran; "
                             "its chunks may be mixed. Delete the output and build again (one build at a time).")


class BuildCache(beam.PTransform):
    """PBegin -> a PCollection of totals dicts (one per cache): every work unit built, then the ledgers finished.

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

    def expand(self, pbegin):
        units = work_units(self.plan)
        if self.queue is None:
            built = (pbegin
                     | "PlanUnits" >> beam.Create(units, reshuffle=False)
                     | "Spread" >> beam.Reshuffle()
                     | "BuildChunks" >> beam.ParDo(BuildChunksFn(self.output, self.tokenizer, self.plan.config,
                                                                 self.finished, self.plan.split)))
        else:
            claims, workers = self.queue
            built = (pbegin
                     | "WorkerSlots" >> beam.Create(list(range(workers)), reshuffle=False)
                     | "Spread" >> beam.Reshuffle()
                     | "BuildChunks" >> beam.ParDo(BuildQueuedUnitsFn(self.output, self.tokenizer, self.plan.config,
                                                                      self.finished, self.plan.split, units, claims)))
        return (
            built
            | "AfterAllUnits" >> beam.combiners.ToList()
            | "Finalize" >> beam.ParDo(FinalizeLedgerFn(self.output, self.plan, self.max_bad_fraction,
                                                        self.allow_empty, self.started))
        )
