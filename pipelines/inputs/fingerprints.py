"""What each input file was when the build was planned, checked again before its ledger is finished: an input
changed while a cache is built is an error naming it, whatever its size (content is also checked chunk by
chunk, ``input_checksum``, but only a rerun compares that).

A fingerprint is a file's metadata, one ``stat`` or one listing away: locally its size, ``mtime_ns``,
``ctime_ns`` (which no one can set back), device and inode; on Cloud Storage its size, generation (any write
makes a new one) and CRC32C. It is recorded in the plan ledger's ``inputs`` (``fingerprint``), never in a
finished ledger, which stays a function of the inputs' content. Memory: one small dict per input.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from reader.storage import files

from pipelines.errors import BuildError
from pipelines.inputs import remote


def of(paths: Iterable[str], patterns: Iterable[str] = (),
       objects: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``path -> fingerprint`` of input files (gs:// ones from ``objects``, :func:`remote.objects_of`, or a
    listing of the ``patterns``' prefixes, or of the paths' common prefix in each bucket)."""
    paths = list(paths)
    gs = [p for p in paths if p.startswith("gs://")]
    if gs and objects is None:
        objects = remote.objects_of(gs, list(patterns) or _prefixes(gs))
    out = {}
    for p in paths:
        if p.startswith("gs://"):
            o = (objects or {}).get(p)
            if o is not None:
                out[p] = {k: o[k] for k in ("size", "generation", "crc32c")}
        elif "://" not in p:
            out[p] = files.fingerprint(files.local(), p)
    return out


def _prefixes(urls: Sequence[str]) -> list[str]:
    """One listing prefix per bucket: the longest common prefix of its objects' names."""
    import os

    by_bucket: dict[str, list[str]] = {}
    for u in urls:
        bucket, key = remote.split_url(u)
        by_bucket.setdefault(bucket, []).append(key)
    return [f"gs://{b}/{os.path.commonprefix(keys)}" for b, keys in sorted(by_bucket.items())]


def changed(inputs: Sequence[Any]) -> str | None:
    """The error for the first input (an :class:`~pipelines.plan.InputFile` with its planned ``fingerprint``)
    whose fingerprint differs now, or None if none does (or none was recorded)."""
    planned = {i.path: i.fingerprint for i in inputs if i.fingerprint is not None}
    if not planned:
        return None
    now = of(planned)
    for path, then in planned.items():
        got = now.get(path)
        if got != then:
            what = "it is gone" if got is None else "; ".join(
                f"{k} {then.get(k)} then, {got.get(k)} now" for k in sorted(set(then) | set(got)) if then.get(k) != got.get(k))
            return (f"input file {path} changed while the cache was built ({what}), so the cache would hold parts "
                    "of more than one version of it and is not finished. Leave the file as it is and rerun the same "
                    "command: the chunks built from another version are found by their input checksums and rebuilt")
    return None


def check_unchanged(inputs: Sequence[Any]) -> None:
    """Raise BuildError (:func:`changed`'s message) if an input changed since it was planned."""
    problem = changed(inputs)
    if problem is not None:
        raise BuildError(problem)
