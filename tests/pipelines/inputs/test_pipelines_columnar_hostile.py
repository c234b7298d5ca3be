"""Parquet files that lie (tests/support/parquet_lies.py rewrites real ones): decoding is bounded by what is
decoded, never by what a footer or a page header claims; damage is one line naming the file and where; a file
of many row groups has its footer parsed once per worker. Files whose decoding could take memory without
bound are read in a child process whose address space is capped (a regression fails there, not the machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pytest

import parquet_lies as lies
from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs.columnar import PARQUET, ChunkReader, plan

# Runs in the child, capped at 3 GiB of address space: plans the file and reads every chunk (or the chunks
# argv[3] names), then prints what happened and how much its peak RSS grew while it did.
CHILD = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from pipelines.inputs import columnar
try:
    from pipelines.inputs import parquet
except ImportError:
    parquet = None
from pipelines.plan import ChunkConfig, MatchedFile, make_plan
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.time()
out = {"rows": 0}
try:
    layout = columnar.plan(sys.argv[1], "parquet", text_key="text", chunk_bytes=int(sys.argv[2]))
    out["chunks"] = len(layout.chunks)
    out["units"] = sum(1 for _ in (layout.chunk(k) for k in range(len(layout.chunks))))  # what work units carry
    which = json.loads(sys.argv[3]) if len(sys.argv) > 3 else range(len(layout.chunks))
    out["want"] = sum(layout.row_range(k)[1] - layout.row_range(k)[0] for k in which)
    for k in which:
        out["rows"] += sum(1 for _ in columnar.ChunkReader(layout, k))
    out["error"] = None
except Exception as e:
    out["error"] = [type(e).__name__, str(e)]
out.update(seconds=time.time() - t0, parses=getattr(parquet, "footer_parses", None),
           growth=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
print("RESULT " + json.dumps(out))
"""


def _read_in_child(path: str, chunk_bytes: int = 1 << 20, chunks=None, timeout: float = 90) -> dict:
    argv = [sys.executable, "-c", CHILD, path, str(chunk_bytes)] + ([json.dumps(chunks)] if chunks is not None else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, MALLOC_ARENA_MAX="2"))
    assert "RESULT " in proc.stdout, (proc.returncode, proc.stderr[-3000:])
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def _write(tmp_path, name: str, data: bytes) -> str:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _one_line(message: str, *said: str) -> None:
    assert "\n" not in message and all(s in message for s in said), message


def test_row_counts_a_footer_claims_bound_nothing_decoded(tmp_path):
    """A 655-byte file whose footer claims 2**40 rows grew the builder to 23.6 GB (pyarrow's read_row_group
    trusts the count). Every row decodes to 4 bytes at least, so a count of rows is a size: refused when
    planned, with the fix; likewise a page truly holding 2**31 - 1 nulls in a few bytes (an RLE run)."""
    small = lies.table_bytes(pa.table({"text": ["hello world", "xy", "zz"]}))
    for name, data, rows in (("claims.parquet", lies.claim_rows(small, 1 << 40), 1 << 40),
                             ("nulls.parquet", lies.nulls_file((1 << 31) - 1, (1 << 31) - 1), (1 << 31) - 1)):
        path = _write(tmp_path, name, data)
        assert len(data) < 1000
        got = _read_in_child(path)
        assert got["error"][0] == "BuildError" and got["rows"] == 0, got
        _one_line(got["error"][1], f"input file {path}: row group 0 holds", f"to decode ({rows} rows), above the "
                  "256.0 MiB a worker decodes at once. Rewrite the file with smaller row groups")
        assert got["growth"] < 64 << 20


def test_pages_holding_other_than_the_footers_rows_are_damage(tmp_path):
    """A footer claiming 100 rows over pages holding 137 built 100 documents with exit 0; 3 rows over a page
    of 2**31 - 1 nulls, 3. The pages' headers are read before decoding: damage, naming the column."""
    table = pa.table({"text": [f"document {i}" for i in range(137)]})
    for name, data, values, rows in (
            ("137.parquet", lies.claim_rows(lies.table_bytes(table), 100), 137, 100),
            ("nulls.parquet", lies.nulls_file((1 << 31) - 1, 3), (1 << 31) - 1, 3)):
        path = _write(tmp_path, name, data)
        got = _read_in_child(path)
        assert got["error"][0] == "DamagedFile" and got["rows"] == 0, got
        _one_line(got["error"][1], f"input file {path} is damaged: its pages hold {values} values, the footer says "
                  f"{rows} rows (row group 0, column 'text')")
        assert got["growth"] < 64 << 20


