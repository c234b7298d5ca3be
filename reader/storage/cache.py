"""Opening a chunkledger cache: the ledger of a finished build, or the progress view of a running one.

A finished cache is described entirely by ``ledger.json``. While a build runs, ``ledger.json`` is the
launcher's *plan* (``finished: false``, no chunks); the reader then combines the plan's inputs, the
chunk sidecars and the ``_DONE.json`` files of compressed shards into the prefix of the global chunk
order that is already fixed (:func:`reader.order.streams.known_order_prefix`) and whose chunks are all written.
That prefix is, by construction, a prefix of the final ledger's chunk list, so anything read from it is
what will be read after the build. :meth:`Cache.refresh` polls for progress.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

import numpy as np

from reader.format import spec as fmt
from reader.format import checks
from reader.format import table as chunk_table
from reader.storage import remote
from reader.order import streams
from reader.storage import fields as kept
from reader.storage import files
from reader.storage import whatis

T = TypeVar("T")

_SIDECAR_RE = re.compile(r"shard-(\d{5})/chunk-(\d{6})\.json$")
_ENTRY_RE = re.compile(r"shard-(\d{5})/chunk-(\d{6})" + re.escape(chunk_table.ENTRY_SUFFIX) + "$")
# what a chunk table needs of an entry or sidecar (the rest of a sidecar is read when its chunk is opened)
_TABLE_KEYS = ("path", "checksum", "shard", "index_in_shard", "docs", "tokens", "bytes", "sidecar_checksum",
               "loss_tokens", "dead_letters")
_DONE_RE = re.compile(r"shard-(\d{5})/" + re.escape(fmt.SHARD_DONE_NAME) + "$")


class CacheNotReady(TimeoutError):
    """Waited ``wait_timeout_s`` for a running build to write the chunks a read needs."""


class Cache:
    """A cache root (local path or any fsspec URL such as ``gs://bucket/cache``).

    Attributes:
      url: the root as given.
      ledger: the parsed ``ledger.json`` (the plan while the build runs).
      table: :class:`reader.format.spec.ChunkTable` of the chunks known so far, in global order
        (all chunks once ``complete``).
      complete: True once the build has finished (the ledger lists every chunk).
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None):
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, root, self.anonymous = remote.filesystem(url, self.storage_options)
        self.root = root.rstrip("/")
        # every file of the cache is read (and written) through it: locally, symlinks only within the root
        self.storage = files.FsspecStorage(self.fs, root=self.root)
        if not self.is_local:  # bounded first contact: a dead network or missing credentials fail in seconds
            remote.check_open(self.fs, url, self.path(fmt.LEDGER_NAME), self.display(fmt.LEDGER_NAME),
                              anonymous=self.anonymous)
        self._lock = threading.Lock()
        self._sidecars: dict[tuple[int, int], dict] = {}
        self._done_shards: dict[int, int] = {}  # compressed shard -> chunk count, from its _DONE.json
        self.complete = False
        self.generation = 0  # bumped whenever more of the cache becomes known
        self.table: fmt.ChunkTable = fmt.ChunkTable.from_entries([])
        self.ledger: fmt.Ledger
        self.refresh()

    # -- paths -----------------------------------------------------------------------------------
    @property
    def is_local(self) -> bool:
        """True for a cache on the local filesystem (plain paths, os-level file calls work)."""
        return self.storage.local

    def path(self, rel: str) -> str:
        """Filesystem path (for ``self.fs``) of a path relative to the root."""
        return self.root + "/" + rel

    def display(self, rel: str) -> str:
        """The path as a user would type it (with the URL scheme), for error messages."""
        return self.url.rstrip("/") + "/" + rel

    def cat(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes of a file of the cache (``[start, end)`` of them). A missing file raises
        ``FileNotFoundError``; a storage failure, a :class:`reader.storage.remote.StorageError` naming the file."""
        try:
            if start is None and end is None:
                return self.storage.read(self.path(rel))
            return self.storage.read_range(self.path(rel), start or 0, end)
        except files.UnsafeFile as e:
            raise self.unsafe(rel, e) from None
        except Exception as e:
            failure = self.failure(rel, e)
            if failure is e:
                raise
            raise failure from e

    def failure(self, rel: str, e: BaseException) -> BaseException:
        """What a failed read of file ``rel`` raises: a storage failure as a
        :class:`reader.storage.remote.StorageError` naming the file; anything else (a missing file's
        ``FileNotFoundError`` too) as it is."""
        if not isinstance(e, FileNotFoundError) and remote.is_storage_error(e):
            return remote.storage_error(self.display(rel), e, anonymous=self.anonymous)
        return e

    def unsafe(self, rel: str, e: files.UnsafeFile) -> fmt.DamagedCache:
        """A file of the cache the door refused (a FIFO, a device, a symlink out of the cache, too large)."""
        return fmt.DamagedCache(f"{self.display(rel)}: {e.what}")

    def fields(self, start: int, stop: int, names=None) -> dict[str, list]:
        """Kept fields (``--keep_fields``) of documents ``[start, stop)`` in global order: ``name -> values``
        (:func:`reader.storage.fields.read_fields`)."""
        return kept.read_fields(self, start, stop, names)

    # -- loading ----------------------------------------------------------------------------------
    def _read_ledger(self) -> fmt.Ledger:
        where = self.display(fmt.LEDGER_NAME)
        try:
            text = self.storage.read(self.path(fmt.LEDGER_NAME))
        except (FileNotFoundError, NotADirectoryError):
            raise whatis.not_a_cache(self.fs, self.root, self.url) from None
        except files.UnsafeFile as e:
            raise self.unsafe(fmt.LEDGER_NAME, e) from None
        ledger = fmt.Ledger.parse(text, where=where)
        if chunk_table.uses_table(ledger.raw):  # version 4: the chunks are in the table file
            ledger = dataclasses.replace(ledger, chunks=chunk_table.open_table(ledger.raw, self.cat_ranges,
                                                                               self.display))
        return ledger

    def cat_ranges(self, rel: str, ranges) -> list[bytes]:
        """The bytes of each ``(start, end)`` range of a file of the cache (:meth:`reader.storage.files.Storage.read_ranges`)."""
        try:
            return self.storage.read_ranges(self.path(rel), ranges)
        except files.UnsafeFile as e:
            raise self.unsafe(rel, e) from None

    def refresh(self) -> bool:
        """Re-read the ledger (and, while the build runs, sidecars). Returns True if more chunks are known."""
        try:
            return self._refresh()
        except Exception as e:
            if remote.is_storage_error(e):
                raise remote.storage_error(self.url, e, anonymous=self.anonymous) from e
            raise

    def _refresh(self) -> bool:
        with self._lock:
            if self.complete:
                return False
            before = len(self.table)
            ledger = self._read_ledger()
            if ledger.finished:
                table = ledger.chunks
                self._check_finished(ledger)
                self._check_prefix(table)
                self.ledger, self.table, self.complete = ledger, table, True
            else:
                table = self._progress_table(ledger)
                self._check_prefix(table)
                self.ledger, self.table = ledger, table
            changed = len(self.table) > before or self.complete
            if changed:
                self.generation += 1
            return changed

    def _check_finished(self, ledger: fmt.Ledger) -> None:
        """A finished ledger's chunk list against its own inputs: round-robin order over the shards, and
        each shard's chunk count as recorded (and as its uncompressed size implies). The builder records
        every shard's count; a shard whose count is null (a plan marked finished by hand, or a ledger of a
        test generator) is checked against its ``_DONE.json`` instead, so a plan never passes for an empty
        finished cache. No other file is read here (``validate`` compares every shard's files with the
        ledger)."""
        t = ledger.chunks
        where = self.display(fmt.LEDGER_NAME)
        n_inputs = len(ledger.inputs)
        per_shard = np.bincount(t.shard, minlength=n_inputs) if len(t) else np.zeros(n_inputs, np.int64)
        derived = chunk_table.uses_table(ledger.raw)  # a table's order is derived from the inputs: nothing to compare
        expect = None if derived else streams.round_robin_order(per_shard)
        got = None if derived else np.stack([t.shard.astype(np.int64), t.index_in_shard.astype(np.int64)], axis=1) \
            if len(t) else np.zeros((0, 2), np.int64)
        if not derived and (expect.shape != got.shape or not np.array_equal(expect, got)):
            raise fmt.DamagedCache(
                f"{where}: the chunk list is not in round-robin order over the input shards; the ledger "
                "does not match the format (rebuild the cache)."
            )
        cb = ledger.config.get("chunk_bytes")
        if derived:  # every count is in the ledger and the table's rows follow them: only the sizes to check
            self._check_sizes(ledger, where, cb)
            return
        for i, inp in enumerate(ledger.inputs):
            n, size = inp.get("chunks"), inp.get("uncompressed_bytes")
            if n is None:
                n = self._done_chunks(i, where)
            by_bytes = inp.get("format", "jsonl") in ("jsonl", "json_array")  # columnar: runs of row groups
            if by_bytes and cb and size is not None and n != fmt.num_chunks(size, cb) and not (size == 0 and n == 1):
                # (an import of documents with no tokens at all has one chunk of them)
                raise fmt.DamagedCache(
                    f"{where}: input shard {i} ({inp.get('path')}) of {size} bytes has {n} chunks, the format "
                    f"says {fmt.num_chunks(size, cb)} of {cb} bytes: the ledger was edited; restore it, or rebuild")
            if int(n) != int(per_shard[i]):
                raise fmt.DamagedCache(
                    f"{where}: input shard {i} ({inp.get('path')}) should have {n} chunks, the ledger lists "
                    f"{int(per_shard[i])} (a build's plan marked finished, or an edited ledger): rerun the build "
                    "command that made this cache"
                )

    @staticmethod
    def _check_sizes(ledger: fmt.Ledger, where: str, cb: int | None) -> None:
        """Each JSON input's chunk count is what its uncompressed size implies (the loop below, for every input
        at once: a million-chunk cache has tens of thousands of inputs)."""
        inputs = ledger.raw["inputs"]
        if not cb or not inputs:
            return
        by_bytes = np.fromiter((inp.get("format", "jsonl") in ("jsonl", "json_array") and
                                inp.get("uncompressed_bytes") is not None for inp in inputs), bool, len(inputs))
        size = np.fromiter((inp.get("uncompressed_bytes") or 0 for inp in inputs), np.int64, len(inputs))
        n = np.fromiter((inp["chunks"] for inp in inputs), np.int64, len(inputs))
        want = -(-size // cb)
        bad = np.flatnonzero(by_bytes & (n != want) & ~((size == 0) & (n == 1)))
        if bad.size:
            i = int(bad[0])
            raise fmt.DamagedCache(
                f"{where}: input shard {i} ({inputs[i].get('path')}) of {int(size[i])} bytes has {int(n[i])} chunks, the "
                f"format says {int(want[i])} of {cb} bytes: the ledger was edited; restore it, or rebuild")

    def _done_chunks(self, shard: int, where: str, missing_ok: bool = False) -> int | None:
        """The chunk count a compressed shard's ``_DONE.json`` announces (checked); None if it does not
        exist and ``missing_ok`` (a rerun of a build may remove it while a reader polls)."""
        rel = fmt.shard_done_path(shard)
        try:
            info = fmt.load_json(self.cat(rel))
        except FileNotFoundError:
            if missing_ok:
                return None
            raise fmt.DamagedCache(
                f"{where}: says finished, but records no chunk count for input shard {shard} and {rel} does not "
                "exist: the ledger is a build's plan marked finished, or damaged. Rerun the build command "
                "(it finishes the build and writes the real ledger)") from None
        except ValueError as e:
            raise fmt.DamagedCache(f"{self.display(rel)}: not valid JSON ({e}); rerun the build command") from None
        n = info.get("chunks") if isinstance(info, dict) else None
        if not checks.is_int(n, 0, checks.MAX_INDEX):
            raise fmt.DamagedCache(f"{self.display(rel)}: \"chunks\" {n!r} is not a chunk count in [0, "
                                   f"{checks.MAX_INDEX}]; rerun the build command")
        return n

    def _check_prefix(self, table: fmt.ChunkTable) -> None:
        """What was known before must stay a prefix of what is known now (else the cache changed under us)."""
        old = self.table
        n = min(len(old), len(table))
        if n and (old.paths[:n] != table.paths[:n] or old.checksums[:n] != table.checksums[:n]):
            bad = next(i for i in range(n) if old.paths[i] != table.paths[i]
                       or old.checksums[i] != table.checksums[i])
            raise fmt.DamagedCache(
                f"{self.display(table.paths[bad])}: this chunk changed while the cache was being read "
                f"(ledger/sidecar checksum {table.checksums[bad]}, earlier {old.checksums[bad]}). Was the "
                "cache rebuilt with a different configuration into the same directory?"
            )

    def _progress_table(self, plan: fmt.Ledger) -> fmt.ChunkTable:
        """The chunks of the global order written so far, from the plan and the published entries
        (a version 4 build's ``chunk-KKKKKK.entry``, about 0.4 KB; an older build's sidecars).

        A poll costs what changed, not the size of the build: uncompressed shards' chunk counts are in
        the plan, so only the directories of compressed shards whose ``_DONE.json`` is not known yet are
        listed; then the entries that extend the known prefix are fetched in order, a batch of paths at
        a time, up to the first one that does not exist yet. Each is fetched once.
        """
        entries = chunk_table.writes_entries(plan.raw)  # else sidecars
        name_of = chunk_table.entry_path if entries else fmt.sidecar_path
        what = "entry" if entries else "sidecar"
        inputs = plan.inputs
        n = len(inputs)
        lower = np.zeros(n, dtype=np.int64)
        final = np.zeros(n, dtype=bool)
        for i, inp in enumerate(inputs):
            if inp.get("chunks") is not None:
                lower[i], final[i] = int(inp["chunks"]), True
            elif i in self._done_shards:
                lower[i], final[i] = self._done_shards[i], True
        for i in np.flatnonzero(~final).tolist():  # a compressed shard still being streamed
            for p in (e.path for e in self.storage.list(self.path(fmt.shard_dir(i)))):
                m = _DONE_RE.search(p)
                if m and int(m.group(1)) == i:
                    n_done = self._done_chunks(i, self.display(fmt.LEDGER_NAME), missing_ok=True)
                    if n_done is not None:
                        self._done_shards[i] = n_done
                        lower[i], final[i] = n_done, True
                        break
                m = (_ENTRY_RE if entries else _SIDECAR_RE).search(p)
                if m and int(m.group(1)) == i:
                    lower[i] = max(lower[i], int(m.group(2)) + 1)
        prefix = streams.known_order_prefix(lower, final)
        keys = [(int(s), int(k)) for s, k in prefix]
        upto = 0
        while upto < len(keys) and keys[upto] in self._sidecars:
            upto += 1
        batch = 16
        known = upto
        while upto < len(keys):  # extend the prefix: entries are published after their chunk is in place
            want = keys[upto:upto + batch]
            paths = [self.path(name_of(s, k)) for s, k in want]
            got = self.storage.read_many(paths)
            for (s, k), p in zip(want, paths):
                data = got.get(p)
                if data is None:
                    break
                where = self.display(name_of(s, k))
                try:
                    entry = fmt.load_json(data)
                    fmt.ChunkTable.from_entries([entry], num_inputs=n)  # its integers and paths
                except ValueError as e:
                    why = str(e).removeprefix("chunk entry 0: ")
                    raise fmt.DamagedCache(f"{where}: not a valid {what} ({why}); delete it and its chunk, and "
                                           "rerun the build command") from None
                if (entry["shard"], entry["index_in_shard"]) != (s, k):
                    raise fmt.DamagedCache(
                        f"{where}: names chunk {entry.get('path')!r}, expected {fmt.chunk_path(s, k)!r}")
                self._sidecars[(s, k)] = {key: entry[key] for key in _TABLE_KEYS if key in entry}
                upto += 1
            else:
                batch = min(batch * 2, 1024)  # all there: ask for more next time
                continue
            break
        if upto == known == len(self.table):
            return self.table  # nothing new
        return fmt.ChunkTable.from_entries([self._sidecars[k] for k in keys[:upto]])

    # -- waiting ------------------------------------------------------------------------------------
    def progress(self) -> str:
        """What a running build has made readable so far (for messages)."""
        return f"{len(self.table)} chunks of the global order are available so far"

    def wait(self, attempt: Callable[[], T], *, timeout_s: float, poll_s: float = 1.0,
             what: str = "data") -> T:
        """Run ``attempt`` until it stops raising :class:`streams.NotYetAvailable`, refreshing between tries.

        Raises :class:`CacheNotReady` after ``timeout_s`` seconds without success.
        """
        return wait_for(self, attempt, timeout_s=timeout_s, poll_s=poll_s, what=what)

    def wait_complete(self, *, timeout_s: float, poll_s: float = 1.0, what: str = "this") -> None:
        def attempt():
            if not self.complete:
                raise streams.NotYetAvailable("the total size is known only when the build finishes")

        self.wait(attempt, timeout_s=timeout_s, poll_s=poll_s, what=what)


def wait_for(source, attempt: Callable[[], T], *, timeout_s: float, poll_s: float = 1.0, what: str = "data") -> T:
    """Run ``attempt`` until it stops raising :class:`streams.NotYetAvailable`, refreshing ``source``
    between tries (a :class:`Cache`, or anything with its ``url``, ``generation``, ``complete``,
    ``refresh()`` and ``progress()``: a mixture's caches). Raises :class:`CacheNotReady` after
    ``timeout_s`` seconds without success."""
    t0 = time.monotonic()
    while True:
        gen = source.generation
        try:
            return attempt()
        except streams.NotYetAvailable as e:
            if source.generation != gen:  # another thread saw progress meanwhile: retry at once
                continue
            if source.complete:
                raise
            if source.refresh():
                continue
            waited = time.monotonic() - t0
            if waited >= timeout_s:
                raise CacheNotReady(
                    f"{source.url}: the build is still running and has not written the chunks needed for "
                    f"{what} ({e}); {source.progress()}. Waited {waited:.0f} s (wait_timeout_s={timeout_s}). "
                    "Check that the build is alive or raise wait_timeout_s."
                ) from e
            time.sleep(min(poll_s, max(0.0, timeout_s - waited)))
