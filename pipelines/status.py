"""The files that say how far a build got: ``ledger.json`` (plan, then finished) and ``_FAILED.json``.

The job's last step writes its verdict into the cache: the finished ledger, or (when the build must
stop) ``_FAILED.json`` naming why. A worker that must stop the build (a damaged input, an input that
changed under a finished cache) writes ``_FAILED.json`` too before it raises. The launcher reads that
verdict after the runner returns or raises (:func:`read_outcome`), so it learns the outcome from the
cache itself on every runner, never from the text of a runner's exception. Both are written
atomically; ``_FAILED.json`` is removed before every run and by a finalize that succeeds, so a
finished cache never holds one. A split build has one verdict, ``OUTPUT/_FAILED.json``, and one ledger
per split (``OUTPUT/train``, ``OUTPUT/validation``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from reader.format import spec as fmt
from reader.format.splits import cache_root

from pipelines import filesystem
from pipelines.errors import BuildError
from pipelines.ledger import EmptyInput, TooManyBadRecords

def read_ledger(root: str) -> dict[str, Any] | None:
    """The ledger in ``root`` (validated), None if there is none; a damaged one is a BuildError."""
    path = fmt.join(root, fmt.LEDGER_NAME)
    raw = filesystem.read_or_none(path)
    if raw is None:
        return None
    try:
        return fmt.Ledger.parse(raw, where=path).raw
    except fmt.FormatError as e:
        raise BuildError(f"{e}. Use another --output or delete {path}") from e


def write_ledger(root: str, ledger: dict[str, Any]) -> None:
    filesystem.write_atomic(fmt.join(root, fmt.LEDGER_NAME), fmt.dumps_ledger(ledger).encode())


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """A worker's reason to stop the build (e.g. a damaged input), recorded in ``_FAILED.json``."""

    text: str  # the BuildError's message: names the file and the fix
    kind: str = "build_error"

    ERROR = "build_error"

    def message(self, output: str) -> str:
        return self.text

    def to_json(self) -> dict[str, Any]:
        return {"error": self.ERROR, "kind": self.kind, "message": self.text}


Failure = TooManyBadRecords | EmptyInput | WorkerFailure
_KINDS = {cls.ERROR: cls for cls in (TooManyBadRecords, EmptyInput)}


def write_failure(root: str, failure: Failure) -> None:
    filesystem.write_atomic(fmt.join(root, fmt.FAILED_NAME), fmt.dumps(failure.to_json()).encode())


def parse_failure(obj: dict[str, Any]) -> Failure:
    if obj.get("error") in _KINDS:
        return _KINDS[obj["error"]].from_json(obj)
    return WorkerFailure(text=str(obj.get("message", obj)), kind=str(obj.get("kind", obj.get("error"))))


def clear_failure(root: str) -> None:
    """Forget the verdict of an earlier run (a rerun decides afresh)."""
    filesystem.BEAM.remove(fmt.join(root, fmt.FAILED_NAME))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a job left in its caches: each ledger as it stands, and the failure verdict if it wrote one."""

    ledgers: dict[str | None, dict[str, Any]]  # cache name (None: a plain build) -> ledger ({} if none)
    failure: Failure | None

    @property
    def ledger(self) -> dict[str, Any]:
        """The ledger of a plain build (of the train cache of a split build)."""
        return next(iter(self.ledgers.values()))

    @property
    def finished(self) -> bool:
        return all(led.get("finished") for led in self.ledgers.values())


def _read_json(path: str) -> Any:
    """The JSON in ``path``, None if absent (or half-readable, or the storage unreachable: no verdict)."""
    try:
        raw = filesystem.read_or_none(path)
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001
        return None


def read_outcome(root: str, caches: Sequence[str | None] = (None,)) -> Outcome:
    """The ledgers and the failure verdict of the build into ``root`` whose caches are ``caches``
    (:func:`reader.format.splits.cache_names`); a half-readable file counts as absent."""
    ledgers = {name: _read_json(fmt.join(cache_root(root, name), fmt.LEDGER_NAME)) or {} for name in caches}
    raw_failure = _read_json(fmt.join(root, fmt.FAILED_NAME))
    try:
        failure = parse_failure(raw_failure) if raw_failure else None
    except Exception:  # noqa: BLE001
        failure = None
    return Outcome(ledgers=ledgers, failure=failure)
