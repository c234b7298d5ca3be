"""Duplicate marks over a finished cache, with Apache Beam, written as an attribute set (docs/CURATION.md).

Usage::

    python -m pipelines.dedup CACHE [--near] [Beam options]

Exact (the default): documents with the same token sequence; the first of each group in the global order
is kept, the others are marked with it (set ``duplicates``). ``--near``: MinHash over shingles of 5 tokens,
LSH bands, verified pairs and a greedy rule in the global order (set ``near_duplicates``; marks carry the
estimated Jaccard similarity). The graphs are in :mod:`pipelines.dedup.transforms`.

Steps: open the cache (finished only) and take the set's lock (``CACHE/attributes/NAME/_BUILDING.json``);
if the set's manifest is there, names this cache and these parameters, and every file verifies, there is
nothing to do. Otherwise the manifest is removed, the job computes the marks, writes each chunk's file
(keeping a file that already holds these bytes) and, last, the manifest. A rerun after a crash gives the
same files. Exit codes: 0 done; 1 the cache is damaged (as ``python -m reader``) or the environment failed
(a rerun resumes); 2 refused (bad option, unfinished cache).
"""

from __future__ import annotations

import argparse
import textwrap
import time
from typing import Any, Sequence

import apache_beam as beam

from reader.format import attributes as attrs
from reader.format import spec as fmt
from reader.interop.export import output_location
from reader.storage.attributes import AttributeSet
from reader.storage.cache import Cache

from pipelines import faults, lock
from pipelines.dedup import groups, minhash
from pipelines.dedup.transforms import ExactDuplicates, Job, NearDuplicates, WriteSet
from pipelines.errors import BuildError, EnvironmentFault
from pipelines.export.job import run_command, run_job
from pipelines.export.parts import FAILED_NAME
from pipelines.filesystem import BEAM, absolute
from pipelines.options import beam_parser, pipeline_options
from pipelines.runners import choice as runners
from pipelines.runners import local_workers

EXACT_NAME = "duplicates"
NEAR_NAME = "near_duplicates"
NEAR_THRESHOLD = 0.75  # the smallest estimated Jaccard of a mark (docs/CURATION.md: the bands, the table)
ALGORITHM = 1  # bump when a rule changes: a rerun then computes the set again
DOCS_PER_PARTITION = 1 << 20  # a GroupByKey partition's documents (or band keys / BANDS): about 32 MB


def params(near: bool) -> dict[str, Any]:
    """The parameters a set records (its manifest's ``params``): every choice its marks depend on."""
    if not near:
        return {"algorithm": ALGORITHM, "hash": "xxh3_128 of the token ids as int32 little-endian, and num_tokens",
                "keeper": "first in the global order"}
    return {"algorithm": ALGORITHM, "shingle_tokens": minhash.SHINGLE, "signature": "one-permutation minhash, "
            "rotation densification", "bins": minhash.K, "bands": minhash.BANDS, "rows": minhash.ROWS,
            "bucket_window": groups.WINDOW, "bucket_first": groups.FIRST, "threshold": NEAR_THRESHOLD,
            "keeper": "greedy in the global order: the kept neighbour of the highest estimate"}


def partitions(keys: int) -> int:
    """Hash partitions of a GroupByKey over ``keys`` keys: a power of two, at least 4 (parallel work), at
    most 4096 (elements per chunk)."""
    p = 4
    while p < 4096 and p * DOCS_PER_PARTITION < keys:
        p *= 2
    return p


