"""Export a finished cache to Megatron ``PREFIX.bin`` + ``PREFIX.idx`` with Apache Beam (large caches).

Usage (also ``chunkledger-export ...``)::

    python -m pipelines.export CACHE --format megatron --out PREFIX [--part_bytes 256MiB] [Beam options]

The files are byte-identical to ``python -m reader export CACHE --format megatron --out PREFIX``
(docs/INTEROP.md), which streams the cache through one process; this command spreads the reading over
Beam's workers. Without ``--runner`` the local DirectRunner runs one worker process per CPU; any Beam
runner the builder runs on works (``--runner=DataflowRunner ...``, ``--runner=DaskRunner ...``).

Steps:

1. **Plan (launcher, pipelines/export/layout.py).** Open the cache (finished only), choose the dtype as the
   CLI does, and cut the ledger's chunks into parts of about ``--part_bytes`` of ``.bin``: every chunk's
   byte and document offsets come from the ledger's counts alone. The plan goes to ``plan.json`` in the
   parts directory ``.tmp-NAME.parts/`` beside the output.
2. **Write parts (workers, pipelines/export/parts.py).** Each part's chunks are read and checked exactly
   as the CLI reads them, and written as a ``.bin`` part plus its documents' lengths; a part an earlier
   run left is kept if its size and sha256 match its record.
3. **Finalize (one worker, pipelines/export/finalize.py).** ``PREFIX.idx`` by the CLI's index writer,
   the parts joined into ``PREFIX.bin`` (``copy_file_range`` locally, Cloud Storage compose on
   ``gs://``), ``.bin`` renamed before ``.idx``, the parts directory removed.

A rerun after a crash resumes and gives the same bytes. Exit codes: 0 done; 1 the cache is damaged (as
``python -m reader``) or the environment failed (a rerun resumes); 2 refused (bad option, unfinished cache,
token outside the vocabulary, existing output).
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from typing import Any, Callable, Iterable, Sequence

import apache_beam as beam
from apache_beam.metrics import Metrics

from reader.cli import support as cli_support
from reader.format import spec as fmt
from reader.interop.export import ExportError, output_fs, output_location
from reader.storage.files import remove_quietly
from reader.storage import files
from reader.interop.megatron import open_source

from pipelines import faults, lock
from pipelines.errors import BuildError, EnvironmentFault
from pipelines.export.finalize import finalize, join_method
from pipelines.export.parts import FAILED_NAME, PLAN_NAME, PartResult, PartWriter, parts_dir, read_json
from pipelines.export.layout import ExportPlan, PartSpec, make_plan
from pipelines.filesystem import absolute
from pipelines.options import beam_parser, parse_size, pipeline_options

METRICS_NAMESPACE = "chunkledger"
DEFAULT_PART_BYTES = 256 << 20


class ExportFailed(BuildError):
    """A worker's error, as it recorded it in the parts directory (its message names the file)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def record_failure(directory: str, e: BaseException) -> None:
    """Put a worker's error in ``DIR/_FAILED.json`` so the launcher reports it on any runner (runners wrap
    a worker's exception in their own)."""
    code = e.exit_code if isinstance(e, BuildError) else cli_support.exit_code(e)
    if code is None:
        return  # a bug: the runner's traceback is what helps
    try:
        fs, path = output_location(directory)
        files.write(fs, f"{path}/{FAILED_NAME}",
                     fmt.dumps({"message": cli_support.message(e), "exit_code": code}).encode())
    except Exception:  # noqa: BLE001 - e.g. a full disk: the runner's error still carries the message
        pass


class WritePartFn(beam.DoFn):
    """PartSpec -> PartResult: the part written, or an earlier run's part verified and kept.

    Args:
      plan: the export plan.
      directory: URL of the parts directory.
      threads: chunk files fetched and decoded ahead on each worker.
    """

    def __init__(self, plan: ExportPlan, directory: str, threads: int):
        self.plan, self.directory, self.threads = plan, directory, threads

    def setup(self):
        self.writer = None
        self.written = Metrics.counter(METRICS_NAMESPACE, "parts_written")
        self.kept = Metrics.counter(METRICS_NAMESPACE, "parts_kept")

    def process(self, spec: PartSpec) -> Iterable[PartResult]:
        try:
            if self.writer is None:  # here, not in setup, so that its errors are recorded too
                fs, path = output_location(self.directory)
                self.writer = PartWriter(self.plan, path, fs, self.threads)
            result = self.writer.write(spec)
        except Exception as e:
            record_failure(self.directory, e)
            raise
        (self.kept if result.kept else self.written).inc()
        yield result


