"""``--input`` patterns -> the input files, each checked before the build: matched, of an accepted format,
and (Parquet, Arrow) planned from its metadata.

:func:`match_inputs` lists the patterns (local paths as Beam matches them, ``gs://`` through Beam's
FileSystems; a ``datasets`` ``save_to_disk`` directory stands for its ``.arrow`` files), refuses what is not
a regular file, and checks each file's bytes against its name (:func:`pipelines.inputs.formats.detect`).
:func:`plan_inputs` plans each columnar file's chunks (:func:`pipelines.inputs.columnar.plan`) and checks
the text key on each JSON file's first records. Files are checked in parallel: on gs:// each is a round trip.

What each input was when matched is recorded too (:func:`fingerprints_of`: locally its size, ``mtime_ns``,
``ctime_ns`` (which no one can set back), device and inode; on Cloud Storage its size, generation and
CRC32C), in the plan ledger's ``inputs`` only (a finished ledger stays a function of the content), and
checked again before the ledger is finished (:func:`input_changed`, which the finalize calls): an input
changed while its cache is built is an error naming it, whatever its size. One small dict per input.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import os
import re
import stat
from typing import Any, Iterable, Mapping, Sequence

from apache_beam.io.filesystem import FileSystem

from reader.format import spec as fmt
from reader.storage import files

from pipelines.errors import BuildError
from pipelines.filesystem import BEAM, absolute, is_remote
from pipelines.inputs import columnar, formats, gcs_check, keys
from pipelines.inputs.decompress import open_input
from pipelines.inputs.ranges import fingerprint
from pipelines.plan import ChunkConfig, MatchedFile

LOG = logging.getLogger("chunkledger.build")
READ_CHECK_THREADS = 16  # input files are checked in parallel: on gs:// each check is a round trip


def _same_local_file(paths: Sequence[str]) -> dict[str, str]:
    """``alias -> kept path`` for local paths naming one file (symlinks, hard links): the first in path order."""
    kept: dict[tuple[int, int], str] = {}
    aliases = {}
    for path in sorted(paths):
        if is_remote(path):
            continue
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in kept:
            aliases[path] = kept[key]
        else:
            kept[key] = path
    return aliases


def _match_local(pattern: str, given: str) -> list[tuple[str, int]]:
    """``(path, size)`` of the local paths matching ``pattern``, as Beam matches them (``*`` within a
    directory, ``**`` across; symlinked directories not followed), each checked to be a regular file or a
    symlink to one, or a directory (the caller's message). Beam's own listing drops a broken or looping
    symlink silently, and opening a FIFO blocks forever: those, sockets and devices are refused here,
    before anything is opened."""
    if pattern.endswith("/"):
        pattern += "*"
    prefix = re.match(r"^[^[*?]*", pattern).group(0)
    if prefix == pattern:
        paths = [pattern] if os.path.lexists(pattern) else []
    else:
        regex = re.compile(FileSystem.translate_pattern(pattern))
        paths = [p for d, _, names in os.walk(os.path.dirname(prefix)) for p in (os.path.join(d, n) for n in names)
                 if regex.match(p)]
    out = []
    for path in sorted(paths):
        try:
            st = os.stat(path)
        except OSError as e:
            if not os.path.islink(path):
                raise BuildError(f"input {path} cannot be read ({e.strerror}); fix its permissions or leave it out of "
                                 f"--input {given!r}") from e
            what = "a symlink in a loop" if e.errno == errno.ELOOP else f"a broken symlink (to {os.readlink(path)})"
            raise _not_an_input(path, what, given) from e
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
            out.append((path, st.st_size))
            continue
        kind = files.kind_of(st.st_mode)
        if os.path.islink(path):
            kind += f" (through the symlink to {os.path.realpath(path)})"
        raise _not_an_input(path, kind, given)
    return out


def _not_an_input(path: str, what: str, given: str) -> BuildError:
    return BuildError(f"--input {given!r} matches {path}, {what}: only regular files (or symlinks to them) and "
                      "gs:// objects are inputs; remove it, or narrow the pattern")


def _saved_dataset(pattern: str, given: str) -> list[tuple[str, int]] | None:
    """``(path, size)`` of the ``.arrow`` files of a ``datasets`` ``save_to_disk`` directory named by
    ``pattern`` (no wildcard), in ``state.json`` order; None if it names no such directory."""
    if re.search(r"[*?\[]", pattern):
        return None
    try:
        paths = formats.saved_dataset_files(pattern)
    except formats.UnsupportedInput as e:
        raise BuildError(str(e)) from e
    except Exception:  # noqa: BLE001 - not a directory we can list: matched as a pattern below, which says why
        return None
    if paths is None:
        return None
    if paths != sorted(paths):  # shards follow path order; datasets' own names sort in their order
        raise BuildError(f"--input {given!r}: its state.json lists its .arrow files out of name order, and "
                         "shards follow the order of their names; pass the files as --input in the order wanted")
    if is_remote(pattern):
        sizes = {e.path: e.size for p in paths for e in BEAM.match(p)}
        return [(p, sizes[p]) for p in paths]
    return [(p, files.regular_size(p, root=pattern)) for p in paths]


def match_inputs(patterns: Sequence[str]) -> list[MatchedFile]:
    """Every matched input file, sorted by path, each checked readable and of its format; one shard per file.

    A ``datasets`` ``save_to_disk`` directory stands for its ``.arrow`` files. A path matched by several
    patterns, or a local file reached through several names (a symlink, a hard link), is one shard (a warning
    names the others). Fails (BuildError) naming the pattern that matches no file, or the file that cannot be
    read, is of no accepted format or whose bytes contradict its name (:func:`pipelines.inputs.formats.detect`).
    Parquet and Arrow files have no layout yet: :func:`plan_inputs` plans them.
    """
    found: dict[str, int] = {}
    origin: dict[str, str] = {}  # path -> the first --input that matched it
    for pat in patterns:
        full = absolute(pat)
        saved = _saved_dataset(full, pat)
        if saved is not None:
            res = saved
        elif is_remote(full):
            try:
                res = [(e.path, e.size) for e in BEAM.match(full)]
            except Exception as e:  # BeamIOError for unreadable buckets, bad patterns
                raise BuildError(f"--input {pat!r}: cannot list files ({e})") from e
        else:
            res = _match_local(full, pat)
        dirs = [m for m in res if m[0].endswith("/") or (not is_remote(m[0]) and os.path.isdir(m[0]))]
        files = [m for m in res if m not in dirs]
        if not files:
            if dirs:
                raise BuildError(f"--input {pat!r} is a directory, not a file: give a pattern for its files, "
                                 f"quoted so that the builder expands it: --input '{pat.rstrip('/')}/*.jsonl' "
                                 "(a directory written by datasets' save_to_disk is taken as it is)")
            where = "" if is_remote(full) else f" (relative paths start at {os.getcwd()})"
            raise BuildError(f"--input {pat!r} matches no file; check the path{where}")
        for path, size in files:
            if path in found:
                LOG.warning("input file %s is matched by more than one --input; it is read once", path)
            found[path] = size
            origin.setdefault(path, pat)
    for alias, kept in _same_local_file(list(found)).items():
        LOG.warning("input %s is the same file as %s (a link); it is read once, as %s", alias, kept, kept)
        del found[alias]
    paths = sorted(found)
    _refuse_unknown_names(paths, origin)

    def check(path: str) -> formats.InputFormat | str:
        try:
            return formats.detect(path)
        except BuildError as e:  # UnsupportedInput, DamagedFile
            return str(e)
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            return _unreadable(path, e)

    with concurrent.futures.ThreadPoolExecutor(max_workers=READ_CHECK_THREADS) as pool:
        kinds = list(pool.map(check, paths))
    _raise_first_problem(kinds)
    where = [absolute(p) for p in patterns]
    objects = gcs_check.objects_of(paths, where)
    crc = gcs_check.crc32c_of(paths, where, objects)
    stamps = fingerprints_of(paths, where, objects)  # checked again before the ledger is finished
    return [MatchedFile(path=p, size=found[p], crc32c=crc.get(p), format=k.kind, fingerprint=stamps.get(p))
            for p, k in zip(paths, kinds)]


def _refuse_unknown_names(paths: Sequence[str], origin: dict[str, str], shown: int = 10) -> None:
    """Name every matched file of no accepted format (by its name) at once, with the patterns that leave them
    out: a directory of mixed files is fixed in one run."""
    unknown = [p for p in paths if formats.unknown_name(p)]
    if not unknown:
        return
    globs = []  # each pattern's directory, with the accepted suffixes of the files it matched
    for p in paths:
        suffix = formats.known_suffix(p)
        glob = f"--input '{os.path.join(os.path.dirname(origin[p]), '*' + suffix)}'" if suffix else None
        if glob and glob not in globs:
            globs.append(glob)
    them = "it" if len(unknown) == 1 else "them"
    fix = f"leave {them} out, e.g. {' '.join(globs)}" if globs else "pass files of an accepted format"
    if len(unknown) == 1:
        raise BuildError(f"input file {unknown[0]}: unknown format ({formats.unknown_name(unknown[0])}); {fix} "
                         f"({formats.ACCEPTED})")
    listed = ", ".join(f"{p} ({formats.unknown_name(p)})" for p in unknown[:shown])
    listed += f" and {len(unknown) - shown} more" if len(unknown) > shown else ""
    raise BuildError(f"{len(unknown)} input files of unknown format: {listed}; {fix} ({formats.ACCEPTED})")


def _unreadable(path: str, e: Exception) -> str:
    return (f"input file {path} is not readable ({type(e).__name__}: {e}); fix its permissions/contents or leave "
            "it out of --input")


def _raise_first_problem(results: Sequence) -> None:
    """The checks run in parallel and return a problem as text: the first one, in path order, is the error."""
    for r in results:
        if isinstance(r, str):
            raise BuildError(r)


def plan_inputs(files: Sequence[MatchedFile], config: ChunkConfig) -> list[MatchedFile]:
    """Each Parquet and Arrow file's layout planned from its metadata (:func:`pipelines.inputs.columnar.plan`:
    refuses a missing or mistyped column, listing the file's columns, and a group too large to decode), and
    each JSON file's first records checked for ``--text_key`` (or a supervised record's keys; refused, listing
    the keys they have, when most lack it). Raises BuildError naming the file."""
    shape = keys.RecordShape.of(config.to_json())

    def one(f: MatchedFile) -> MatchedFile | str:
        try:
            if f.format in (formats.PARQUET, formats.ARROW):
                layout = columnar.plan(f.path, f.format, text_key=config.text_key, keep_fields=config.keep_fields,
                                       chunk_bytes=config.chunk_bytes, shape=shape)
                return dataclasses.replace(f, layout=layout)
            if f.size:
                with open_input(f.path, fmt.compression_of(f.path)) as stream:
                    objects = keys.sample_objects(stream, f.path, f.format == formats.JSON_ARRAY)
                for key, option, kind in shape.keys:
                    problem = keys.missing_key_problem(f.path, key, objects, option, kind)
                    if problem:
                        return problem
            return f
        except BuildError as e:  # a missing column, a damaged file, ...
            return str(e)
        except Exception as e:  # noqa: BLE001
            return _unreadable(f.path, e)

    with concurrent.futures.ThreadPoolExecutor(max_workers=READ_CHECK_THREADS) as pool:
        out = list(pool.map(one, files))
    _raise_first_problem(out)
    return out


def fingerprints_of(paths: Iterable[str], patterns: Iterable[str] = (),
                    objects: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``path -> fingerprint`` of input files (gs:// ones from ``objects``, :func:`gcs_check.objects_of`, or a
    listing of the ``patterns``' prefixes, or of the paths' common prefix in each bucket)."""
    paths = list(paths)
    gs = [p for p in paths if p.startswith("gs://")]
    if gs and objects is None:
        objects = gcs_check.objects_of(gs, list(patterns) or _prefixes(gs))
    out = {}
    for p in paths:
        if p.startswith("gs://"):
            o = (objects or {}).get(p)
            if o is not None:
                out[p] = {k: o[k] for k in ("size", "generation", "crc32c")}
        elif "://" not in p:
            out[p] = fingerprint(files.local(), p)
    return out