def test_a_dictionary_value_repeated_over_rows_is_counted_as_it_is_decoded(tmp_path):
    """A valid 271-byte file: one 120 KB value in the dictionary, 20,000 rows using it. Its stored pages pass
    the row-group check; decoded, it is 2.4 GB (4.5 GB of RSS after 23 s). It is decoded a batch at a time,
    the decoded bytes counted as they come out: refused at the row-group limit, memory bounded."""
    arr = pa.DictionaryArray.from_arrays(pa.array([0] * 20000, pa.int32()), pa.array(["x" * 120_000]))
    data = lies.table_bytes(pa.table({"text": arr}), compression="zstd", store_schema=False)
    path = _write(tmp_path, "dict.parquet", data)
    assert len(data) < 400
    got = _read_in_child(path)
    assert got["error"][0] == "BuildError", got
    _one_line(got["error"][1], f"input file {path}: row group 0 decodes to more than 256.0 MiB (its first ",
              "of 20000 rows already", "Rewrite the file with smaller row groups")
    assert got["growth"] < 512 << 20, f"peak RSS grew by {got['growth'] >> 20} MiB"


def test_a_column_chunk_outside_the_file_or_a_damaged_file_is_one_line_naming_it(tmp_path):
    """A negative ``data_page_offset`` was "unexpected failure (OSError)", naming no file and promising a
    resume; a truncated or holed file gave a two-line error (pyarrow's message holds a newline). Each is a
    one-line DamagedFile naming the file."""
    data = lies.table_bytes(pa.table({"text": [f"document number {i} " * 20 for i in range(2000)]}),
                            row_group_size=500, compression="zstd")
    path = _write(tmp_path, "neg.parquet", lies.with_data_page_offset(data, -5))
    with pytest.raises(DamagedFile) as e:
        plan(path, PARQUET, text_key="text", chunk_bytes=1 << 20)
    _one_line(str(e.value), f"input file {path} is damaged: its column chunk [-5, ", "lies outside the file's data "
              "[4, ", "(row group 0, column 'text')")
    seen = 0
    for cut in range(4, len(data), len(data) // 60):
        for variant in (data[:cut], data[:cut] + data[cut + 100:], data[:cut] + bytes([data[cut] ^ 0xFF]) + data[cut + 1:]):
            path = _write(tmp_path, "damaged.parquet", variant)
            try:
                layout = plan(path, PARQUET, text_key="text", chunk_bytes=1 << 20)
                for k in range(len(layout.chunks)):
                    list(ChunkReader(layout, k))
            except BuildError as err:
                _one_line(str(err), path)
                seen += 1
    assert seen > 100


def test_a_file_of_many_row_groups_has_its_footer_parsed_once_per_worker(tmp_path):
    """300,000 one-row groups and 64 KiB chunks: every chunk parsed the whole footer again (and summed the
    groups before it), RSS climbing as chunks finished (6 GB at 59%, 0.1 MB/s). Now a worker parses it once
    (a cache bounded in memory) and a chunk's rows come from prefix sums."""
    import pyarrow.parquet as pq

    n = 300_000
    path = str(tmp_path / "many.parquet")
    pq.write_table(pa.table({"text": [f"document {i} " + "word " * 15 for i in range(n)]}), path, row_group_size=1,
                   compression="none", write_statistics=False)
    got = _read_in_child(path, chunk_bytes=64 << 10, chunks=[0, 1, 100, 200, 300, 400, 450], timeout=120)
    assert got["error"] is None and got["chunks"] == got["units"] > 400, got
    assert got["parses"] == 1 and got["rows"] == got["want"] > 7 * 400, got
    assert got["seconds"] < 45 and got["growth"] < 600 << 20, got
