"""The build's progress line: documents, tokens, input MB done of the total, rate, ETA and bad records.

The launcher learns progress from the output, as a reader following the build would, with no channel
from the workers: a worker writes each finished chunk's sidecar last (atomically, after the Parquet file
and the dead letters), and a sidecar says the chunk's documents, tokens, bad records and byte range of
uncompressed input; a compressed shard's ``_DONE.json`` says its uncompressed size. :class:`Scanner` sums
what the reader's scan (:class:`reader.storage.progress.Scan`, over the builder's file system) finds in
each cache of the build. Input done = the sum of the finished chunks' byte ranges (uncompressed bytes).

The total: an uncompressed shard's size; a compressed shard's exact uncompressed size once its
``_DONE.json`` exists, and until then its size as stored times a compression ratio: that of the finished
shards of the same compression, else that of the first MiBs of one such shard (decompressed once, on the
progress thread), else :data:`pipelines.plan.COMPRESSION_RATIO_GUESS`. While a total holds an estimate it
is shown with ``~`` and the percentage stops at 99.9 until the build ends.

:class:`Watcher` scans on its own thread (every second for a local output, every 15 s on ``gs://``; never
more than 1/:data:`SCAN_SHARE` of the time, however long a listing takes) and writes to a :class:`Console`:
one line rewritten in place on a terminal, else a plain line every ``$CHUNKLEDGER_PROGRESS_INTERVAL``
seconds (10). ``CHUNKLEDGER_PROGRESS=0`` turns it off. A progress error is logged once and stops the
line: it never fails or stops the build.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import logging
import os
import re
import threading
import time
from typing import Any, Mapping, TextIO

from reader.format import spec as fmt
from reader.format.splits import cache_roots
from reader.format.spec import TABLE_VERSION
from reader.storage.progress import Scan, counted, format_seconds

from pipelines.filesystem import BEAM, is_remote
from pipelines.inputs.decompress import open_raw
from pipelines.plan import COMPRESSION_RATIO_GUESS, BuildPlan, InputFile

LOG = logging.getLogger("chunkledger.build")

ENV_SWITCH = "CHUNKLEDGER_PROGRESS"
ENV_INTERVAL = "CHUNKLEDGER_PROGRESS_INTERVAL"
PLAIN_INTERVAL = 10.0  # seconds between lines when stderr is not a terminal
LOCAL_POLL = 1.0  # seconds between scans of a local output (a terminal's line)
REMOTE_POLL = 15.0  # ... of a gs:// output (listings are round trips)
SCAN_SHARE = 50  # wait at least this many times as long as the last scan took: it costs at most ~2% of a core
SAMPLE_BYTES = 4 << 20  # uncompressed bytes decoded to estimate a compression ratio


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def plain_interval() -> float:
    try:
        return max(0.05, float(os.environ[ENV_INTERVAL]))
    except (KeyError, ValueError):
        return PLAIN_INTERVAL


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the output shows finished: counts of every cache of the build, bytes of input (uncompressed)."""

    docs: int
    tokens: int
    bad_records: int
    done_bytes: int
    total_bytes: int
    estimated: bool  # the total holds an estimate (a compressed shard not finished yet)
    complete: bool = False  # the build finished (its ledger)

    @staticmethod
    def of_ledgers(ledgers: Mapping[Any, Mapping[str, Any]]) -> "Snapshot":
        """The finished build, from its ledgers' totals (a split build's documents and tokens summed)."""
        totals = [led["totals"] for led in ledgers.values()]
        size = totals[0]["uncompressed_bytes"]
        return Snapshot(docs=sum(t["docs"] for t in totals), tokens=sum(t["tokens"] for t in totals),
                        bad_records=sum(t["bad_records"] for t in totals), done_bytes=size, total_bytes=size,
                        estimated=False, complete=True)


