"""Build a chunkledger cache: jsonl shards -> tokenized Parquet chunks + ledger.json (Apache Beam).

Usage::

    python -m pipelines.build_cache --input 'data/*.jsonl.gz' --output out/cache \\
        --tokenizer tiktoken:cl100k_base [--text_key text] [--append_eos] [Beam options]

Steps:

1. **Plan (launcher, pipelines/launcher.py).** Match and sort the input files (sorted path = shard
   order), resolve the tokenizer, and write ``ledger.json`` with ``"finished": false`` (the plan). If a
   ledger already exists, its tokenizer/configuration and input files must match (else: refuse); the
   build then resumes.
2. **Build chunks (workers, pipelines/chunking/transforms.py).** One work unit per chunk of an uncompressed
   shard (a byte range, split at line starts like TextIO) and one per compressed shard (streamed, cut
   into chunks by uncompressed offset). Units whose chunks already exist and verify against their
   sidecars are skipped.
3. **Finalize (one worker).** After every unit, compute the global round-robin order, cumulative
   offsets, totals and bad-record counts, check ``--max_bad_fraction``, and write the verdict: the
   ledger with ``"finished": true`` (a pure function of the inputs and the configuration), or
   ``_FAILED.json``. :func:`run` reads that verdict once the runner returns or raises.

With ``--validation_fraction F`` the same steps write two caches from one pass over the input,
``OUTPUT/train`` and ``OUTPUT/validation`` (``reader/format/splits.py``), each with its own ledger.

Options not listed by ``--help`` are passed to Beam (``--runner``, ``--project``, ...); an option that
is neither ours nor Beam's is an error. Without ``--runner`` the local DirectRunner runs with one worker
process per CPU.

The command line shows a progress line while the job runs (pipelines/runners/progress_line.py). Exit codes: 0
finished; 2 refused (bad options or input, too many bad lines, another build's cache); 1 the environment
failed (disk full, permissions, network, a worker killed) or an unexpected error; 130 interrupted (Ctrl-C):
rerunning the same command resumes. A failure is one message; tracebacks, the workers' included, go to a
log file named in it (``--debug`` prints them instead).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Sequence

from pipelines import faults, trace

_WARM: "local_workers.WarmProcess | None" = None  # started before Beam is imported (see local_workers)
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the console's log lines (main)


def _interrupted_early(signum, frame) -> None:
    """Ctrl-C while Beam is imported: nothing was written yet (the warm process stops with the launcher)."""
    print(f"interrupted. {faults.RERUN}", file=sys.stderr)
    if _WARM is not None:  # still importing: it has forked no worker yet
        _WARM.proc.kill()
        shutil.rmtree(_WARM.dir, ignore_errors=True)
    os._exit(130)


def _on_interrupt(handler) -> None:
    """Handle Ctrl-C with ``handler``, unless the process was started with SIGINT ignored (``nohup``, ``&``)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, handler)


if __name__ == "__main__":
    _on_interrupt(_interrupted_early)

from pipelines.runners import local_workers  # noqa: E402

if __name__ == "__main__":
    trace.event("launcher_start")  # before Beam is imported: the import is part of every build's fixed cost
    if local_workers.enabled() and local_workers.wants_local_workers(sys.argv[1:]) and not {"-h", "--help"} & set(
            sys.argv):
        _WARM = local_workers.WarmProcess(local_workers.preload_hint(sys.argv[1:]))
    # Importing Beam creates hundreds of thousands of objects that live as long as the launcher; the cyclic
    # garbage collector would walk them over and over while they are created.
    gc.disable()

import apache_beam as beam  # noqa: E402

from reader.format.splits import cache_names, cache_root  # noqa: E402

from pipelines import lock, status  # noqa: E402
from pipelines.runners import progress_line  # noqa: E402
from pipelines.runners import choice as runners  # noqa: E402
from pipelines.chunking import unit_queue  # noqa: E402
from pipelines.errors import BuildError, EnvironmentFault  # noqa: E402
from pipelines.tokenize.fast_tokenizer import backend_note  # noqa: E402
from pipelines.launcher import Prepared, plan_build, reconcile_output  # noqa: E402
from pipelines.options import Arguments, build_arg_parser, parse_args, pipeline_options  # noqa: E402
from pipelines.chunking.transforms import METRICS_NAMESPACE, BuildCache  # noqa: E402
from reader.storage.progress import counted  # noqa: E402

if __name__ == "__main__":
    gc.freeze()  # what was imported lives as long as the process: never walk it again
    gc.enable()

