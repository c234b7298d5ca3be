"""The files that say how far a build got: ``ledger.json`` (plan, then finished) and ``_FAILED.json``.

The job's last step writes its verdict into the cache: the finished ledger, or (when the build must
stop) ``_FAILED.json`` naming why. A worker that must stop the build (a damaged input, an input that
changed under a finished cache) writes ``_FAILED.json`` too before it raises. The launcher reads that
verdict after the runner returns or raises (:func:`read_outcome`), so it learns the outcome from the
cache itself on every runner, never from the text of a runner's exception. Both are written
atomically; ``_FAILED.json`` is removed before every run and by a finalize that succeeds, so a
finished cache never holds one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from reader import format as fmt

from . import fsutil
from .errors import BuildError
from .ledger import EmptyInput, TooManyBadRecords

FAILED_NAME = "_FAILED.json"


def read_ledger(root: str) -> dict[str, Any] | None:
    """The ledger in ``root`` (validated), None if there is none; a damaged one is a BuildError."""
    path = fmt.join(root, fmt.LEDGER_NAME)
    raw = fsutil.read_bytes_or_none(path)
    if raw is None:
        return None
    try:
        return fmt.Ledger.parse(raw, where=path).raw
    except fmt.FormatError as e:
        raise BuildError(f"{e}. Use another --output or delete {path}") from e


def write_ledger(root: str, ledger: dict[str, Any]) -> None:
    fsutil.write_atomic(fmt.join(root, fmt.LEDGER_NAME), fmt.dumps_ledger(ledger).encode())


@dataclasses.dataclass(frozen=True)
class WorkerError:
    """A worker's reason to stop the build (e.g. a damaged input), recorded in ``_FAILED.json``."""

    text: str  # the BuildError's message: names the file and the fix
    kind: str = "build_error"

    ERROR = "build_error"

    def message(self, output: str) -> str:
        return self.text

    def to_json(self) -> dict[str, Any]:
        return {"error": self.ERROR, "kind": self.kind, "message": self.text}


Failure = TooManyBadRecords | EmptyInput | WorkerError
_KINDS = {cls.ERROR: cls for cls in (TooManyBadRecords, EmptyInput)}


def write_failure(root: str, failure: Failure) -> None:
    fsutil.write_atomic(fmt.join(root, FAILED_NAME), fmt.dumps(failure.to_json()).encode())


def parse_failure(obj: dict[str, Any]) -> Failure:
    if obj.get("error") in _KINDS:
        return _KINDS[obj["error"]].from_json(obj)
    return WorkerError(text=str(obj.get("message", obj)), kind=str(obj.get("kind", obj.get("error"))))


def clear_failure(root: str) -> None:
    """Forget the verdict of an earlier run (a rerun decides afresh)."""
    fsutil.delete_if_exists(fmt.join(root, FAILED_NAME))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a job left in its cache: the ledger as it stands, and the failure verdict if it wrote one."""

    ledger: dict[str, Any]  # {} if there is no ledger
    failure: Failure | None

    @property
    def finished(self) -> bool:
        return bool(self.ledger.get("finished"))


def read_outcome(root: str) -> Outcome:
    """The ledger and the failure verdict in ``root`` (a half-readable file counts as absent)."""
    try:
        raw = fsutil.read_bytes_or_none(fmt.join(root, fmt.LEDGER_NAME))
        ledger = json.loads(raw) if raw else {}
    except Exception:  # noqa: BLE001 - the cache may be unreachable: then there is no verdict to read
        ledger = {}
    try:
        raw_failure = fsutil.read_bytes_or_none(fmt.join(root, FAILED_NAME))
        failure = parse_failure(json.loads(raw_failure)) if raw_failure else None
    except Exception:  # noqa: BLE001
        failure = None
    return Outcome(ledger=ledger, failure=failure)