class Scanner:
    """Sums the sidecars a build has written so far into ``output`` (see the module doc).

    Args:
      output: the build's output (a split build's caches are under it).
      plan: the build plan (inputs, their sizes and compression).
    """

    def __init__(self, output: str, plan: BuildPlan):
        self.inputs: tuple[InputFile, ...] = plan.inputs
        self.remote = is_remote(output)
        entries = plan.format_version >= TABLE_VERSION  # (an older cache's rerun: its earlier chunks have no entry)
        self.scans = [Scan(BEAM, root, len(plan.inputs), entries=entries) for root in cache_roots(output, plan.split)]
        self._sampled: dict[str, float | None] = {}

    def scan(self) -> Snapshot:
        docs = tokens = bad = 0
        done_by_shard: dict[int, int] = collections.Counter()
        finished: dict[int, int] = {}  # compressed shard -> uncompressed size (its _DONE.json)
        for i, scan in enumerate(self.scans):  # the first cache has every input byte; all have documents
            for w in scan.scan():
                if w.done is not None:
                    if i == 0 and isinstance(w.done.get("uncompressed_bytes"), int):
                        finished[w.shard] = w.done["uncompressed_bytes"]
                    continue
                docs += w.entry["docs"]
                tokens += w.entry["tokens"]
                bad += int(w.entry.get("bad_records", 0))
                if i == 0:
                    inp = self.inputs[w.shard]
                    done_by_shard[w.shard] += fmt.chunk_input_bytes(w.entry, inp.size, inp.rows)
        total, estimated = 0, False
        for inp in self.inputs:
            if inp.compression == "none":
                total += inp.size
            elif inp.shard in finished:
                total += finished[inp.shard]
            else:
                estimated = True
                guess = int(inp.size * self._ratio(inp.compression, finished))
                total += max(guess, done_by_shard[inp.shard])
        return Snapshot(docs=docs, tokens=tokens, bad_records=bad, done_bytes=sum(done_by_shard.values()),
                        total_bytes=total, estimated=estimated)

    def _ratio(self, compression: str, finished: dict[int, int]) -> float:
        """Uncompressed bytes per stored byte of this compression's shards (see the module doc)."""
        done = [(inp.size, finished[inp.shard]) for inp in self.inputs
                if inp.compression == compression and inp.shard in finished and inp.size]
        if done:
            return sum(u for _, u in done) / sum(s for s, _ in done)
        if compression not in self._sampled:
            first = next(inp for inp in self.inputs if inp.compression == compression)
            try:
                self._sampled[compression] = sample_ratio(first.path, compression)
            except Exception:  # noqa: BLE001 - unreadable now: the workers report it; guess meanwhile
                self._sampled[compression] = None
        return self._sampled[compression] or COMPRESSION_RATIO_GUESS


def sample_ratio(path: str, compression: str, want: int = SAMPLE_BYTES) -> float | None:
    """Uncompressed bytes per stored byte over the first ``want`` uncompressed bytes of ``path`` (None if
    nothing decodes: a damaged file, which the workers report)."""
    got = 0
    with open_raw(path) as raw:
        if compression == "gzip":
            decoder = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            import zstandard

            # small reads: the stored bytes consumed (raw.tell()) then overshoot by little
            decoder = zstandard.ZstdDecompressor().stream_reader(raw, read_size=16 << 10, read_across_frames=True,
                                                                 closefd=False)
        try:
            while got < want:
                piece = decoder.read(min(want - got, 1 << 20))
                if not piece:
                    break
                got += len(piece)
        except Exception:  # noqa: BLE001 - damaged: estimate from what decoded
            pass
        used = raw.tell()
    return got / used if got and used else None


class Console:
    """Where the launcher's messages go (its stderr): the progress line, rewritten in place on a terminal.

    Args:
      stream: the console (a text stream).
      show: print progress at all (:func:`enabled`).
      log: where anything else written to ``sys.stderr`` while the job runs goes (a runner running its
        workers in-process prints their tracebacks there), None to leave ``sys.stderr`` alone.
    """

    def __init__(self, stream: TextIO, show: bool = True, log: TextIO | None = None):
        self.stream = stream
        self.show_progress = show
        self.log = log
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.interval = plain_interval()
        self.job_started = False  # the pipeline was submitted: a failure's details are in the workers' output
        self._lock = threading.Lock()
        self._open = False  # a progress line is on the terminal, not ended by a newline

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 80
        except (AttributeError, OSError, ValueError):
            return 80

    def show(self, text: str) -> None:
        """An updated progress line: rewritten in place on a terminal, else a line of its own."""
        with self._lock:
            if self.tty:
                self.stream.write("\r" + fit(text, self._width() - 1) + "\x1b[K")
                self._open = True
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def end(self, text: str) -> None:
        """The last progress line, kept on the screen."""
        with self._lock:
            self.stream.write(("\r" + fit(text, self._width() - 1) + "\x1b[K\n") if self.tty else text + "\n")
            self.stream.flush()
            self._open = False

    def clear(self) -> None:
        """Erase a progress line being rewritten (before a log record or an error is printed)."""
        with self._lock:
            if self._open:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._open = False

    def log_filter(self, record: logging.LogRecord) -> bool:
        """A logging filter for console handlers: the record then starts on a clean line."""
        self.clear()
        return True