__all__ = ["BuildError", "build_arg_parser", "main", "run"]

def _summary(ledgers: dict[str | None, dict[str, Any]], output: str, run: str = "") -> str:
    """The last line printed: documents, tokens (per split in a split build), chunks, bad records, this run."""
    totals = {name: led["totals"] for name, led in ledgers.items()}
    t = next(iter(totals.values()))  # the inputs and chunk counts are the same in every cache
    docs = sum(x["docs"] for x in totals.values())
    tokens = sum(x["tokens"] for x in totals.values())
    bad = sum(x["bad_records"] for x in totals.values())
    s = f"chunkledger: {counted(docs, 'document', '')}, {counted(tokens, 'token', '')}"
    if "loss_tokens" in t:  # a supervised build
        s += f" ({counted(sum(x['loss_tokens'] for x in totals.values()), 'loss token', '')})"
    if None not in totals:
        s += " (" + "; ".join(f"{name}: {counted(x['docs'], 'document', '')}, {counted(x['tokens'], 'token', '')}"
                              for name, x in totals.items())
        s += f"), {counted(t['chunks'], 'chunk', '')} per split"
    else:
        s += f", {counted(t['chunks'], 'chunk', '')}"
    s += f", {counted(bad, 'bad record', '')}, {counted(t['uncompressed_bytes'], 'input byte', '')}{run} -> {output}"
    return s if None in totals else s + f" ({', '.join(f'{name}/' for name in totals)})"


def _result(ledgers: dict[str | None, dict[str, Any]], summary: str, **more: Any) -> dict[str, Any]:
    """What :func:`run` returns: ``ledger`` is the plain (or train) cache's; ``splits`` maps a split build's caches."""
    out = {"ledger": next(iter(ledgers.values())), "summary": summary, **more}
    if None not in ledgers:
        out["splits"] = dict(ledgers)
    return out


def _this_run(counters: dict[str, int] | None, seconds: float, verified: bool) -> str:
    """What this run did: the chunks it checked, kept and rebuilt, and the throughput of the work it did."""
    if counters is None:
        if verified:  # (the finished cache's chunks were checked, and any damaged one rebuilt)
            return (f"; this run in {seconds:.1f}s: verified the already complete cache (this runner reports no "
                    "counts of the chunks it kept or rebuilt)")
        return f"; this run took {seconds:.1f}s"
    c = counters.get
    written, checked, kept, rebuilt = (c("chunks_written", 0), c("chunks_checked", 0), c("chunks_skipped", 0),
                                       c("chunks_rebuilt", 0))
    parts = []
    if checked:
        changed = c("chunks_input_changed", 0)
        why = f" ({changed} because their input changed)" if changed else ""
        parts.append(f"checked {counted(checked, 'chunk', '')} against their files and inputs: kept {kept}, rebuilt "
                     f"{rebuilt}{why}")
    if written or not checked:
        rate = (f" ({c('tokens', 0) / max(seconds, 1e-9):,.0f} tokens/s, "
                f"{c('input_bytes', 0) / max(seconds, 1e-9) / 1e6:.1f} MB/s)" if written else "")
        parts.append(f"built {counted(written, 'chunk', '')}, {counted(c('tokens', 0), 'token', '')}{rate}")
    if verified and not written:
        parts.append("already complete")
    return f"; this run in {seconds:.1f}s: " + "; ".join(parts)


def _counters(result) -> dict[str, int] | None:
    """The job's ``chunkledger`` counters, or None where the runner does not report metrics."""
    try:
        from apache_beam.metrics.metric import MetricsFilter

        found = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
        out: dict[str, int] = {}
        for m in found:
            value = m.committed if m.committed is not None else m.attempted
            out[m.key.metric.name] = out.get(m.key.metric.name, 0) + int(value or 0)
        return out
    except Exception:  # noqa: BLE001 - metrics are a report, never a reason to fail
        return None