class FinalizeFn(beam.DoFn):
    """Every part's result (one list) -> ``PREFIX.bin`` and ``PREFIX.idx`` (see export_finalize).

    Args:
      plan: the export plan.
      directory: URL of the parts directory.
      out: URL of the output prefix.
    """

    def __init__(self, plan: ExportPlan, directory: str, out: str):
        self.plan, self.directory, self.out = plan, directory, out

    def process(self, results: list[PartResult]) -> Iterable[str]:
        try:
            fs, directory = output_location(self.directory)
            _, out = output_location(self.out)
            yield finalize(fs, self.plan, directory, out, results)
        except Exception as e:
            record_failure(self.directory, e)
            raise


class ExportMegatron(beam.PTransform):
    """PBegin -> one string (how the ``.bin`` was joined): every part written, then the outputs finished.

    Args:
      plan: the export plan.
      directory: URL of the parts directory (holding ``plan.json``).
      out: URL of the output prefix.
      threads: chunk files fetched and decoded ahead on each worker.
    """

    def __init__(self, plan: ExportPlan, directory: str, out: str, threads: int = 2):
        super().__init__()
        self.plan, self.directory, self.out, self.threads = plan, directory, out, threads

    def expand(self, pbegin):
        return (
            pbegin
            | "PlanParts" >> beam.Create(list(self.plan.parts), reshuffle=False)
            | "Spread" >> beam.Reshuffle()
            | "WriteParts" >> beam.ParDo(WritePartFn(self.plan, self.directory, self.threads))
            | "AfterAllParts" >> beam.combiners.ToList()
            | "Finalize" >> beam.ParDo(FinalizeFn(self.plan, self.directory, self.out))
        )


# --------------------------------------------------------------------------------------------------
# The launcher


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


HELP_EPILOG = """\
examples:
  python -m pipelines.export ./cache --format megatron --out /data/megatron/web_text_document
  python -m pipelines.export gs://BUCKET/cache --format megatron --out gs://BUCKET/megatron/web_text \\
      --runner=DataflowRunner --project=PROJECT --region=REGION --temp_location=gs://BUCKET/tmp

resuming: parts are written into .tmp-NAME.parts/ beside the output and PREFIX.bin/.idx appear only
when complete. Rerunning the same command after a crash or an interrupt keeps the parts already
written (each checked against its recorded size and sha256) and gives the same bytes. One export at a
time per --out: a second one is refused while the first runs (a dead one's lock is taken over).

exit status: 0 done; 1 the cache is damaged (the message names the chunk file) or the environment
failed (disk full, storage unreachable, a worker killed: rerun to resume); 2 refused (bad option,
unfinished cache, a split build's top directory, token outside the vocabulary, existing output without
--overwrite). Errors are one line; --debug shows the traceback. See docs/INTEROP.md."""