class Watcher:
    """Scans the output on a daemon thread and shows the progress line (see the module doc).

    Args:
      console: where the line goes.
      scanner: what it shows.
    """

    def __init__(self, console: Console, scanner: Scanner):
        self.console, self.scanner = console, scanner
        if console.tty:
            self.poll = REMOTE_POLL if scanner.remote else LOCAL_POLL
        else:  # a line per interval (on gs://, no more often than a listing is worth)
            self.poll = max(console.interval, REMOTE_POLL) if scanner.remote else console.interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chunkledger-progress", daemon=True)
        self.t0 = time.monotonic()
        self.base: int | None = None  # input bytes done when the run started (chunks an earlier run left)

    def start(self) -> "Watcher":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def _loop(self) -> None:
        wait, first = 0.0, True
        while not self._stop.wait(wait):
            started = time.monotonic()
            try:
                snap = self.scanner.scan()
            except Exception as e:  # noqa: BLE001 - progress is a report, never a reason to fail
                LOG.warning("no progress line from now on (%s: %s); the build goes on", type(e).__name__, e)
                return
            took = time.monotonic() - started
            if self.base is None:
                self.base = snap.done_bytes
            if (self.console.tty or not first) and not self._stop.is_set():
                self.console.show(self.line(snap))
            # the first scan reads what an earlier run left and samples compressed inputs: not a listing's cost
            wait = self.poll if first else max(self.poll, SCAN_SHARE * took)
            first = False

    def stop(self) -> None:
        """Stop updating the line (it stays until :meth:`finish` or :meth:`Console.clear`). The thread is not
        waited for long: a slow listing on ``gs://`` ends on its own (daemon), and prints nothing once stopped."""
        self._stop.set()
        self._thread.join(timeout=1.0)

    def finish(self, snap: Snapshot) -> None:
        """Stop, and print the last line: the finished build, at 100%."""
        self.stop()
        self.console.end(self.line(snap))

    def line(self, snap: Snapshot) -> str:
        """``building: 52.3 of ~104.0 MB (50.3%), 41,200 documents, ...`` (see docs/RUNNING.md)."""
        elapsed = time.monotonic() - self.t0
        rate = (snap.done_bytes - self.base) / elapsed if self.base is not None and elapsed > 0 else None
        return render(snap, rate)


def render(snap: Snapshot, rate: float | None) -> str:
    """The progress line of ``snap``, with the input rate (bytes/s, None if not known yet)."""
    if snap.complete:
        pct = 100.0
    else:
        pct = min(99.9, 100.0 * snap.done_bytes / snap.total_bytes) if snap.total_bytes else 0.0
    total = ("~" if snap.estimated and not snap.complete else "") + f"{snap.total_bytes / 1e6:,.1f}"
    text = (f"{'built' if snap.complete else 'building'}: {snap.done_bytes / 1e6:,.1f} of {total} MB ({pct:.1f}%), "
            f"{counted(snap.docs, 'document')}, {counted(snap.tokens, 'token')}, {counted(snap.bad_records, 'bad record')}")
    if rate is not None and rate > 0:
        text += f", {rate / 1e6:,.1f} MB/s"
        if not snap.complete:
            text += f", ETA {format_seconds(max(0, snap.total_bytes - snap.done_bytes) / rate)}"
    elif not snap.complete:
        text += ", ETA unknown"
    return text


# Shorter words for the middle of a line that does not fit; then numbers as 3.96M, then fields left out.
_SHORT = ((r"\bdocuments?$", "docs"), (r"\btokens?$", "tok"), (r"\bbad records?$", "bad"))
_RATE = re.compile(r".* MB/s|ETA .*")


def _compact(field: str) -> str:
    """``3,959,632 tok`` -> ``3.96M tok``."""
    n, _, word = field.partition(" ")
    value = int(n.replace(",", "")) if n.replace(",", "").isdigit() else None
    if value is None or value < 10_000:
        return field
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit} {word}"
    return field


def fit(line: str, width: int) -> str:
    """``line`` (a :func:`render` line) in ``width`` characters: its middle shortened (shorter words, compact
    numbers, then documents, a zero count of bad records, tokens and bad records left out in that order),
    never the rate or the ETA."""
    fields = line.split(", ")
    k = len(fields)
    while k > 1 and _RATE.fullmatch(fields[k - 1]):
        k -= 1
    head, middle, tail = fields[0], fields[1:k], fields[k:]
    steps = [lambda f, long=long, short=short: re.sub(long, short, f) for long, short in _SHORT] + [_compact]
    text = line
    for step in steps:
        if len(text) <= width:
            return text
        middle = [step(f) for f in middle]
        text = ", ".join([head, *middle, *tail])
    # left out in turn: documents, bad records when there are none, tokens, bad records
    order = [0] + [i for i in range(1, len(middle)) if middle[i].startswith("0 ")] + list(range(1, len(middle)))
    kept = list(range(len(middle)))
    for i in order:
        if len(text) <= width:
            return text
        if i in kept:
            kept.remove(i)
            text = ", ".join([head, *(["…"] + [middle[j] for j in kept] if kept else []), *tail])
    if len(text) <= width:
        return text
    end = ", ".join(tail)
    if len(end) + 3 > width:
        return end[-width:].lstrip(", ") if width > 0 else ""
    return head[:width - len(end) - 3] + "…, " + end if end else head[:width - 1] + "…"


def watch(console: Console | None, output: str, plan: BuildPlan) -> Watcher | None:
    """A started :class:`Watcher` of the build into ``output``, or None when progress is off."""
    if console is None or not console.show_progress:
        return None
    return Watcher(console, Scanner(output, plan)).start()
