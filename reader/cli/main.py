"""Command line: ``python -m reader inspect|validate|batches|report|export|import-megatron|import-flat-tokens``.

Also installed as the ``chunkledger`` script.

* ``inspect``  what a cache holds: documents, tokens, chunks, tokenizer, length percentiles; for a
  mixture file, each component's weights per schedule segment and the passes N steps take.
* ``validate`` check every chunk against the ledger (size, sha256, Parquet layout, counts, sidecars);
  exits non-zero on any problem.
* ``batches``  write one reader's rows of some batches to an ``.npz`` file, to look at any batch of a run;
  ``--show`` prints them decoded.
* ``report``   one HTML page about a cache or a mixture: summary, histograms, bad records, decoded batches
  (``reader/cli/report.py``, ``reader/report/``).
* ``export``   write a cache as Megatron ``.bin``/``.idx`` or seqax flat-tokens (``reader/interop/export.py``).
* ``import-megatron``, ``import-flat-tokens``  turn Megatron ``.bin``/``.idx`` files or a seqax flat-tokens
  dataset into a cache (``reader/interop/import_megatron.py``, ``reader/interop/import_flat_tokens.py``), the tokenizer's
  identity taken from a cache or a JSON file (``--tokenizer_from``; ``python -m pipelines.interop`` takes
  a tokenizer spec instead).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import sys

import numpy as np

from reader.cli import report as report_cli
from reader.cli import support as cli_support
from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.storage import fields, views
from reader.storage.cache import Cache
from reader.storage.index import check_index_files
from reader.interop.export import write_file
from reader.mixture.mixture_file import is_mixture_path
from reader.options import ReadOptions
from reader.reader import Reader
from reader.batch.schema import BATCH_KEYS, VARLEN_FIELDS
from reader.report import summary
from reader.report.figures import RowPacking, row_packing
from reader.storage.progress import counted, describe as describe_progress, read_progress
from reader.storage.validate import validate_chunk, validate_ledger, validate_shards


def _read_options(args, **kw) -> ReadOptions:
    """The read options of ``inspect`` and ``report``: what decides the rows of a pass."""
    return ReadOptions(seq_len=args.seq_len, batch_size=args.batch_size, ideal_readers=args.ideal_readers,
                       pass_rule=args.pass_rule, **report_cli.packing_options(args), **kw)


def _passes_lines(p: dict) -> list[str]:
    """``inspect``'s lines about passes (:func:`reader.report.summary.cache_passes`)."""
    rows = {"concat": f"whole rows of {p['seq_len']:,} tokens", "unpacked": f"document pieces of <= {p['seq_len']:,} "
            "tokens", "best_fit": f"best-fit rows of {p['seq_len']:,} tokens"}[p["packing"]]
    E = p["examples_per_pass"]
    rule = p["pass_rule"] + (f" (the default for format version {p['format_version']})" if p["rule_by_version"] else "")
    lines = [f"passes      a pass is {E:,} examples ({rows}); pass rule {rule}: "
             + ("every pass serves each of them once" if p["pass_rule"] == "spans" else
                f"{p['ideal_readers']} streams loop over the chunks")]
    if p["repeated_rows"]:
        share = p["repeated_rows"] / E
        lines.append(f"WARNING     about {share:.0%} of the rows of each pass are served twice within it "
                     f"(ideal_readers {p['ideal_readers']}); --pass_rule spans serves every row once per pass")
    if "steps" in p:
        passes = "-" if p["passes"] is None else f"{p['passes']:.3f}"
        lines.append(f"steps       {p['steps']:,} steps x batch_size {p['batch_size']} = {p['examples']:,} examples: "
                     f"{passes} passes")
    return lines