def build_arg_parser() -> argparse.ArgumentParser:
    """The export's own options (the others go to Beam)."""
    p = argparse.ArgumentParser(
        prog="python -m pipelines.export", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Write a finished cache as Megatron PREFIX.bin + PREFIX.idx with Apache Beam: the same bytes as `python "
            "-m reader export CACHE --format megatron --out PREFIX`, with the chunks read and checked on many "
            "workers (for caches too large for one process). Options not listed here go to Beam (e.g. "
            "--runner=DataflowRunner --project=... --region=... --temp_location=gs://..., or --runner=DaskRunner "
            "--dask_client_address=HOST:PORT); without --runner the local DirectRunner runs one worker process per "
            "CPU. Give Beam options as --name=value.", 100),
        epilog=HELP_EPILOG)
    p.add_argument("cache", help="the cache root (local path or gs://bucket/cache); its build must have finished")
    p.add_argument("--format", required=True, choices=["megatron", "flat-tokens"],
                   help="megatron (flat-tokens: use python -m reader export)")
    p.add_argument("--out", required=True, metavar="PREFIX", help="output prefix: writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing PREFIX.bin/PREFIX.idx (the old .idx is removed before the new .bin "
                        "gets its name)")
    p.add_argument("--dtype", choices=["auto", "uint16", "int32"], default="auto",
                   help="token dtype of the .bin (default auto: Megatron's rule, uint16 if vocab_size < 65500)")
    p.add_argument("--part_bytes", type=parse_size, default=DEFAULT_PART_BYTES, metavar="SIZE",
                   help="about this many bytes of .bin per part, the unit of work of one worker call (whole "
                        "chunks; default 256MiB, accepts 268435456, 256MiB, 1GiB)")
    p.add_argument("--threads", type=_at_least_one, default=2,
                   help="chunk files each worker fetches and decodes ahead, in parallel (default 2; a worker "
                        "holds threads + 1 chunks in memory)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    cli_support.two_line_errors(p)
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Our options and the Beam ones; anything that is neither is a BuildError naming it."""
    parser = build_arg_parser()
    args, rest = parser.parse_known_args(argv)
    _, unknown = beam_parser(rest).parse_known_args(rest)
    if unknown:
        raise BuildError(f"unexpected argument(s) {' '.join(unknown[:3])}: neither an option of this command (see "
                         "--help) nor an Apache Beam pipeline option (give those as --name=value)")
    if args.format != "megatron":
        raise BuildError(f"--format {args.format}: the Beam export writes megatron only; use python -m reader export "
                         f"{args.cache} --format {args.format} --out {args.out}")
    return args, rest


def _state(fs, plan: ExportPlan, directory: str, out: str, overwrite: bool) -> str:
    """``"complete"``, ``"resume"`` or ``"fresh"``; raises ExportError for outputs that are not this export's."""
    bin_path, idx_path = out + ".bin", out + ".idx"
    recorded = read_json(fs, f"{directory}/{PLAN_NAME}")
    ours = recorded is not None and recorded.get("fingerprint") == plan.fingerprint
    have_bin, have_idx = fs.exists(bin_path), fs.exists(idx_path)
    if ours and have_bin and have_idx and (fs.size(bin_path), fs.size(idx_path)) == (plan.bin_bytes, plan.idx_bytes):
        return "complete"  # a run that died after renaming both, before removing its parts
    if not overwrite and (have_idx or (have_bin and not ours)):
        raise ExportError(f"{idx_path if have_idx else bin_path} exists; pass --overwrite to replace it, or choose "
                          "another --out")
    return "resume" if ours else "fresh"


def _prepare(fs, plan: ExportPlan, directory: str, state: str) -> None:
    """The parts directory of this plan: another export's leftovers removed, the plan recorded."""
    if state == "fresh":
        for p in fs.ls(directory, detail=False) if fs.exists(directory) else []:
            if not p.rstrip("/").endswith("/" + fmt.LOCK_NAME):
                remove_quietly(fs, p)
        files.write(fs, f"{directory}/{PLAN_NAME}", fmt.dumps(plan.to_json()).encode())
    remove_quietly(fs, f"{directory}/{FAILED_NAME}")


def _counters(result) -> dict[str, int]:
    """The job's ``chunkledger`` counters ({} where the runner reports none)."""
    try:
        from apache_beam.metrics.metric import MetricsFilter

        found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
        out: dict[str, int] = {}
        for m in found:
            out[m.key.metric.name] = out.get(m.key.metric.name, 0) + int(m.committed or m.attempted or 0)
        return out
    except Exception:  # noqa: BLE001 - a report, never a reason to fail
        return {}


def _run_pipeline(beam_options, plan: ExportPlan, fs, directory: str, directory_url: str, out_url: str,
                  threads: int) -> dict[str, int]:
    p = beam.Pipeline(options=beam_options)
    _ = p | "ExportMegatron" >> ExportMegatron(plan, directory_url, out_url, threads)
    return _counters(run_job(p, lambda: (fs, directory), out_url, "completed parts"))


def run_job(p: beam.Pipeline, failures: Callable[[], tuple[Any, str]], url: str, kept: str):
    """Run ``p`` to its end; a failure raises a worker's recorded error (``_FAILED.json`` in the ``(fs, directory)``
    of ``failures()``), else the environment fault on ``url`` (``kept``: what a rerun keeps), else the runner's."""
    try:
        result = p.run()
        result.wait_until_finish()
    except Exception as e:
        fs, directory = failures()
        failure = read_json(fs, f"{directory}/{FAILED_NAME}")
        if failure is not None and isinstance(failure.get("message"), str):
            raise ExportFailed(failure["message"], int(failure.get("exit_code") or 2)) from e
        cause = faults.explain(e, url)
        if cause is not None:
            raise EnvironmentFault(cause.replace("completed chunks", kept)) from e
        raise
    return result


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Plan, run and finish an export. Returns ``{"summary": str, "plan": ExportPlan, "counters": {...}}``.

    Raises BuildError (exit code 2, or the worker's), the reader's errors for a cache that cannot be
    exported (``ExportError``, ``ChunkError``: exit codes as ``python -m reader``), EnvironmentFault (1).
    """
    args, pipeline_args = parse_args(argv)
    beam_options = pipeline_options(pipeline_args)  # a bad runner fails before anything is written
    cache_url, out_url = absolute(args.cache), absolute(args.out)
    cache, vocab, dt = open_source(cache_url, None if args.dtype == "auto" else args.dtype,
                                 command="python -m pipelines.export")
    fs, out = output_fs(out_url)
    t = cache.table
    plan = make_plan(cache_url, t.checksums, t.docs, t.tokens, dt.name, vocab, args.part_bytes)
    directory, directory_url = parts_dir(out), parts_dir(out_url)
    try:
        held = lock.acquire(directory_url)
    except OSError as e:
        raise EnvironmentFault(faults.explain(e, out_url) or f"cannot create {directory_url}: {e}") from e
    counters: dict[str, int] = {}
    try:
        state = _state(fs, plan, directory, out, args.overwrite)  # now that no other export runs here
        if state == "complete":
            remove_quietly(fs, directory)
        else:
            _prepare(fs, plan, directory, state)
            counters = _run_pipeline(beam_options, plan, fs, directory, directory_url, out_url, args.threads)
    finally:
        held.release()
        fs.invalidate_cache()
        if fs.exists(directory) and not fs.ls(directory):
            remove_quietly(fs, directory)  # only the lock was there (a refused or failed start)
    if not (fs.exists(out + ".bin") and fs.exists(out + ".idx")) or fs.exists(directory):
        raise EnvironmentFault(f"the pipeline ended but {out_url}.idx is missing or {directory_url} is still there. "
                               "Rerunning the same command resumes: completed parts are kept.")
    done = (f"{len(plan.parts)} parts: {counters.get('parts_written', 0)} written, {counters.get('parts_kept', 0)} "
            f"kept from an earlier run; .bin joined by {join_method(fs)}" if state != "complete"
            else "already complete (an earlier run's parts directory removed)")
    summary = (f"wrote {args.out}.bin and {args.out}.idx: {plan.docs:,} documents, {plan.tokens:,} tokens, dtype "
               f"{dt.name} (vocab_size {vocab}); {done}")
    print(summary)
    return {"summary": summary, "plan": plan, "counters": counters, "state": state}


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: one line on stderr and the exit code for a refused, damaged or failed export."""
    run_command(run, argv, "completed parts are kept")


def run_command(run_fn, argv: Sequence[str] | None, resumes: str) -> None:
    """Run a Beam command's ``run_fn(argv)`` for the command line (this export's, the dedup job's): one line
    on stderr and the exit code for a refused, damaged or failed run; ``resumes``: what a rerun keeps."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet = faults.HideRunnerTracebacks()
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    if not debug:
        for h in consoles:
            h.addFilter(quiet)
        logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
    try:
        run_fn(argv)
    except KeyboardInterrupt:
        print(f"interrupted. Rerunning the same command resumes: {resumes}.", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - classified below
        code = e.exit_code if isinstance(e, BuildError) else cli_support.exit_code(e)
        if debug or code is None:
            raise
        print(f"error: {cli_support.message(e, argv[0] if argv else '')}", file=sys.stderr)
        sys.exit(code)
    finally:
        for h in consoles:
            h.removeFilter(quiet)


if __name__ == "__main__":
    main()
