"""A Parquet column chunk's pages, from their headers: a minimal Thrift compact-protocol reader.

pyarrow reads a page header only together with its page; the reader's fast path
(:mod:`reader.storage.pages`) and the builder's checks of what an input's pages hold
(:mod:`pipelines.inputs.parquet`) read the headers of stored bytes by hand with :func:`page_headers`.
"""

from __future__ import annotations


class Thrift:
    """Minimal Thrift compact-protocol reader for Parquet page headers."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf, pos: int):
        self.buf, self.pos = buf, pos

    def varint(self) -> int:
        shift = result = 0
        buf = self.buf
        while True:
            b = buf[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def struct(self) -> dict:
        """Read a struct: {field id: value}; nested structs become dicts, other containers are skipped."""
        out, last = {}, 0
        while True:
            head = self.buf[self.pos]
            self.pos += 1
            if head == 0:
                return out
            ftype = head & 0x0F
            delta = head >> 4
            fid = last + delta if delta else self.zigzag()
            last = fid
            out[fid] = self.value(ftype)

    def value(self, ftype: int):
        if ftype == 1:
            return True
        if ftype == 2:
            return False
        if ftype == 3:
            self.pos += 1
            return self.buf[self.pos - 1]
        if ftype in (4, 5, 6):
            return self.zigzag()
        if ftype == 7:
            self.pos += 8
            return None
        if ftype == 8:
            n = self.varint()
            self.pos += n
            return None
        if ftype in (9, 10):
            head = self.buf[self.pos]
            self.pos += 1
            n, et = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            for _ in range(n):
                self.value(et if et != 1 else 1)
            return None
        if ftype == 11:
            n = self.varint()
            if n:
                kv = self.buf[self.pos]
                self.pos += 1
                for _ in range(n):
                    self.value(kv >> 4)
                    self.value(kv & 0x0F)
            return None
        if ftype == 12:
            return self.struct()
        raise ValueError(f"unknown thrift type {ftype}")


def page_headers(data, start: int = 0, end: int | None = None):
    """``(header, body offset)`` of each page of the column chunk ``data[start:end]``, in order: the header's
    Thrift fields (1 the page type: 0 data, 2 dictionary, 3 data v2; 2 and 3 its uncompressed and
    compressed sizes; 5, 7, 8 the data, dictionary and data v2 page headers, whose field 1 is the page's
    number of values). ValueError where a header is damaged or the pages do not tile the chunk exactly."""
    end = len(data) if end is None else end
    pos = start
    while pos < end:
        t = Thrift(data, pos)
        try:
            h = t.struct()
        except (IndexError, TypeError) as e:
            raise ValueError(f"a page header that does not parse at byte {pos - start} of the column chunk") from e
        csize = h.get(3)
        if not isinstance(csize, int) or csize < 0 or t.pos + csize > end or not isinstance(h.get(2), int) \
                or h[2] < 0:
            raise ValueError(f"a page at byte {pos - start} of the column chunk whose sizes run past its end")
        yield h, t.pos
        pos = t.pos + csize
