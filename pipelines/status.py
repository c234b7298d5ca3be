"""The files that say how far a build got: ``ledger.json`` (plan, then finished) and ``_FAILED.json``.

The job's last step writes its verdict into the cache: the finished ledger, or (when the build must
stop) ``_FAILED.json`` naming why. The launcher reads that verdict after the runner returns or raises
(:func:`read_outcome`), so it learns the outcome from the cache itself on every runner, never from the
text of a runner's exception. Both are written atomically; ``_FAILED.json`` is removed before every
run and by a finalize that succeeds, so a finished cache never holds one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from reader import format as fmt

from . import fsutil
from .errors import BuildError
from .ledger import TooManyBadRecords

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


def write_failure(root: str, failure: TooManyBadRecords) -> None:
    fsutil.write_atomic(fmt.join(root, FAILED_NAME), fmt.dumps(failure.to_json()).encode())


def clear_failure(root: str) -> None:
    """Forget the verdict of an earlier run (a rerun decides afresh)."""
    fsutil.delete_if_exists(fmt.join(root, FAILED_NAME))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a job left in its cache: the ledger as it stands, and the failure verdict if it wrote one."""

    ledger: dict[str, Any]  # {} if there is no ledger
    failure: TooManyBadRecords | None

    @property
    def finished(self) -> bool:
        return bool(self.ledger.get("finished"))


def read_outcome(root: str) -> Outcome:
    raw = fsutil.read_bytes_or_none(fmt.join(root, fmt.LEDGER_NAME))
    ledger = json.loads(raw) if raw else {}
    raw_failure = fsutil.read_bytes_or_none(fmt.join(root, FAILED_NAME))
    failure = TooManyBadRecords.from_json(json.loads(raw_failure)) if raw_failure else None
    return Outcome(ledger=ledger, failure=failure)
