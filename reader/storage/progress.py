"""How far a build has got: input bytes done of the total, chunks, documents and tokens written, the rate
and an ETA (``python -m reader inspect`` and ``report`` on a running build, and the builder's progress line:
``pipelines/runners/progress_line.py``), and whether the build lock's holder still runs (:func:`holder_alive`).

:class:`Scan` is the one scan of what a build has written, through the storage port (fsspec for the reader,
Beam's FileSystems for the builder): the chunks' entries (a version 4 build; an older one's sidecars) and
``_DONE.json`` files under ``chunks/``, each read once while it stays the same.

While a build runs, ``ledger.json`` is the plan: each input's file size, and the chunk count of each
uncompressed shard (a compressed shard's is known only once it has been read). A chunk is done when its
entry exists (written after its sidecar; in an older build, its sidecar, written last). A chunk of an uncompressed shard completes its byte range of
the file; a compressed shard's chunks are counted in uncompressed bytes, whose total is unknown until the
shard's ``_DONE.json`` exists, so its file bytes count as done only then.

The rate comes from the files' modification times: the work finished since this run's builder took the
lock (``_BUILDING.json``, created when the launcher starts), divided by the time from then to the last
file. Chunks an earlier, interrupted run wrote count as done, not toward the rate. Without a lock (the
builder stopped, or the job runs without its launcher, as a Dataflow template does) the rate is taken
between the first and the last file. :func:`rate`, :func:`summarize` and :func:`eta` are pure; :class:`Scan`
and :func:`read_progress` read files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from typing import Any, Mapping, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.format import table as chunk_table
from reader.storage.cache import Cache
from reader.storage.files import Storage

# what completes work: a chunk's entry (a version 4 build) or sidecar (older builds), a shard's _DONE.json
_WRITTEN = {entries: re.compile(r"shard-(\d{5,})/(chunk-\d{6,}" + re.escape(chunk_table.ENTRY_SUFFIX if entries else ".json")
                                + "|" + re.escape(fmt.SHARD_DONE_NAME) + ")$") for entries in (False, True)}


@dataclasses.dataclass(frozen=True)
class Written:
    """A file a build has written that completes some work: a chunk's sidecar, or a compressed shard's
    ``_DONE.json`` (``entry`` None)."""

    shard: int
    time: float | None  # its modification time (seconds since the epoch), None where the store does not say
    entry: Mapping[str, Any] | None = None  # the sidecar
    done: Mapping[str, Any] | None = None  # the _DONE.json


class Scan:
    """What a build has written into the cache at ``root`` so far, kept between calls of :meth:`scan`: one
    listing of ``chunks/`` a scan, and each chunk's entry (``entries``: a version 4 build, about 0.4 KB each) or
    sidecar (an older build, about 12 KB for a 64 MiB chunk) and ``_DONE.json`` read again only when it changed
    (size or time). ``shards``: the build's input shards (a directory of another is not the build's)."""

    def __init__(self, storage: Storage, root: str, shards: int, entries: bool = True):
        self.storage, self.root, self.shards = storage, root, shards
        self._written = _WRITTEN[bool(entries)]
        self._seen: dict[str, tuple[tuple, Written | None]] = {}  # path -> (version, what it says, if readable)

    def scan(self) -> list[Written]:
        """Every entry (or sidecar) and ``_DONE.json`` there now; one not readable as such is left out (an entry
        or sidecar of them is in :attr:`damaged`: they are written atomically, so that is damage, never a
        half-written file)."""
        found = {}
        for e in self.storage.match(fmt.join(self.root, f"{fmt.CHUNKS_DIR}/*/*")):
            m = self._written.search(e.path)
            if m and int(m.group(1)) < self.shards:
                found[e.path] = (int(m.group(1)), m.group(2), e)
        new = [p for p, (_, _, e) in found.items() if p not in self._seen or self._seen[p][0] != (e.size, e.mtime)]
        got = self.storage.read_many(new)
        for p in new:
            shard, name, e = found[p]
            if p in got:
                self._seen[p] = ((e.size, e.mtime), _parse(shard, name, e.mtime, got[p]))
        for p in [p for p in self._seen if p not in found or (p in new and p not in got)]:
            del self._seen[p]  # removed meanwhile (a rerun replacing a damaged chunk)
        return [w for _, w in self._seen.values() if w is not None]

    @property
    def damaged(self) -> list[str]:
        return sorted(p for p, (_, w) in self._seen.items() if w is None and not p.endswith(fmt.SHARD_DONE_NAME))


def _parse(shard: int, name: str, t: float | None, raw: bytes) -> Written | None:
    """What an entry, a sidecar or ``_DONE.json`` says (None if it is not readable as one)."""
    try:
        got = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(got, dict):
        return None
    if name == fmt.SHARD_DONE_NAME:
        return Written(shard=shard, time=t, done=got) if isinstance(got.get("chunks"), int) else None
    ints = all(type(got.get(k)) is int for k in ("docs", "tokens", "index_in_shard"))
    return Written(shard=shard, time=t, entry=got) if ints else None


@dataclasses.dataclass
class Progress:
    """What :func:`summarize` finds. Byte counts are input file bytes unless named ``uncompressed``."""

    finished: bool
    running: bool  # a builder holds the lock
    input_bytes_total: int
    input_bytes_done: int
    shards: int
    shards_streaming: int  # compressed shards with chunks but no _DONE.json yet
    streaming_uncompressed_bytes: int  # the bytes those have been read so far (uncompressed)
    chunks_written: int
    chunks_planned: int  # a lower bound while compressed shards are being read
    chunks_planned_exact: bool
    documents: int
    tokens: int
    bad_records: int
    bad_reasons: dict[str, int]
    bytes_per_s: float | None
    tokens_per_s: float | None
    chunks_per_s: float | None
    eta_s: float | None
    last_write_age_s: float | None  # seconds from the last file to ``now``
    rate_chunks: int  # the chunks the rate is measured over
    failed: Mapping[str, Any] | None = None  # _FAILED.json, if the build stopped with a verdict
    stopped: str | None = None  # why no builder is running, when none is
    entries: list[Mapping[str, Any]] = dataclasses.field(default_factory=list, repr=False)  # sidecars written

    @property
    def fraction(self) -> float | None:
        return self.input_bytes_done / self.input_bytes_total if self.input_bytes_total else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, without the sidecars."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "entries"}
        out["fraction"] = self.fraction
        return out


def rate(times: Sequence[float], amounts: Sequence[float], start: float | None = None) -> float | None:
    """Amount per second of work finished at ``times`` (each finishing ``amounts``).

    With ``start`` (when this run began): the amounts finished at or after it over the time from ``start`` to
    the last of them. Without: the time from the first to the last, over the amounts after the first (the
    first one's work was done before its time). None when that time is not positive.
    """
    t = np.asarray(times, dtype=np.float64)
    a = np.asarray(amounts, dtype=np.float64)
    if start is not None:
        sel = t >= start
        if not sel.any():
            return None
        span, total = float(t[sel].max()) - float(start), float(a[sel].sum())
    else:
        if t.size < 2:
            return None
        order = np.argsort(t, kind="stable")
        span, total = float(t[order[-1]] - t[order[0]]), float(a[order[1:]].sum())
    return total / span if span > 0 else None


def eta(remaining: float, per_s: float | None) -> float | None:
    """Seconds to do ``remaining`` at ``per_s`` (None if the rate is unknown or zero)."""
    if remaining <= 0:
        return 0.0
    return remaining / per_s if per_s else None


def summarize(inputs: Sequence[Mapping[str, Any]], written: Sequence[Written], *, start: float | None,
              now: float, running: bool = False) -> Progress:
    """The progress of a running build from its plan's ``inputs`` and the files ``written`` so far."""
    n = len(inputs)
    entries = [w for w in written if w.entry is not None]
    done = {w.shard: w for w in written if w.done is not None}
    widths = np.zeros(n, np.int64)  # uncompressed bytes of the chunks written, per shard
    per_chunk_bytes = []  # input file bytes each written file completes (for the rate)
    for w in entries:
        width = fmt.chunk_input_bytes(w.entry, int(inputs[w.shard]["size"]), inputs[w.shard].get("rows"))
        widths[w.shard] += width
        plain = inputs[w.shard].get("compression", "none") == "none"
        per_chunk_bytes.append(width if plain else 0)
    total = sum(int(inp["size"]) for inp in inputs)
    done_bytes = streaming = streamed = planned = 0
    exact = True
    for i, inp in enumerate(inputs):
        if inp.get("compression", "none") == "none":
            done_bytes += min(int(widths[i]), int(inp["size"]))
            planned += int(inp["chunks"]) if inp.get("chunks") is not None else 0
        elif i in done:
            done_bytes += int(inp["size"])
            planned += int(done[i].done["chunks"])
        else:
            exact = False
            planned += sum(1 for w in entries if w.shard == i)
            if widths[i]:
                streaming += 1
                streamed += int(widths[i])
    times = [w.time for w in entries] + [w.time for w in done.values()]
    amounts = per_chunk_bytes + [int(inputs[s]["size"]) for s in done]
    bytes_per_s = rate(times, amounts, start)
    chunk_times = [w.time for w in entries]
    tokens_per_s = rate(chunk_times, [int(w.entry["tokens"]) for w in entries], start)
    chunks_per_s = rate(chunk_times, [1] * len(entries), start)
    # the chunks the rate covers: those of this run, or all but the first
    measured = sum(1 for t in chunk_times if t >= start) if start is not None else max(0, len(entries) - 1)
    reasons: dict[str, int] = {}
    for w in entries:
        for reason, k in (w.entry.get("bad_reasons") or {}).items():
            reasons[reason] = reasons.get(reason, 0) + int(k)
    return Progress(
        finished=False, running=running, input_bytes_total=total, input_bytes_done=done_bytes, shards=n,
        shards_streaming=streaming, streaming_uncompressed_bytes=streamed, chunks_written=len(entries),
        chunks_planned=planned, chunks_planned_exact=exact,
        documents=sum(int(w.entry["docs"]) for w in entries), tokens=sum(int(w.entry["tokens"]) for w in entries),
        bad_records=sum(int(w.entry.get("bad_records", 0)) for w in entries), bad_reasons=dict(sorted(reasons.items())),
        bytes_per_s=bytes_per_s, tokens_per_s=tokens_per_s, chunks_per_s=chunks_per_s,
        eta_s=eta(total - done_bytes, bytes_per_s),
        last_write_age_s=(now - max(times)) if times else None, rate_chunks=measured,
        entries=[w.entry for w in sorted(entries, key=lambda w: (w.shard, int(w.entry["index_in_shard"])))])


def finished_progress(cache: Cache) -> Progress:
    """A finished cache's figures, from its ledger alone."""
    t, ledger = cache.table, cache.ledger
    total = sum(int(inp["size"]) for inp in ledger.inputs)
    reasons = dict(ledger.raw.get("bad_records", {}))
    return Progress(finished=True, running=False, input_bytes_total=total, input_bytes_done=total,
                    shards=len(ledger.inputs), shards_streaming=0, streaming_uncompressed_bytes=0,
                    chunks_written=len(t), chunks_planned=len(t), chunks_planned_exact=True,
                    documents=int(t.docs.sum()), tokens=int(t.tokens.sum()), bad_records=sum(reasons.values()),
                    bad_reasons=reasons, bytes_per_s=None, tokens_per_s=None, chunks_per_s=None, eta_s=0.0,
                    last_write_age_s=None, rate_chunks=0)


def record(raw: bytes | None) -> dict | None:
    """A status file's JSON object (the lock's holder, ``_FAILED.json``): None if there is no file, ``{}`` if
    it is not one (being written by its owner right now, or damaged: present, unreadable)."""
    if raw is None:
        return None
    try:
        got = json.loads(raw)
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def _json_or_none(cache: Cache, rel: str) -> dict | None:
    try:
        return record(cache.cat(rel))
    except FileNotFoundError:
        return None


def read_progress(cache: Cache, *, now: float | None = None) -> Progress:
    """The progress of ``cache``'s build: from the ledger when finished, else from what :class:`Scan` finds
    (entries or sidecars, ``_DONE.json`` and their times), the lock and ``_FAILED.json``. Reads every entry
    written so far (an older build's sidecar): a running build's figures cover all of them, not only the prefix
    of the global order a reader can use."""
    if cache.complete:
        return finished_progress(cache)
    now = time.time() if now is None else now
    scan = Scan(cache.storage, cache.root, len(cache.ledger.inputs), entries=chunk_table.writes_entries(cache.ledger.raw))
    written = [w for w in scan.scan() if w.time is not None]
    if scan.damaged:
        rel = scan.damaged[0][len(cache.root) + 1:]
        raise fmt.DamagedCache(f"{cache.display(rel)}: not valid JSON, or not a chunk's entry or sidecar")
    lock = holder = None
    found = cache.storage.match(cache.path(fmt.LOCK_NAME))
    if found:
        lock = found[0].mtime
        holder = _json_or_none(cache, fmt.LOCK_NAME)
    alive = holder_alive(holder) if holder else None
    out = summarize(cache.ledger.inputs, written, start=lock, now=now, running=lock is not None and alive is not False)
    if lock is None:
        out.stopped = "no builder holds the lock (it stopped, or the job runs without its launcher)"
    elif alive is False:
        out.stopped = (f"the builder holding the lock, process {holder.get('pid')} on {holder.get('host')}, is gone: "
                       "rerun the build command to resume")
    out.failed = _json_or_none(cache, fmt.FAILED_NAME)
    return out


PF_EXITING = 0x4  # /proc/PID/stat flags: the process is being torn down (linux/sched.h)


def process_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, flags, start ticks)`` of a process from /proc (Linux), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[6]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the holder."""
    stat = process_stat(pid)
    return None if stat is None else stat[2]


def holder_alive(holder: Mapping[str, Any]) -> bool | None:
    """Whether the build lock's holder (``{"host", "pid", "start_ticks"}``) still runs: True/False on its own
    host, None elsewhere (it cannot be known). The builder's lock and ``inspect``'s progress both ask this.

    A zombie or an exiting process is not alive: it will never write again; a reused process id is told
    apart by its start time."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    except (OverflowError, OSError):
        return False
    stat = process_stat(pid)
    if stat is None:
        return True  # no /proc: an existing pid is all there is to go by
    state, flags, ticks = stat
    if state in ("Z", "X") or flags & PF_EXITING:
        return False
    return holder.get("start_ticks") in (None, ticks)


