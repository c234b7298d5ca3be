"""The records of a ``.json`` file holding one JSON array (Alpaca-style), streamed element by element.

A ``.json`` input whose first byte other than whitespace (and a byte-order mark) is ``[`` is one array of
records; any other ``.json`` is JSON Lines (:mod:`pipelines.inputs.formats`). :class:`ArrayRecords` cuts
the array's elements out of the uncompressed stream without parsing them (strings, escapes and bracket
nesting are followed, nothing else): each element's bytes then go through the same record parser as a
jsonl line, so a bad element (not an object, no text) is a bad record with its reason, at its offset.

Provenance is the byte offset of the element's first byte, as for a jsonl line; an element's *record
bytes* run from there to the next element's first byte (the comma and whitespace after it; the last one's
run to the end of the file, the closing ``]`` included), so a chunk's record bytes are one span of the
file and its ``input_checksum`` their sha256. Element boundaries are only known from the start of the
file, so an array file is read in one pass, like a compressed jsonl shard.

Memory is bounded whatever the bytes: an element is held as one buffer (never a piece per byte), a run of
whitespace or of brackets is taken at once, the bytes between elements are kept only if asked for
(``keep_tails``: the build does not), and brackets are remembered one byte per level up to
:data:`KEPT_DEPTH` levels (deeper ones are counted: such an element is a bad record anyway, nested far
past ``max_json_depth``, and its end is still found exactly).

An element longer than ``max_element`` bytes is not held: its bytes pass through (into the chunk's input
checksum, :class:`Spans`), and it comes as a :class:`LongElement`, its first bytes and its size, which the
builder sets aside as ``too_long``, exactly as an over-long jsonl line.

Anything that stops the array from being one JSON array (a missing comma, a bracket that does not match,
bytes after the closing bracket, an end before it) is damage: :class:`~pipelines.errors.DamagedFile`
naming the offset, never a shorter cache.
"""

from __future__ import annotations

import hashlib
import re
from typing import BinaryIO, Iterator, Protocol

from pipelines.errors import DamagedFile

READ_BLOCK = 1 << 20
_WS = b" \t\r\n"
_IN_STRING = re.compile(rb'["\\]')
_NESTED = re.compile(rb'["\\{}\[\]]')
_TOP = re.compile(rb'["{}\[\],\s]')
_NOT_WS = re.compile(rb"[^ \t\r\n]")
_OPEN_RUN = re.compile(rb"[\[{]+")
_CLOSE_RUN = re.compile(rb"[\]}]+")
_TO_OPEN = bytes.maketrans(b"]}", b"[{")
KEPT_DEPTH = 1 << 20  # levels of nesting whose bracket is remembered (one byte each)
BOM = b"\xef\xbb\xbf"
LONG_HEAD = 4 << 10  # bytes of an over-long element kept for its dead letter (lines.LONG_LINE_HEAD)


class LongElement:
    """An element longer than ``max_element``: its first :data:`LONG_HEAD` bytes and its size."""

    __slots__ = ("head", "size")

    def __init__(self, head: bytes, size: int):
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size


class Feed(Protocol):
    """Where :class:`ArrayRecords` sends the record bytes: ``start(offset)`` at each element's first byte,
    then ``update(data)`` with every byte from there on, in order (see :class:`Spans`)."""

    def start(self, offset: int) -> None: ...

    def update(self, data: bytes) -> None: ...


