"""Build a chunkledger cache: jsonl shards -> tokenized Parquet chunks + ledger.json (Apache Beam).

Usage::

    python -m pipelines.build_cache --input 'data/*.jsonl.gz' --output out/cache \\
        --tokenizer tiktoken:cl100k_base [--text_key text] [--append_eos] [Beam options]

Steps:

1. **Plan (launcher, pipelines/launcher.py).** Match and sort the input files (sorted path = shard
   order), resolve the tokenizer, and write ``ledger.json`` with ``"finished": false`` (the plan). If a
   ledger already exists, its tokenizer/configuration and input files must match (else: refuse); the
   build then resumes.
2. **Build chunks (workers, pipelines/transforms.py).** One work unit per chunk of an uncompressed
   shard (a byte range, split at line starts like TextIO) and one per compressed shard (streamed, cut
   into chunks by uncompressed offset). Units whose chunks already exist and verify against their
   sidecars are skipped.
3. **Finalize (one worker).** After every unit, compute the global round-robin order, cumulative
   offsets, totals and bad-record counts, check ``--max_bad_fraction``, and write the verdict: the
   ledger with ``"finished": true`` (a pure function of the inputs and the configuration), or
   ``_FAILED.json``. :func:`run` reads that verdict once the runner returns or raises.

Options not listed by ``--help`` are passed to Beam (``--runner``, ``--project``, ...). Without
``--runner`` the local DirectRunner runs with one worker process per CPU.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from typing import Any, Sequence

from . import trace

if __name__ == "__main__":
    trace.event("launcher_start")  # before Beam is imported: the import is part of every build's fixed cost
    # Importing Beam creates hundreds of thousands of objects that live as long as the launcher; the cyclic
    # garbage collector would walk them over and over while they are created.
    gc.disable()

import apache_beam as beam  # noqa: E402

from . import status  # noqa: E402
from .errors import BuildError  # noqa: E402
from .launcher import prepare  # noqa: E402
from .options import build_arg_parser, parse_args, pipeline_options  # noqa: E402
from .transforms import BuildCache  # noqa: E402

if __name__ == "__main__":
    gc.freeze()  # what was imported lives as long as the process: never walk it again
    gc.enable()

__all__ = ["BuildError", "build_arg_parser", "main", "run"]

def _summary(ledger: dict[str, Any], seconds: float | None, output: str) -> str:
    t = ledger["totals"]
    s = (f"chunkledger: {t['docs']} documents, {t['tokens']} tokens, {t['chunks']} chunks, "
         f"{t['bad_records']} bad records, {t['uncompressed_bytes']} input bytes")
    if seconds is not None:
        s += f" in {seconds:.1f}s ({t['tokens'] / max(seconds, 1e-9):,.0f} tokens/s, " \
             f"{t['uncompressed_bytes'] / max(seconds, 1e-9) / 1e6:.1f} MB/s)"
    return s + f" -> {output}"


def _only_describes_job(pipeline: beam.Pipeline) -> bool:
    """True when Dataflow only writes a job description (a template, or --dry_run) and runs nothing."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions, TestOptions

    if type(pipeline.runner).__name__ != "DataflowRunner":
        return False  # other runners ignore both options and really run
    options = pipeline.options
    return bool(options.view_as(GoogleCloudOptions).template_location or options.view_as(TestOptions).dry_run)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Plan, run and finalize a build. Returns ``{"ledger": ..., "summary": str, "resumed": bool, ...}``.

    Raises BuildError (naming the file or option and the fix) when the build cannot start or finish.
    """
    args = parse_args(argv)
    t0 = time.time()
    prepared = prepare(args)
    output = prepared.output
    if prepared.finished is not None:
        summary = _summary(prepared.finished, None, output) + " (already complete; nothing to do)"
        print(summary)
        return {"ledger": prepared.finished, "summary": summary, "resumed": True, "already_complete": True}
    trace.event("planned")
    p = beam.Pipeline(options=pipeline_options(args.pipeline_args))
    _ = p | "BuildCache" >> BuildCache(output, prepared.plan, prepared.tokenizer, args.options.max_bad_fraction)
    try:
        trace.event("run_start")
        result = p.run()
        if _only_describes_job(p):
            print(f"chunkledger: job description written, nothing ran (the plan is {output}/ledger.json; "
                  "launching the job finishes the cache)")
            return {"ledger": prepared.plan.ledger(), "summary": "", "resumed": prepared.resumed,
                    "already_complete": False, "result": result, "submitted": False}
        result.wait_until_finish()
    except Exception as e:
        # Runners wrap a worker's error in their own; the job's verdict, if it reached one, is in the cache.
        failure = status.read_outcome(output).failure
        if failure is not None:
            raise BuildError(failure.message(output)) from e
        raise
    trace.event("run_done")
    outcome = status.read_outcome(output)
    if outcome.failure is not None:
        raise BuildError(outcome.failure.message(output))
    if not outcome.finished:
        raise BuildError(f"the pipeline ended but {output}/ledger.json is not finished; rerun the same command")
    summary = _summary(outcome.ledger, time.time() - t0, output)
    print(summary)
    return {"ledger": outcome.ledger, "summary": summary, "resumed": prepared.resumed, "already_complete": False,
            "result": result}


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (``python -m pipelines.build_cache``, ``chunkledger-build``): exit 2 on a BuildError."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Worker start-up notices forwarded by the local job service (harmless, and noisy on every run).
    logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
    trace.event("launcher_imported", gc_enabled=gc.isenabled(), gc_frozen=gc.get_freeze_count())
    try:
        run(argv)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    trace.event("launcher_exit")


if __name__ == "__main__":
    main()
    gc.freeze()  # the interpreter's exit would otherwise walk every live object once more
