"""Checked decompression of input files (pipelines/inputs/decompress.py): every byte, or an error naming the damage."""

from __future__ import annotations

import gzip
import random

import pytest
import zstandard

from pipelines.inputs.decompress import ZstdFrameChecker, open_input
from pipelines.errors import DamagedInput

DATA = b"".join(b'{"text": "line %d of a shard"}\n' % i for i in range(4000))


def read_all(path: str, comp: str, block: int = 777) -> bytes:
    with open_input(path, comp) as f:
        return b"".join(iter(lambda: f.read(block), b""))


def zstd_variants() -> dict[str, tuple[bytes, bytes]]:
    """name -> (compressed, uncompressed) for each kind of frame a zstd writer produces."""
    stream = zstandard.ZstdCompressor(level=9).compressobj()
    return {
        "one frame": (zstandard.ZstdCompressor(level=3).compress(DATA), DATA),
        "checksum, no content size": (zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
                                      .compress(DATA), DATA),
        "streamed": (stream.compress(DATA) + stream.flush(), DATA),
        "skippable frame first": (b"\x5a\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
                                  + zstandard.ZstdCompressor().compress(DATA), DATA),
        "RLE blocks": (zstandard.ZstdCompressor().compress(b"a" * 300000), b"a" * 300000),
    }


def test_open_input_reads_multi_member_gzip_and_multi_frame_zstd(tmp_path):
    parts = [b'{"text": "part %d"}\n' % i * 1000 for i in range(3)]
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(b"".join(gzip.compress(p) for p in parts))
    zst = tmp_path / "m.jsonl.zst"
    zst.write_bytes(b"".join(zstandard.ZstdCompressor().compress(p) for p in parts))
    for path, comp in ((gz, "gzip"), (zst, "zstd")):
        assert read_all(str(path), comp) == b"".join(parts), comp


@pytest.mark.parametrize("name", list(zstd_variants()))
def test_zstd_frame_checker_follows_every_kind_of_frame(tmp_path, name):
    data, want = zstd_variants()[name]
    checker = ZstdFrameChecker()
    for i in range(0, len(data), 5):
        checker.feed(data[i:i + 5])
        assert checker.complete == (i + 5 >= len(data)), (name, i)
    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(data)
    assert read_all(str(path), "zstd") == want


@pytest.mark.parametrize("comp", ["gzip", "zstd"])
def test_truncated_input_is_an_error_naming_the_file_and_offset(tmp_path, comp):
    """python-zstandard alone reads a truncated frame as a shorter file; every cut inside a frame must fail."""
    whole = gzip.compress(DATA, mtime=0) if comp == "gzip" else zstandard.ZstdCompressor().compress(DATA)
    path = tmp_path / ("t.jsonl.gz" if comp == "gzip" else "t.jsonl.zst")
    rng = random.Random(0)
    cuts = sorted({1, 2, 4, 10, len(whole) // 2, len(whole) - 1, *rng.sample(range(1, len(whole)), 25)})
    for cut in cuts:
        path.write_bytes(whole[:cut])
        with pytest.raises(DamagedInput) as e:
            read_all(str(path), comp)
        assert e.value.path == str(path) and 0 <= e.value.offset <= len(DATA)
        assert str(path) in str(e.value) and f"after {e.value.offset} uncompressed bytes" in str(e.value)
    path.write_bytes(whole)
    assert read_all(str(path), comp) == DATA


def test_corrupt_gzip_and_checksummed_zstd_are_errors(tmp_path):
    rng = random.Random(1)
    gz = gzip.compress(DATA, mtime=0)
    zst = zstandard.ZstdCompressor(write_checksum=True).compress(DATA)
    for whole, name, comp in ((gz, "c.jsonl.gz", "gzip"), (zst, "c.jsonl.zst", "zstd")):
        path = tmp_path / name
        for _ in range(15):
            bad = bytearray(whole)
            at = rng.randrange(10, len(bad))  # past the headers, which no checksum covers
            bad[at] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(bad))
            with pytest.raises(DamagedInput, match=name):
                read_all(str(path), comp)


def test_trailing_garbage_after_a_zstd_frame_is_an_error(tmp_path):
    path = tmp_path / "g.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(DATA) + b"not a frame")
    with pytest.raises(DamagedInput, match="g.jsonl.zst"):
        read_all(str(path), "zstd")
