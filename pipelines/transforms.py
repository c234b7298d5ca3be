"""The builder's Beam transforms: work units -> chunks on the workers, then one finalize step.

``BuildCache`` is the whole job after planning::

    PlanUnits (Create) -> Spread (Reshuffle) -> BuildChunks (ParDo) -> AfterAllUnits (ToList) -> Finalize

Counters (namespace ``chunkledger``): ``documents``, ``tokens``, ``input_bytes``, ``output_bytes``,
``bad_records`` and ``bad_<reason>``, ``chunks_written``, ``chunks_skipped`` (already complete on a rerun).
"""

from __future__ import annotations

import gc
from typing import Any, Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics

from . import fsutil, status, trace
from .chunk_writer import Counters
from .errors import BuildError
from .ledger import check_bad_fraction, finished_ledger
from .plan import BuildPlan, ChunkConfig, UnitResult, WorkUnit, work_units
from .tokenizer import TokenizerSpec, load_cached
from .units import UnitBuilder

METRICS_NAMESPACE = "chunkledger"

_FROZEN = False


def freeze_long_lived() -> None:
    """Once per process: move every object alive now (Beam, pyarrow, the tokenizer's ranks) to the garbage
    collector's permanent generation.

    They live as long as the worker anyway. Full collections then skip them, and so does the collection at
    interpreter exit, which otherwise walks them all once per process, after the last chunk, when a local
    runner stops its workers one after the other. Only garbage already unreachable at this moment (from
    start-up) is never reclaimed; it is bounded and paid once.
    """
    global _FROZEN
    if not _FROZEN:
        _FROZEN = True
        gc.freeze()


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
    """WorkUnit -> UnitResult: the unit's chunks written, or verified and skipped.

    Args:
      output: the cache root.
      tokenizer: the resolved tokenizer; loaded once per worker process in ``setup``.
      config: the chunking configuration of the plan.
    """

    def __init__(self, output: str, tokenizer: TokenizerSpec, config: ChunkConfig):
        self.output = output
        self.tokenizer = tokenizer
        self.config = config

    def setup(self):
        trace.event("setup_start", proc_start=trace.process_start())
        self.units = UnitBuilder(self.output, load_cached(self.tokenizer), self.config.to_json(),
                                 self.tokenizer.eos_id, _BeamCounters())
        freeze_long_lived()
        trace.event("setup_done")

    def process(self, unit: WorkUnit) -> Iterable[UnitResult]:
        trace.event("unit_start", shard=unit.shard, index=unit.index)
        result = self.units.build(unit)
        if trace.enabled():
            trace.event("unit_done", shard=unit.shard, index=unit.index,
                        tokens=sum(sc["tokens"] for sc in result.sidecars))
        yield result


class FinalizeLedgerFn(beam.DoFn):
    """Every unit's result (one list) -> the job's verdict in the cache, then the ledger's totals.

    Writes the finished ``ledger.json``, or, if too many lines are bad, ``_FAILED.json`` (and fails the
    job, so the runner reports it too). Either file is written atomically.

    Args:
      output: the cache root.
      plan: the build plan.
      max_bad_fraction: the largest share of bad input lines that still finishes the cache.
    """

    def __init__(self, output: str, plan: BuildPlan, max_bad_fraction: float):
        self.output = output
        self.plan = plan
        self.max_bad_fraction = max_bad_fraction

    def process(self, results: list[UnitResult]):
        trace.event("finalize_start")
        ledger = finished_ledger(self.plan, results)
        fsutil.remove_temp_files(self.output)
        failure = check_bad_fraction(ledger, self.max_bad_fraction)
        if failure is not None:
            status.write_failure(self.output, failure)
            raise BuildError(failure.message(self.output))
        status.clear_failure(self.output)
        status.write_ledger(self.output, ledger)
        trace.event("finalize_done")
        yield ledger["totals"]


class BuildCache(beam.PTransform):
    """PBegin -> a PCollection of one totals dict: every work unit built, then the ledger finished.

    Args:
      output: the cache root, holding the plan ledger already.
      plan: the build plan.
      tokenizer: the resolved tokenizer (as workers should load it).
      max_bad_fraction: see :class:`FinalizeLedgerFn`.
    """

    def __init__(self, output: str, plan: BuildPlan, tokenizer: TokenizerSpec, max_bad_fraction: float):
        super().__init__()
        self.output, self.plan, self.tokenizer, self.max_bad_fraction = output, plan, tokenizer, max_bad_fraction

    def expand(self, pbegin):
        return (
            pbegin
            | "PlanUnits" >> beam.Create(work_units(self.plan), reshuffle=False)
            | "Spread" >> beam.Reshuffle()
            | "BuildChunks" >> beam.ParDo(BuildChunksFn(self.output, self.tokenizer, self.plan.config))
            | "AfterAllUnits" >> beam.combiners.ToList()
            | "Finalize" >> beam.ParDo(FinalizeLedgerFn(self.output, self.plan, self.max_bad_fraction))
        )