def _prefixes(urls: Sequence[str]) -> list[str]:
    """One listing prefix per bucket: the longest common prefix of its objects' names."""
    by_bucket: dict[str, list[str]] = {}
    for u in urls:
        bucket, key = gcs_check.split_url(u)
        by_bucket.setdefault(bucket, []).append(key)
    return [f"gs://{b}/{os.path.commonprefix(keys)}" for b, keys in sorted(by_bucket.items())]


def input_changed(inputs: Sequence[Mapping[str, Any]]) -> str | None:
    """The error for the first input (of the plan ledger's ``inputs``, each with its planned ``fingerprint``)
    whose fingerprint differs now, or None if none does (or none was recorded)."""
    planned = {i["path"]: i["fingerprint"] for i in inputs if i.get("fingerprint") is not None}
    if not planned:
        return None
    now = fingerprints_of(planned)
    for path, then in planned.items():
        got = now.get(path)
        if got != then:
            what = "it is gone" if got is None else "; ".join(
                f"{k} {then.get(k)} then, {got.get(k)} now" for k in sorted(set(then) | set(got)) if then.get(k) != got.get(k))
            return (f"input file {path} changed while the cache was built ({what}), so the cache would hold parts "
                    "of more than one version of it and is not finished. Leave the file as it is and rerun the same "
                    "command: the chunks built from another version are found by their input checksums and rebuilt")
    return None