class Spans:
    """Each chunk's input span and checksum of a JSON array, fed by :class:`ArrayRecords`.

    Chunk ``k`` holds the elements starting in ``[k*chunk_bytes, (k+1)*chunk_bytes)``; its span runs from its
    first element's first byte to the next chunk's (or the end of the file), and its checksum is the sha256
    of those bytes, which the reader sends here as it passes them (an over-long element is never held).
    """

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.spans: dict[int, tuple[int, "hashlib._Hash"]] = {}  # chunk -> (first element's offset, hash)
        self._h = None

    def start(self, offset: int) -> None:
        k = offset // self.chunk_bytes
        if k not in self.spans:
            self._h = hashlib.sha256()
            self.spans[k] = (offset, self._h)

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def result(self, k: int, end: int) -> tuple[list[int], str]:
        """``([start, end], "sha256:<hex>")`` of chunk ``k``, whose span ends at ``end`` (the next chunk's first
        element, or the end of the file); an empty span ``[end, end]`` for a chunk holding no element."""
        start, h = self.spans.pop(k, (end, hashlib.sha256()))
        return [start, end], "sha256:" + h.hexdigest()


def first_byte(head: bytes) -> int | None:
    """The first byte of ``head`` that is neither whitespace nor part of a leading byte-order mark."""
    head = head[len(BOM):] if head.startswith(BOM) else head
    stripped = head.lstrip(_WS)
    return stripped[0] if stripped else None


