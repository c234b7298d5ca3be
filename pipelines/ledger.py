"""The verdicts a build's finalize reaches (too many bad records, empty inputs): pure functions of what the
chunks add up to (:mod:`pipelines.finalize` writes the finished ledgers)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from reader.format import spec as fmt


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


def check_bad_fraction_of(ledgers: Sequence[Mapping[str, Any]], max_bad_fraction: float) -> TooManyBadRecords | None:
    """None if the finished ``ledgers``' share of bad lines is within ``max_bad_fraction``, else the verdict:
    over every cache of one build (a split build's train and validation).

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


def per_shard(ledger: Mapping[str, Any], key: str) -> np.ndarray:
    """``key`` (``docs`` or ``bad_records``) summed per input over the chunk list of a ledger written before the
    chunk table (a cache finished in an older version)."""
    out = np.zeros(len(ledger["inputs"]), np.int64)
    for c in ledger.get("chunks", []):
        out[c["shard"]] += c[key]
    return out


def empty_inputs(inputs: Sequence[Mapping[str, Any]], docs: np.ndarray, bad: np.ndarray) -> EmptyInput | None:
    """None if every input yields a document (``docs``: per input, summed over every cache of the build: a file
    whose documents all went to one split of a split build is not empty), else the verdict (``bad``: the bad
    records per input)."""
    empty = tuple((inp["path"], int(inp["uncompressed_bytes"]), int(bad[i]))
                  for i, inp in enumerate(inputs) if not docs[i])
    return EmptyInput(files=empty) if empty else None