def cmd_inspect_mixture(args) -> int:
    if args.steps is not None and args.steps < 0:
        print("error: --steps must be >= 0", file=sys.stderr)
        return 2
    opts = _read_options(args)
    info = summary.mixture_summary(args.path, opts, args.steps)
    if args.json:
        print(fmt.dumps(info), end="")
        return 0
    comps, names = info["components"], [c["name"] for c in info["components"]]
    w = max(9, *(len(n) for n in names))
    print(f"mixture     {args.path}  ({len(comps)} components, seed {info['seed']}, block {info['block']})")
    tok = info["tokenizer"]
    print(f"tokenizer   {tok.get('spec')} (kind={tok.get('kind')}, vocab_size={tok.get('vocab_size')}, "
          f"hash={str(tok.get('hash'))[:16]})")
    print()
    print(f"{'component':<{w}}  {'tokens':>16}  {'documents':>13}  {'chunks':>8}  state     path")
    for c in comps:
        state = "finished" if c["finished"] else "BUILDING"
        print(f"{c['name']:<{w}}  {c['tokens']:>16,}  {c['documents']:>13,}  {c['chunks']:>8,}  {state:<8}  "
              f"{c['path']}")
    print()
    heads = (f"{'from batch ' + format(g['start_batch'], ','):>18}" for g in info["segments"])
    print(f"{'weights':<{w}}  " + "  ".join(heads))
    for n in names:
        print(f"{n:<{w}}  " + "  ".join(f"{g['weights'][n]:>18.4f}" for g in info["segments"]))
    print()
    print(f"{'passes':<{w}}  {'examples/pass':>16}  rule     max_passes")
    for c in comps:
        limit = "-" if c["max_passes"] is None else f"{c['max_passes']:g}"
        warn = f"  WARNING: about {c['repeated_rows'] / c['examples_per_pass']:.0%} of a pass served twice within it" \
            if c["repeated_rows"] else ""
        print(f"{c['name']:<{w}}  {c['examples_per_pass']:>16,}  {c['pass_rule']:<7}  {limit:<10}{warn}")
    st = info.get("steps")
    if st is not None:
        print()
        print(f"{st['steps']:,} steps x batch_size {st['batch_size']} (seq_len {st['seq_len']}, ideal_readers "
              f"{st['ideal_readers']}): {st['examples']:,} examples, {st['examples'] * st['seq_len']:,} tokens")
        print(f"{'component':<{w}}  {'examples':>16}  {'tokens':>18}  passes")
        for c in comps:
            passes = "-" if c["passes"] is None else f"{c['passes']:.3f}"
            note = "" if c["finished"] else "  (of the examples written so far: the build is running)"
            print(f"{c['name']:<{w}}  {c['examples_drawn']:>16,}  {c['tokens_drawn']:>18,}  {passes}{note}")
        if "refused_from" in st:
            print(f"WARNING: max_passes refuses step {st['refused_from']['step']:,}: {st['refused_from']['error']}")
    return 0


def cmd_inspect(args) -> int:
    if is_mixture_path(args.path):
        return cmd_inspect_mixture(args)
    if args.steps is not None and args.steps < 0:
        print("error: --steps must be >= 0", file=sys.stderr)
        return 2
    opts = _read_options(args)
    memory, rows = _reader_memory(args) if args.read_batches else (None, None)  # first: inspect's reads add to the RSS
    cache = Cache(args.path)
    info, _ = summary.cache_summary(cache, args.path, max_chunks=args.max_chunks, threads=args.threads,
                                    seq_len=args.seq_len)
    info["passes"] = summary.cache_passes(cache, opts, args.steps)
    n = info["chunks"]
    progress = None if cache.complete else read_progress(cache)
    if progress is not None:
        info["progress"] = progress.as_dict()
    if memory is not None:
        info["memory"] = memory
        info["rows"] = dataclasses.asdict(rows)
    if args.view:  # documents and tokens the view keeps and drops, per input
        info["view"] = views.tally(cache, args.view)
    if args.by:  # documents and tokens per value of a kept field
        info["by"] = {args.by: [{"value": v, "documents": d, "tokens": n} for v, (d, n) in
                                fields.tally(cache, args.by).items()]}
    if args.json:
        print(fmt.dumps(info), end="")
        return 0
    state = "finished" if cache.complete else "BUILD IN PROGRESS (showing the chunks written so far)"
    print(f"cache       {args.path}  [{state}]")
    print(f"documents   {info['documents']:,}")
    print(f"tokens      {info['tokens']:,}")
    print(f"chunks      {n:,} ({info['empty_chunks']} empty), {info['bytes']:,} bytes, from "
          f"{counted(info['inputs'], 'input shard')}")
    tok = info["tokenizer"]
    print(f"tokenizer   {tok.get('spec')} (kind={tok.get('kind')}, vocab_size={tok.get('vocab_size')}, "
          f"eos_id={tok.get('eos_id')}, hash={str(tok.get('hash'))[:16]})")
    bad = info["bad_records"]
    print(f"bad records {sum(bad.values()) if bad else 0} {bad if bad else ''}".rstrip())
    pct = "  ".join(f"{k}={v}" for k, v in info["doc_length_percentiles"].items())
    print(f"doc length  {pct}  (tokens; {info['length_sample']})")
    pct = "  ".join(f"{k}={v}" for k, v in info["tokens_per_chunk_percentiles"].items())
    print(f"chunk size  {pct}  (tokens)")
    if "loss_tokens" in info:
        share = info["loss_token_share"]
        print(f"loss tokens {info['loss_tokens'] if info['loss_tokens'] is not None else 'unknown'}"
              + (f" ({share:.1%} of tokens)" if share is not None else "")
              + f"  (record_format {cache.ledger.config.get('record_format')}: loss_mask is True on these only)")
    long = info["longer_than_seq_len"]
    print(f"long docs   {long['documents']:,} longer than --seq_len {long['seq_len']} ({long['tokens']:,} tokens; "
          f"{info['length_sample']}): what ReadOptions(drop_long=True) skips")
    for line in _passes_lines(info["passes"]):
        print(line)
    if progress is not None:  # a running build: how far it is, from every chunk written (not only the prefix)
        print("progress    " + "\n            ".join(describe_progress(progress, readable=n)))
    if args.read_batches:
        m = {k: v / 2**20 for k, v in info["memory"].items()}
        print(f"memory      reading {args.read_batches} batches, at most: budget {m['budget']:.0f} MiB: decoded row groups "
              f"{m['decoded']:.1f} MiB, batches read ahead up to "
              f"{m['ahead_limit']:.1f} MiB; process RSS {m['rss']:.0f} MiB (the interpreter, numpy and pyarrow "
              "alone: about 70 MiB)")
        print(f"rows        {rows.describe()} ({report_cli.packing_of(args)})")
    if "view" in info:
        print("\n".join(views.describe(info["view"])))
    for name, rows in info.get("by", {}).items():
        w = max([len(name) + 3] + [len(str(r["value"])) for r in rows])
        print(f"\n{'by ' + name:<{w}}  {'documents':>14}  {'tokens':>18}")
        for r in rows:
            print(f"{'(none)' if r['value'] is None else r['value']:<{w}}  {r['documents']:>14,}  {r['tokens']:>18,}")
    return 0