def describe(p: Progress, readable: int | None = None) -> list[str]:
    """``inspect``'s lines for a running build (after its ``progress`` label); ``readable``: the chunks of the
    global order a reader can use so far."""
    pct = f" ({100 * p.fraction:.1f}%)" if p.fraction is not None else ""
    first = f"input {format_bytes(p.input_bytes_done)} of {format_bytes(p.input_bytes_total)}{pct}"
    if p.shards_streaming:
        first += (f"; {p.shards_streaming} compressed shard(s) being read "
                  f"({format_bytes(p.streaming_uncompressed_bytes)} uncompressed so far) count when they finish")
    planned = f"{p.chunks_planned:,}" if p.chunks_planned_exact else f"at least {p.chunks_planned:,}"
    usable = "" if readable is None else f" ({readable:,} readable in global order)"
    chunks = "chunk" if p.chunks_planned == 1 else "chunks"
    lines = [first, f"written {p.chunks_written:,} of {planned} {chunks}{usable}: "
                    f"{counted(p.documents, 'document')}, {counted(p.tokens, 'token')}, "
                    f"{counted(p.bad_records, 'bad record')}"]
    if p.bytes_per_s is None and p.tokens_per_s is None:
        speed = "rate unknown (too few chunks written" + (" in this run)" if p.running else ")")
    else:
        parts = []
        if p.bytes_per_s is not None:
            parts.append(f"{format_bytes(p.bytes_per_s)}/s")
        if p.tokens_per_s is not None:
            parts.append(f"{p.tokens_per_s:,.0f} tokens/s")
        if p.chunks_per_s is not None:
            parts.append(f"{p.chunks_per_s:,.2f} chunks/s")
        speed = f"rate {', '.join(parts)} (over {counted(p.rate_chunks, 'chunk')}{' of this run' if p.running else ''})"
    if not p.running:
        speed += f"; ETA -: {p.stopped or 'no builder is running'}"
    elif p.eta_s is not None:
        speed += f"; ETA {format_seconds(p.eta_s)}"
    else:
        speed += "; ETA unknown until a compressed shard finishes"
    if p.last_write_age_s is not None:
        speed += f"; last file written {format_seconds(max(0.0, p.last_write_age_s))} ago"
    lines.append(speed)
    if p.failed is not None:
        what = p.failed.get("message") or p.failed.get("error") or "see _FAILED.json"
        lines.append(f"STOPPED: {what} ({fmt.FAILED_NAME})")
    return lines


def counted(n: int, noun: str, sep: str = ",") -> str:
    """``1 chunk``, ``3 chunks``, ``1,000 bad records`` (``sep=""``: ``1000 bad records``)."""
    return f"{n:{sep}} {noun}" + ("" if n == 1 else "s")


def format_bytes(n: float) -> str:
    """``812 B``, ``3.4 kB``, ``1.25 MB``, ``2.0 GB`` (decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.{1 if unit != 'MB' else 2}f} {unit}"
    return f"{n:,.0f} B"


def format_seconds(s: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``."""
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"