def _only_describes_job(pipeline: beam.Pipeline) -> bool:
    """True when Dataflow only writes a job description (a template, or --dry_run) and runs nothing."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions, TestOptions

    if type(pipeline.runner).__name__ != "DataflowRunner":
        return False  # other runners ignore both options and really run
    options = pipeline.options
    return bool(options.view_as(GoogleCloudOptions).template_location or options.view_as(TestOptions).dry_run)


def run(argv: Sequence[str] | None = None, console: "progress_line.Console | None" = None) -> dict[str, Any]:
    """Plan, run and finalize a build. Returns ``{"ledger": ..., "summary": str, "resumed": bool, ...}``;
    a split build's ``ledger`` is the train cache's, and ``splits`` maps ``train``/``validation`` to both.
    With a ``console``, the progress line is shown there while the job runs (the command line's).

    Raises BuildError (naming the file or option and the fix) when the build cannot start or finish, and
    EnvironmentFault (a BuildError) when the disk, the network or a worker failed.
    """
    args = parse_args(argv)
    t0 = time.time()
    beam_options = pipeline_options(args.pipeline_args)  # before any output is written: a bad runner fails first
    planned = plan_build(args)
    try:
        held = lock.acquire(args.output)
    except OSError as e:
        raise EnvironmentFault(faults.explain(e, args.output) or f"cannot create --output {args.output}: {e}") from e
    try:
        return _run(args, reconcile_output(planned), t0, beam_options, console)
    finally:
        held.release()


def _run(args: Arguments, prepared: Prepared, t0: float, beam_options,
         console: "progress_line.Console | None" = None) -> dict[str, Any]:
    output = prepared.output
    names = cache_names(prepared.plan.split)
    first = cache_root(output, names[0])  # the plain cache, or the train cache (which keeps the dead letters)
    if prepared.old_format:
        summary = _summary(prepared.finished, output, f", {prepared.tokenizer.eos.describe()}") + (
            " (already complete; a format 1 cache: readable as before, not verified again because its chunks "
            "do not record the input bytes they were built from)")
        print(summary)
        return _result(prepared.finished, summary, resumed=True, already_complete=True)
    trace.event("planned")
    workers = runners.local_process_workers(beam_options)
    warm = _warm_process(args, workers)
    runner = runners.forked_workers_runner(warm.worker_command()) if warm is not None else None
    claims = unit_queue.new_claims_directory() if workers > 1 else None
    p = beam.Pipeline(runner=runner, options=beam_options)
    _ = p | "BuildCache" >> BuildCache(output, prepared.plan, prepared.tokenizer, args.options.max_bad_fraction,
                                       allow_empty=args.options.allow_empty,
                                       finished=tuple(prepared.finished or ()), started=t0,
                                       queue=(claims, workers) if claims else None)
    if console is not None:
        console.job_started = True
    watcher = progress_line.watch(console, output, prepared.plan)
    # While the job runs, what else reaches sys.stderr (a runner's in-process workers print their tracebacks
    # there) goes to the command line's log file, not to the console.
    quiet = contextlib.redirect_stderr(console.log) if console is not None and console.log else contextlib.nullcontext()
    try:
        with quiet:
            trace.event("run_start")
            result = p.run()
            described = _only_describes_job(p)
            if not described:
                result.wait_until_finish()
    except Exception as e:
        if faults.interrupted(e):  # a runner with in-process workers wrapped the Ctrl-C
            raise KeyboardInterrupt() from e
        # Runners wrap a worker's error in their own; the job's verdict, if it reached one, is in the cache.
        failure = status.read_outcome(output, names).failure
        if failure is not None:
            raise BuildError(failure.message(first)) from e
        cause = faults.explain(e, output)
        if cause is not None:
            raise EnvironmentFault(cause) from e
        if type(p.runner).__name__ == "DaskRunner" and not isinstance(e, BuildError):
            # Dask gives up on a unit after its workers died (KilledWorker) or the scheduler went away.
            raise EnvironmentFault(f"the Dask job failed ({type(e).__name__}: {e}). {faults.RERUN}") from e
        raise
    finally:
        if watcher is not None:
            watcher.stop()
        if warm is not None:
            warm.close()
        if claims is not None:
            unit_queue.remove(claims)
    if described:
        if console is not None:
            console.clear()
        print(f"chunkledger: job description written, nothing ran (the plan is {first}/ledger.json; "
              "launching the job finishes the cache)")
        plans = {name: plan.ledger() for name, plan in prepared.plan.caches()}
        return _result(plans, "", resumed=prepared.resumed, already_complete=False, result=result, submitted=False)
    trace.event("run_done")
    outcome = status.read_outcome(output, names)
    if outcome.failure is not None:
        raise BuildError(outcome.failure.message(first))
    if not outcome.finished:
        unfinished = [cache_root(output, n) for n, led in outcome.ledgers.items() if not led.get("finished")]
        raise EnvironmentFault(f"the pipeline ended but {unfinished[0]}/ledger.json is not finished. {faults.RERUN}")
    counters = _counters(result)
    verified = prepared.complete
    summary = _summary(outcome.ledgers, output,
                       f", {prepared.tokenizer.eos.describe()}" + _this_run(counters, time.time() - t0, verified))
    note = backend_note(counters)
    summary += f"; {note}" if note else ""
    if watcher is not None:
        watcher.finish(progress_line.Snapshot.of_ledgers(outcome.ledgers))
    print(summary)
    already = verified and counters is not None and counters.get("chunks_written", 0) == 0
    return _result(outcome.ledgers, summary, resumed=prepared.resumed, already_complete=already, result=result,
                   counters=counters)


def _warm_process(args: Arguments, workers: int) -> "local_workers.WarmProcess | None":
    """The warm process forking this run's SDK workers (see pipelines/runners/local_workers.py), or None.

    Only for Beam's multi-process DirectRunner (``workers`` > 0): the one the command line started before
    importing Beam, or a new one (a build run in-process, e.g. by tests).
    """
    global _WARM
    warm, _WARM = _WARM, None
    if not workers or not local_workers.enabled():
        if warm is not None:
            warm.close()
        return None
    if warm is None:
        warm = local_workers.WarmProcess({"tokenizer": args.options.tokenizer,
                                          "backend": args.options.tokenizer_backend,
                                          "verify_every": args.options.verify_every})
    return warm


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (``python -m pipelines.build_cache``, ``chunkledger-build``).

    Prints the progress line (pipelines/runners/progress_line.py) and, on a failure, one message and the path of the full
    log: the launcher's stderr, and so its workers', goes to that log file (pipelines/faults.py); ``--debug``
    shows everything on the console instead. Exit 2 on a BuildError, 1 on an EnvironmentFault or an
    unexpected error, 130 on Ctrl-C (one line: the workers exit quietly).
    """
    _on_interrupt(signal.default_int_handler)  # replaces the launcher's handler of its first seconds
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    log = None if debug else faults.BuildLog.start(argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    root = logging.getLogger()
    saved_level, quiet, saved_hook = root.level, faults.HideRunnerTracebacks(), threading.excepthook
    console = progress_line.Console(sys.stderr, show=progress_line.enabled(), log=log.file if log is not None else None)
    consoles = {h: h.level for h in root.handlers if isinstance(h, logging.StreamHandler)}
    for h in consoles:
        h.addFilter(console.log_filter)  # last: called only for a record the handler prints
    if debug:
        root.setLevel(logging.INFO)
    else:
        for h in consoles:
            h.filters.insert(0, quiet)
            h.setLevel(max(h.level, logging.WARNING))
        if log is not None:
            root.addHandler(log.handler)
            root.setLevel(logging.INFO)  # every record goes to the log file; the console shows warnings
            threading.excepthook = log.thread_exception  # a runner's threads dying with a killed worker
        # Worker start-up notices forwarded by the local job service (harmless, and noisy on every run).
        logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
    trace.event("launcher_imported", gc_enabled=gc.isenabled(), gc_frozen=gc.get_freeze_count())
    code = 0
    try:
        run(argv, console=console)
    except BuildError as e:
        caused = isinstance(e, EnvironmentFault) and e.__cause__ is not None
        if debug and caused:
            raise
        console.clear()
        # after the job started, the workers' side of the story is in the log
        details = f"\n(details: {log.keep(e)}; --debug prints them)" if log and (caused or console.job_started) else ""
        print(f"error: {e}{details}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command is ending: no second traceback
        console.clear()
        print(f"interrupted. {faults.RERUN}", file=sys.stderr)
        code = 130
    except Exception as e:  # noqa: BLE001 - a bug or an unforeseen environment failure: one line and a log
        if debug:
            raise
        console.clear()
        where = (f"the traceback is in {log.keep(e)} (--debug prints it)" if log
                 else "rerun with --debug for the traceback")
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"error: unexpected failure ({type(e).__name__}: {first}); {where}. {faults.RERUN}", file=sys.stderr)
        code = 1
    finally:
        if _WARM is not None:  # the run ended before it needed the warm process
            _WARM.close()
        if log is not None:
            root.removeHandler(log.handler)
        root.setLevel(saved_level)
        for h, level in consoles.items():
            h.removeFilter(quiet)
            h.removeFilter(console.log_filter)
            h.setLevel(level)
        threading.excepthook = saved_hook
        if log is not None:
            log.close()
    trace.event("launcher_exit")
    if code == 130:
        # A runner's threads may still be running the interrupted job (an in-process job service): they
        # would print its failure, or hold the exit, while the interpreter shuts down.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
    gc.freeze()  # the interpreter's exit would otherwise walk every live object once more