def _reader_memory(args) -> tuple[dict[str, int], RowPacking]:
    """A reader's memory at its peak over ``--read_batches`` batches read as a training run would, and how
    full their rows are."""
    opts = _read_options(args, shuffle_seed=args.shuffle_seed, memory_budget_bytes=args.memory_budget_bytes)
    peak: dict[str, int] = {}  # the moment the reader held the most, and the process's largest RSS
    seen = []  # each batch's segment_ids and valid rows
    with Reader(args.path, opts) as r:
        for _, x in r.iter_batches(0, args.read_batches):
            seen.append({k: x[k].copy() for k in ("segment_ids", "valid")})
            got = r.memory()
            if got["decoded"] >= peak.get("decoded", 0):
                peak = dict(got, rss=max(got["rss"], peak.get("rss", 0)))
            peak["rss"] = max(got["rss"], peak["rss"])
    return peak, row_packing(seen)


def _sample(n: int, sample: float | None, seed: int) -> np.ndarray:
    """The chunks ``validate`` checks: all, or a deterministic sample (``sample`` chunks, or that fraction of
    them when below 1), in order."""
    if not sample:
        return np.arange(n)
    k = min(n, max(1, round(sample * n)) if sample < 1 else int(sample))
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


def cmd_validate(args) -> int:
    try:
        cache = Cache(args.path)
    except fmt.DamagedCache as e:  # a damaged ledger is a problem found; not a cache at all is an error (2)
        print(f"PROBLEM {e}")
        return 1
    t = cache.table
    chosen = _sample(len(t), args.sample, args.seed)
    sampled = len(chosen) < len(t)
    shards = sorted(set(t.shard[chosen].tolist())) if sampled else None
    problems = validate_ledger(cache) + validate_shards(cache, shards)
    step = 1 << 14  # chunks whose records are fetched together (a table's block)
    with cf.ThreadPoolExecutor(args.threads) as pool:
        for lo in range(0, len(chosen), step):
            part = chosen[lo:lo + step].tolist()
            try:
                entries = chunk_table.recorded_rows(t, cache.ledger.raw, part) if cache.complete else {}
            except fmt.DamagedCache as e:  # a damaged table block (validate_ledger named it too)
                problems.append(str(e))
                entries = None
            if entries is None:
                continue
            for got in pool.map(lambda c: validate_chunk(cache, c, decode=not args.quick, entry=entries.get(c)), part):
                problems += got
    if not args.quick:  # the reader's own index files, counted again from the chunks
        view_problems, checked_views = views.check_view_files(cache)
        problems += view_problems + check_index_files(cache, checked_views)
    for p in dict.fromkeys(problems):
        print(f"PROBLEM {p}")
    state = "" if cache.complete else " (build in progress: only the chunks written so far were checked)"
    which = (f"{len(chosen):,} of {len(t):,} chunks (--sample {args.sample:g} --seed {args.seed}: their shards' "
             "directories, the whole ledger and table)") if sampled else counted(len(t), "chunk")
    if problems:
        print(f"{len(dict.fromkeys(problems))} problem(s) in {args.path}{state}, checking {which}. Rerun the build "
              "command to repair missing chunks (delete damaged chunks and their .json sidecars first).")
        return 1
    print(f"OK: {which}, {counted(int(t.docs.sum()), 'document')}, {counted(int(t.tokens.sum()), 'token')} match "
          f"the ledger{state}")
    return 0