HELP_EPILOG = """\
examples:
  python -m pipelines.dedup ./cache                 # exact duplicates -> ./cache/attributes/duplicates/
  python -m pipelines.dedup ./cache --near          # near duplicates  -> ./cache/attributes/near_duplicates/
  python -m pipelines.dedup gs://BUCKET/cache --near --runner=DataflowRunner --project=PROJECT \\
      --region=REGION --temp_location=gs://BUCKET/tmp

The chunks, ledger and sidecars are not touched: the marks are per-document attribute files beside them
(docs/CURATION.md). Rerunning the same command after a crash gives the same files; on a complete set it
only verifies it. One job at a time per set (a dead one's lock is taken over).

exit status: 0 done; 1 the cache is damaged (the message names the file) or the environment failed (disk
full, storage unreachable, a worker killed: rerun); 2 refused (bad option, unfinished cache). Errors are
one line; --debug shows the traceback."""


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.dedup", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Mark the duplicate documents of a finished cache with Apache Beam, as an attribute set beside its "
            "chunks. Exact duplicates (the same token sequence): the first of each group in the global order is "
            "kept, the others are marked with it. --near: near duplicates by MinHash over shingles of 5 tokens "
            "and LSH bands, each mark verified at an estimated Jaccard similarity of at least "
            f"{NEAR_THRESHOLD}. A read can then leave the marked documents out (a view) without a rebuild. "
            "Options not listed here go to Beam (e.g. --runner=DaskRunner --dask_client_address=HOST:PORT, or "
            "--runner=DataflowRunner ...); without --runner the local DirectRunner runs one worker process per "
            "CPU. Give Beam options as --name=value.", 100),
        epilog=HELP_EPILOG)
    p.add_argument("cache", help="the cache root (local path or gs://bucket/cache); its build must have finished")
    p.add_argument("--near", action="store_true",
                   help=f"near duplicates (set {NEAR_NAME!r}) instead of exact ones (set {EXACT_NAME!r})")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Our options and the Beam ones; anything that is neither is a BuildError naming it."""
    args, rest = build_arg_parser().parse_known_args(argv)
    _, unknown = beam_parser(rest).parse_known_args(rest)
    if unknown:
        raise BuildError(f"unexpected argument(s) {' '.join(unknown[:3])}: neither an option of this command (see "
                         "--help) nor an Apache Beam pipeline option (give those as --name=value)")
    return args, rest


def open_cache(url: str) -> Cache:
    cache = Cache(url)
    if not cache.complete:
        raise BuildError(f"{cache.display(fmt.LEDGER_NAME)}: the build has not finished (finished: false); duplicate "
                         "marks need a finished cache: wait for the build, or rerun the build command")
    return cache


def complete(cache: Cache, name: str, params_hash: str) -> bool:
    """Whether the set ``name`` is there, computed from this cache with these parameters, every file verified."""
    try:
        found = AttributeSet(cache, name)
        if found.manifest.params_hash != params_hash:
            return False
        for c in range(len(cache.table)):
            found.chunk(c)
    except (FileNotFoundError, fmt.FormatError):
        return False
    return True


def _clear(set_url: str) -> None:
    """Before a run: the old manifest (the set is no longer complete), a crashed run's temporary files and
    its recorded failure."""
    BEAM.remove(f"{set_url}/{attrs.MANIFEST_NAME}")
    BEAM.remove(f"{set_url}/{FAILED_NAME}")
    for pattern in (f"{set_url}/{fmt.TMP_PREFIX}*", f"{set_url}/shard-*/{fmt.TMP_PREFIX}*"):
        for e in BEAM.match(pattern):
            BEAM.remove(e.path)


def _run_pipeline(beam_options, job: Job, chunks: int, set_url: str) -> None:
    workers = runners.local_process_workers(beam_options)
    warm = local_workers.WarmProcess() if workers and local_workers.enabled() else None
    p = beam.Pipeline(runner=runners.forked_workers_runner(warm.worker_command()) if warm else None,
                      options=beam_options)
    marks = p | ("NearDuplicates" if job.kind == attrs.NEAR else "ExactDuplicates") >> (
        NearDuplicates if job.kind == attrs.NEAR else ExactDuplicates)(job, chunks)
    _ = marks | "WriteSet" >> WriteSet(job, chunks)
    try:
        run_job(p, lambda: output_location(set_url), set_url, "attribute files")
    finally:
        if warm is not None:
            warm.close()


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Compute (or verify) a cache's duplicate marks. Returns ``{"summary", "state", "manifest"}``; ``state``
    is ``"complete"`` (nothing to do) or ``"computed"``.

    Raises BuildError (2, or the worker's code), the reader's errors for a damaged cache (1), EnvironmentFault (1).
    """
    args, pipeline_args = parse_args(argv)
    beam_options = pipeline_options(pipeline_args)  # a bad runner fails before anything is written
    url = absolute(args.cache)
    cache = open_cache(url)
    kind, name = (attrs.NEAR, NEAR_NAME) if args.near else (attrs.EXACT, EXACT_NAME)
    table = cache.table
    docs = int(table.docs.sum())
    job = Job(cache_url=url, name=name, kind=kind, params=tuple(sorted(params(args.near).items())),
              partitions=partitions(docs * (minhash.BANDS if args.near else 1)), threshold=NEAR_THRESHOLD)
    t0 = time.time()
    try:
        held = lock.acquire(job.set_url)
    except OSError as e:
        raise EnvironmentFault(faults.explain(e, job.set_url) or f"cannot create {job.set_url}: {e}") from e
    try:
        state = "complete" if complete(cache, name, job.params_hash) else "computed"
        if state == "computed":
            _clear(job.set_url)
            _run_pipeline(beam_options, job, len(table), job.set_url)
        found = AttributeSet(Cache(url), name)  # the manifest the job wrote (checked against the cache)
    except FileNotFoundError as e:
        raise EnvironmentFault(f"the pipeline ended but the set's manifest is missing ({e}). Rerunning the same "
                               "command resumes.") from e
    finally:
        held.release()
    totals = found.manifest.raw["totals"]
    what = "exact duplicates" if kind == attrs.EXACT else f"near duplicates (estimated Jaccard >= {NEAR_THRESHOLD})"
    done = "already complete (verified)" if state == "complete" else f"computed in {time.time() - t0:.1f} s"
    summary = (f"{url}/{attrs.set_dir(name)}: {totals['marked']:,} of {totals['docs']:,} documents marked as "
               f"{what}, {totals['marked_tokens']:,} tokens; {len(table)} chunk files; {done}")
    print(summary)
    return {"summary": summary, "state": state, "manifest": found.manifest}


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: one line on stderr and the exit code for a refused, damaged or failed run."""
    run_command(run, argv, "attribute files already written are kept")
