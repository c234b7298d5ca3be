"""The finished ledger and the bad-record verdict: pure functions of the plan and the work units' results."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

from reader.format import spec as fmt
from reader.format.sidecar import finish_ledger
from reader.order.streams import round_robin_order

from pipelines.errors import BuildError
from pipelines.plan import BuildPlan, UnitResult


def finished_ledger(plan: BuildPlan, results: Iterable[UnitResult]) -> dict[str, Any]:
    """The final ledger (``finished`` true) from the plan and every work unit's result.

    Any arrival order of ``results`` gives the same ledger. Raises BuildError if a chunk or a compressed
    shard's chunk count is missing.
    """
    sidecars: dict[tuple[int, int], dict[str, Any]] = {}
    done: dict[int, dict[str, int]] = {}
    for r in results:
        for sc in r.sidecars:
            sidecars[(sc["shard"], sc["index_in_shard"])] = sc
        if r.done is not None:
            done[r.shard] = r.done
    inputs = []
    version = plan.format_version
    for planned in plan.inputs:
        inp = planned.to_json(version)
        if planned.compression == "none":
            inp["uncompressed_bytes"] = planned.size
        else:
            d = done.get(planned.shard)
            if d is None:
                raise BuildError(f"internal: compressed shard {planned.path} was not completed")
            inp["chunks"] = d["chunks"]
            inp["uncompressed_bytes"] = d["uncompressed_bytes"]
        inputs.append(inp)
    order = round_robin_order([inp["chunks"] for inp in inputs])
    missing = [(s, k) for s, k in order.tolist() if (s, k) not in sidecars]
    if missing:
        raise BuildError(f"internal: chunk {fmt.chunk_path(*missing[0])} is missing after the build")
    return finish_ledger(plan.ledger(), inputs, (sidecars[(s, k)] for s, k in order.tolist()))


@dataclasses.dataclass(frozen=True)
class TooManyBadRecords:
    """The verdict of a build whose bad lines exceed ``--max_bad_fraction`` (recorded in ``_FAILED.json``)."""

    bad_records: int
    lines: int  # input lines: documents plus bad records
    max_bad_fraction: float
    reasons: dict[str, int]  # reason -> count, as the ledger's bad_records

    ERROR = "too_many_bad_records"

    def message(self, output: str) -> str:
        """The error the user sees: the counts, where the bad lines are (``output/bad/``: pass the cache that
        keeps the dead letters, the train cache of a split build), and the two ways on."""
        bad, lines = self.bad_records, self.lines
        reasons = ", ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return (
            f"too many bad records: {bad} of {lines} input lines ({bad / lines:.4%}) are bad, above "
            f"--max_bad_fraction={self.max_bad_fraction} ({reasons}). They are kept with their reasons under "
            f"{fmt.join(output, fmt.BAD_DIR)}/. Fix the input, or rerun the same command with a higher "
            "--max_bad_fraction: completed chunks are kept and the build just finalizes.")

    def to_json(self) -> dict[str, Any]:
        return {"error": self.ERROR, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "TooManyBadRecords":
        return cls(bad_records=int(obj["bad_records"]), lines=int(obj["lines"]),
                   max_bad_fraction=float(obj["max_bad_fraction"]), reasons=dict(obj["reasons"]))


def check_bad_fraction(ledger: Mapping[str, Any], max_bad_fraction: float) -> TooManyBadRecords | None:
    """None if the finished ``ledger``'s share of bad lines is within ``max_bad_fraction``, else the verdict."""
    return check_bad_fraction_of([ledger], max_bad_fraction)


def check_bad_fraction_of(ledgers: Sequence[Mapping[str, Any]], max_bad_fraction: float) -> TooManyBadRecords | None:
    """:func:`check_bad_fraction` over every cache of one build (a split build's train and validation).

    The input lines are all caches' documents plus their bad records; a split build keeps its bad records
    in the train cache only, so each bad line counts once.
    """
    bad = sum(led["totals"]["bad_records"] for led in ledgers)
    lines = bad + sum(led["totals"]["docs"] for led in ledgers)
    reasons: dict[str, int] = {}
    for led in ledgers:
        for reason, n in led["bad_records"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    if lines and bad / lines > max_bad_fraction:
        return TooManyBadRecords(bad_records=bad, lines=lines, max_bad_fraction=max_bad_fraction,
                                 reasons=dict(sorted(reasons.items())))
    return None


@dataclasses.dataclass(frozen=True)
class EmptyInput:
    """The verdict of a build with input files that yield no document (recorded in ``_FAILED.json``).

    An empty file, or one whose every line is bad, is most often a mistake (a glob matching the wrong
    files, a failed export); ``--allow_empty`` accepts it.
    """

    files: tuple[tuple[str, int, int], ...]  # (path, uncompressed bytes, bad lines) of each such file

    ERROR = "empty_input"

    def message(self, output: str) -> str:
        shown = "; ".join(f"{p} ({n} bytes, {bad} bad lines)" for p, n, bad in self.files[:5])
        more = f" and {len(self.files) - 5} more" if len(self.files) > 5 else ""
        return (f"{len(self.files)} input file(s) yield no document: {shown}{more}. Leave them out of --input, "
                "or rerun the same command with --allow_empty to build without them (completed chunks are kept).")

    def to_json(self) -> dict[str, Any]:
        return {"error": self.ERROR, "files": [list(f) for f in self.files]}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "EmptyInput":
        return cls(files=tuple((str(p), int(n), int(b)) for p, n, b in obj["files"]))


def check_empty_of(ledgers: Sequence[Mapping[str, Any]], allow_empty: bool) -> EmptyInput | None:
    """None if every input file yields a document in some cache of the build (or ``allow_empty``), else the
    verdict: a file whose documents all went to one split of a split build is not empty."""
    if allow_empty:
        return None
    docs: dict[int, int] = {}
    bad: dict[int, int] = {}
    for c in (c for led in ledgers for c in led["chunks"]):
        docs[c["shard"]] = docs.get(c["shard"], 0) + c["docs"]
        bad[c["shard"]] = bad.get(c["shard"], 0) + c["bad_records"]
    empty = tuple((inp["path"], int(inp["uncompressed_bytes"]), bad.get(inp["shard"], 0))
                  for inp in ledgers[0]["inputs"] if not docs.get(inp["shard"]))
    return EmptyInput(files=empty) if empty else None