def cmd_batches(args) -> int:
    opts = _read_options(args, eval_mode=args.eval, shuffle_seed=args.shuffle_seed)
    if args.count < 0 or (args.count == 0 and not args.eval):
        print("error: --count must be positive (0 = to the end, only with --eval)", file=sys.stderr)
        return 2
    if not args.out and not args.show:
        print("error: give --out FILE.npz (the arrays), --show (the rows decoded) or both", file=sys.stderr)
        return 2
    with Reader(args.path, opts, num_readers=args.num_readers, reader_index=args.reader_index,
                wait_timeout_s=args.wait_timeout_s) as r:
        got = list(r.iter_batches(start=args.start, count=args.count or None))
    if not got:
        print(f"no batches: the eval pass has {r.num_batches} batches, --start was {args.start}", file=sys.stderr)
        return 1
    if args.show:
        report_cli.show_rows(r, got, args.tokenizer)
    if not args.out:
        return 0
    arrays = {k: np.stack([b[k] for _, b in got]) for k in BATCH_KEYS + VARLEN_FIELDS * args.varlen}
    arrays["batch_index"] = np.asarray([b for b, _ in got], dtype=np.int64)
    arrays["rows"] = r.my_rows
    arrays["options"] = np.asarray(json.dumps({
        "path": args.path, "seq_len": args.seq_len, "batch_size": args.batch_size,
        "packing": report_cli.packing_of(args), "best_fit_window_tokens": args.best_fit_window_tokens, "drop_long": args.drop_long,
        "best_fit_continuations": args.best_fit_continuations, "max_segments": args.max_segments, "varlen": args.varlen,
        "ideal_readers": args.ideal_readers, "eval_mode": args.eval, "shuffle_seed": args.shuffle_seed,
        "num_readers": args.num_readers, "reader_index": args.reader_index, "pass_rule": args.pass_rule,
        **({"view": args.view} if args.view is not None else {})}, sort_keys=True))
    write_file(args.out, lambda f: np.savez_compressed(f, **arrays))  # exactly --out (numpy would add .npz)
    print(f"wrote {args.out}: batches {arrays['batch_index'][0]}..{arrays['batch_index'][-1]}, "
          f"{len(r.my_rows)} rows each, keys {', '.join(sorted(arrays))}")
    return 0