class ArrayRecords:
    """``(offset, element, tail)`` for each element of the JSON array in ``stream``.

    ``element`` is the element's bytes, ``tail`` the bytes after it up to the next element (``, ``) or, for
    the last one, to the end of the file (empty unless ``keep_tails``). Memory: one element (at most
    ``max_element`` bytes) plus a read block, and the tails kept.
    """

    def __init__(self, stream: BinaryIO, path: str, block: int = READ_BLOCK, max_element: int | None = None,
                 feed: Feed | None = None, keep_tails: bool = True):
        self.stream, self.path, self.block = stream, path, block
        self.max_element, self.feed, self.keep_tails = max_element, feed, keep_tails
        self.end: int | None = None  # the stream's length, once read to the end

    def _damaged(self, pos: int, what: str) -> DamagedFile:
        return DamagedFile(self.path, f"at byte {pos}", f"not one JSON array: {what}")

    def _blocks(self) -> Iterator[bytes]:
        first = b""
        while len(first) < len(BOM):  # a byte-order mark is seen whole in the first block
            more = self.stream.read(self.block)
            if not more:
                break
            first += more
        if first:
            yield first
        yield from iter(lambda: self.stream.read(self.block), b"")

    def __iter__(self) -> Iterator[tuple[int, bytes, bytes]]:
        state = "start"  # start, value, first (value or ']'), in, after, end
        depth = bytearray()  # open brackets of the current element (the first KEPT_DEPTH levels)
        deep = 0  # levels opened beyond those
        in_str = escape = False
        elem = bytearray()
        size, head = 0, None  # the element's bytes so far; its first bytes once it is over max_element
        elem_start = 0
        prev: tuple[int, bytes | LongElement] | None = None  # the finished element waiting for its tail
        tail = bytearray()
        keep = self.keep_tails
        base = 0
        feed, fed = self.feed, -1  # fed: bytes of this block sent to feed (-1: no element started yet)
        limit = self.max_element

        def put(piece: bytes) -> None:
            nonlocal size, head
            size += len(piece)
            if head is None:
                elem.extend(piece)
                if limit is not None and size > limit:  # stream the rest past: keep its first bytes
                    head = bytes(elem[:LONG_HEAD])
                    elem.clear()
            elif len(head) < LONG_HEAD:
                head += piece[:LONG_HEAD - len(head)]

        def push(run: bytes) -> None:
            nonlocal deep
            take = 0 if deep else min(len(run), KEPT_DEPTH - len(depth))
            depth.extend(run[:take])
            deep += len(run) - take

        def close(b: bytes, j: int, k: int) -> int:
            """Close the levels the brackets ``b[j:k]`` close, innermost first; where the closing stopped (the
            element's end, or ``k``). Damage if a bracket closes the other kind."""
            nonlocal deep
            n = min(deep, k - j)
            deep -= n
            m = min(len(depth), k - j - n)
            if m:
                got, want = b[j + n:j + n + m].translate(_TO_OPEN)[::-1], depth[len(depth) - m:]
                if got != want:
                    t = next(t for t in range(m) if got[m - 1 - t] != want[m - 1 - t])
                    raise self._damaged(base + j + n + t, f"{chr(b[j + n + t])!r} closes a {chr(want[m - 1 - t])!r}")
                del depth[len(depth) - m:]
            return j + n + m

        for b in self._blocks():
            i, n = 0, len(b)
            if base == 0 and b.startswith(BOM):
                i = len(BOM)
            while i < n:
                if state == "in":
                    if escape:  # the byte after a backslash that ended the last block
                        put(b[i:i + 1])
                        escape, i = False, i + 1
                        continue
                    nested = bool(depth) or deep > 0
                    pattern = _IN_STRING if in_str else _NESTED if nested else _TOP
                    m = pattern.search(b, i)
                    if m is None:
                        put(b[i:])
                        i = n
                        continue
                    j, c = m.start(), b[m.start()]
                    done = None  # where the element ends, when it ends here
                    if in_str:
                        if c == 0x5C:  # backslash
                            if j + 1 < n:
                                j += 1
                            else:
                                escape = True
                        else:
                            in_str = False
                            if not nested:
                                done = j + 1
                    elif c == 0x22:
                        in_str = True
                    elif c in (0x7B, 0x5B):  # a run of opening brackets at once
                        k = _OPEN_RUN.match(b, j).end()
                        push(b[j:k])
                        put(b[i:k])
                        i = k
                        continue
                    elif c in (0x7D, 0x5D):
                        if not nested:  # a scalar element ended by the array's ']'
                            done = j
                        else:  # a run of closing brackets at once, up to the element's end
                            k = close(b, j, _CLOSE_RUN.match(b, j).end())
                            if depth or deep:
                                put(b[i:k])
                                i = k
                                continue
                            done = k
                    else:  # ',' or whitespace after a scalar element
                        done = j
                    if done is None:
                        put(b[i:j + 1])
                        i = j + 1
                        continue
                    put(b[i:done])
                    if prev is not None:
                        yield prev[0], prev[1], bytes(tail)
                    whole = bytes(elem) if head is None else LongElement(head, size)
                    prev, tail = (elem_start, whole), bytearray()
                    elem, size, head = bytearray(), 0, None
                    state, i = "after", done
                    continue
                c = b[i]
                if c in _WS:  # a run of whitespace at once
                    m = _NOT_WS.search(b, i)
                    j = m.start() if m is not None else n
                    if state != "start" and keep:
                        tail += b[i:j]
                    i = j
                    continue
                if state == "start":
                    if c != 0x5B:
                        raise self._damaged(base + i, "it does not start with '['")
                    state, i = "first", i + 1
                elif state in ("value", "first"):
                    if c == 0x5D and state == "first":
                        state = "end"
                        if keep:
                            tail += b"]"
                        i += 1
                    elif c in (0x2C, 0x5D):
                        raise self._damaged(base + i, f"{chr(c)!r} where a value belongs")
                    else:
                        if feed is not None:  # the bytes before this element are the last one's
                            if fed >= 0:
                                feed.update(b[fed:i])
                            feed.start(base + i)
                            fed = i
                        if prev is not None:
                            yield prev[0], prev[1], bytes(tail)
                            prev, tail = None, bytearray()
                        elem_start, state, in_str = base + i, "in", False
                        depth.clear()
                        deep = 0
                elif state == "after":
                    if c not in (0x2C, 0x5D):
                        raise self._damaged(base + i, f"{chr(c)!r} after an element (a missing ',')")
                    if keep:
                        tail += b[i:i + 1]
                    state = "value" if c == 0x2C else "end"
                    i += 1
                else:
                    raise self._damaged(base + i, "bytes after the closing ']'")
            if feed is not None and fed >= 0:
                feed.update(b[fed:] if fed else b)
                fed = 0
            base += n
        self.end = base
        if state != "end":
            raise self._damaged(base, "the file ends inside the array (truncated?)")
        if prev is not None:
            yield prev[0], prev[1], bytes(tail)