def cmd_index(args) -> int:
    """Count the examples of every chunk for one read's options and write the index file readers load."""
    import time

    from reader.storage.index import ExampleIndex
    from reader.storage.views import open_view

    packing = args.packing
    opts = (ReadOptions(seq_len=args.seq_len, packing="best_fit", best_fit_window_tokens=args.best_fit_window_tokens,
                        drop_long=args.drop_long, best_fit_continuations=args.best_fit_continuations,
                        max_segments=args.max_segments) if packing == "best_fit" else
            ReadOptions(seq_len=args.seq_len, packing="unpacked", drop_long=args.drop_long))
    cache = Cache(args.path)
    if not cache.complete:
        print(f"error: {args.path}: the build is still running; an index file is of a finished cache", file=sys.stderr)
        return 1
    caps = {"continuations": opts.continuations(int(cache.ledger.raw["format_version"])),
            "max_segments": opts.max_segments} if packing == "best_fit" else {}
    t0 = time.perf_counter()
    view, seen = open_view(cache, args.view)  # (a view's kept counts are stored beside, in its own index file)
    index = ExampleIndex(seen, opts.seq_len, packing, window_tokens=opts.best_fit_window_tokens, drop_long=opts.drop_long,
                         threads=args.threads, view=view, **caps)
    counts = index.counts(seen.table)
    dt = time.perf_counter() - t0
    n = len(cache.table)
    what = (f"counted in {dt:.1f} s ({1000 * dt / max(n, 1):.2f} ms per chunk with {args.threads} threads)"
            if index.counted else "already there, checked against the table: nothing counted")
    print(f"{cache.display(index.index_file)}: {int(counts.sum()):,} {packing} examples of {n:,} chunks, {what}")
    if view is not None:
        print(f"{cache.display(view.index_file)}: the documents and tokens view {view.spec.text!r} keeps of each chunk")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m reader", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("inspect", help="documents, tokens, chunks, tokenizer and length percentiles; for a "
                                       "mixture file, each component's weights and passes",
                       description="A cache: documents, tokens, chunks, tokenizer and length percentiles, and what a "
                                   "pass of a training read is (its examples at --seq_len and --packing, the pass "
                                   "rule, a warning when the rule serves rows twice within a pass); with --steps N "
                                   "how many passes N training steps make. A mixture file (*.json): each "
                                   "component's tokens, weight per schedule segment and pass, and with --steps N "
                                   "how many examples, tokens and passes over each component N training steps "
                                   "draw, and the step a component's max_passes refuses.")
    q.add_argument("path", help="cache root (local path or gs://bucket/cache), or a mixture file (*.json)")
    q.add_argument("--steps", type=int, default=None,
                   help="show how many passes N global batches make (a mixture: over each component)")
    q.add_argument("--seq_len", type=int, default=ReadOptions.seq_len,
                   help=f"tokens per example, for passes; a cache: also count the documents longer than "
                        f"this, which ReadOptions(drop_long=True) skips (default {ReadOptions.seq_len})")
    q.add_argument("--batch_size", type=int, default=ReadOptions.batch_size,
                   help=f"with --steps: GLOBAL batch size, also where schedule segments start "
                        f"(default {ReadOptions.batch_size})")
    q.add_argument("--ideal_readers", type=int, default=ReadOptions.ideal_readers,
                   help=f"R* of the run (default {ReadOptions.ideal_readers})")
    cli_support.add_pass_rule(q)
    q.add_argument("--max_chunks", type=int, default=1000,
                   help="read document lengths (for the percentiles) from at most this many chunks, spread "
                        "evenly over the cache (default 1000; 0 = all). Counts always cover every chunk.")
    q.add_argument("--json", action="store_true", help="print JSON instead of text")
    q.add_argument("--threads", type=int, default=8, help="parallel chunk reads")
    q.add_argument("--read_batches", type=int, default=0, metavar="N",
                   help="cache: read N batches (--seq_len, --batch_size, --ideal_readers, --shuffle_seed, "
                        "--memory_budget_bytes, and how rows are made: --packing ...) and show the reader's "
                        "memory against its budget, and the rows' padding and document pieces per row; "
                        "--packing also decides what a pass is, for --steps")
    q.add_argument("--shuffle_seed", type=int, default=None, help="with --read_batches: shuffle")
    report_cli.add_packing_arguments(q)  # (with --read_batches: how the rows are made)
    q.add_argument("--memory_budget_bytes", type=int, default=ReadOptions.memory_budget_bytes,
                   help=f"with --read_batches: the reader's budget (default {ReadOptions.memory_budget_bytes})")
    q.add_argument("--by", metavar="FIELD", help="documents and tokens per value of FIELD, a field the build kept "
                                                 "(--keep_fields); reads that field of every chunk")
    q.set_defaults(fn=cmd_inspect)

    v = sub.add_parser("validate", help="check every chunk against the ledger (and, without --quick, the readers' "
                                        "index and view files); exit 1 on any problem")
    v.add_argument("path", help="cache root (local path or gs://bucket/cache)")
    v.add_argument("--quick", action="store_true", help="skip decoding token columns (size, checksum, layout only)")
    v.add_argument("--threads", type=int, default=4, help="parallel chunk reads")
    v.add_argument("--sample", type=float, default=None, metavar="N",
                   help="check N chunks (a fraction of them if below 1) drawn by --seed, their shards' files, and the "
                        "whole ledger and chunk table: for a cache too large to read every chunk (default: every chunk)")
    v.add_argument("--seed", type=int, default=0, help="with --sample: which chunks (the same seed, the same chunks)")
    v.set_defaults(fn=cmd_validate)

    b = sub.add_parser("batches", help="write one reader's rows of some batches to an .npz file",
                       description="Writes arrays shaped [count, rows, ...] for the keys "
                                   f"{', '.join(BATCH_KEYS)}, plus batch_index [count] and rows (this reader's "
                                   "row numbers within each global batch). Same arguments as the training "
                                   "run give the same arrays.")
    b.add_argument("path", help="cache root (local path or gs://bucket/cache), or a mixture file (*.json)")
    b.add_argument("--seq_len", type=int, required=True, help="tokens per example (L)")
    b.add_argument("--batch_size", type=int, required=True, help="GLOBAL batch size (B)")
    report_cli.add_packing_arguments(b)
    b.add_argument("--ideal_readers", type=int, default=ReadOptions.ideal_readers,
                   help=f"R*, number of streams (default {ReadOptions.ideal_readers}); must match the run")
    b.add_argument("--num_readers", type=int, default=1, help="R, reader hosts (must divide batch_size)")
    b.add_argument("--reader_index", type=int, default=0, help="r, this reader, in [0, R)")
    b.add_argument("--start", type=int, default=0, help="first batch (= training step)")
    b.add_argument("--count", type=int, default=1, help="number of batches (0 with --eval: to the end of the pass)")
    b.add_argument("--eval", action="store_true", help="single pass in global order, last batch padded")
    b.add_argument("--shuffle_seed", type=int, default=None, help="growing-window shuffle seed (training)")
    cli_support.add_pass_rule(b)
    b.add_argument("--wait_timeout_s", type=float, default=600.0,
                   help="while a build runs: seconds to wait for chunks not yet written")
    b.add_argument("--out", default=None, help="output .npz file")
    report_cli.add_show_arguments(b)  # --show: the rows decoded in the terminal
    b.set_defaults(fn=cmd_batches)

    x = sub.add_parser("index", help="count every chunk's unpacked examples or best-fit rows for one seq_len, once, "
                                     "into the index file readers load (ahead of a large job)",
                       description="Readers of unpacked or best-fit examples need each chunk's example count for "
                                   "their seq_len; the first reader counts them (reading every chunk's num_tokens "
                                   "column) and stores them in ROOT/index/. For a large cache, run this once before "
                                   "the job instead of letting its first hosts do it (docs/READING.md).")
    x.add_argument("path", help="cache root (local path or gs://bucket/cache), finished")
    x.add_argument("--seq_len", type=int, required=True, help="tokens per example (L)")
    x.add_argument("--packing", choices=("unpacked", "best_fit"), default="unpacked",
                   help="unpacked examples (one document piece per row) or best-fit rows")
    x.add_argument("--drop_long", action="store_true", help="count as ReadOptions(drop_long=True) reads")
    x.add_argument("--best_fit_window_tokens", type=int, default=ReadOptions.best_fit_window_tokens,
                   help="best_fit: the window target of the run")
    x.add_argument("--best_fit_continuations", type=int, default=None,
                   help="best_fit: continuation pieces per row, at most (default: as the cache's format version "
                        "says); must match the run")
    x.add_argument("--max_segments", type=int, default=None,
                   help="best_fit: at most this many document pieces per row; must match the run")
    x.add_argument("--view", metavar="VIEW", default=None,
                   help="count the examples of the documents VIEW keeps (ReadOptions.view's syntax); its own index "
                        "file of kept counts is written too")
    x.add_argument("--threads", type=int, default=32, help="chunks counted at once (each a footer and a column read)")
    x.set_defaults(fn=cmd_index)

    from reader.cli import export as export_cli  # Megatron and seqax formats (docs/INTEROP.md)
    from reader.interop import import_flat_tokens  # Megatron and seqax formats (docs/INTEROP.md)
    from reader.interop import import_megatron  # Megatron and seqax formats (docs/INTEROP.md)

    export_cli.add_parser(sub)
    import_megatron.add_parser(sub)
    import_flat_tokens.add_parser(sub)
    report_cli.add_parser(sub)  # one HTML page about a cache (reader/report/)
    cli_support.finish_parsers(p, sub)  # --debug, examples and exit status in every --help
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return cli_support.run(args.fn, args)


if __name__ == "__main__":
    sys.exit(main())
