"""Parquet and Arrow inputs (pipelines/inputs/columnar.py, arrow_ipc.py, ranges.py): chunks of whole groups
planned from metadata, every row once in order with its row number, only the columns read, a checksum of
the bytes read, dead letters, refusals and damage."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from columnar_files import corpus_table, save_to_disk, write_arrow, write_parquet
from pipelines.errors import BuildError, DamagedFile
from pipelines.inputs import arrow_ipc, formats, parquet
from pipelines.inputs.keys import RecordShape
from pipelines.inputs.columnar import ARROW, PARQUET, ChunkReader, chunk_checksum, plan, plan_chunks
from pipelines.inputs.rows import dead_letter
from pipelines.inputs.ranges import ByteSource

N = 600
KEEP = ("source", "id")


@pytest.fixture(scope="module")
def table():
    return corpus_table(N)


def read_all(layout, text_key="text", keep=KEEP, source=None):
    """Every record of every chunk, and each chunk's (checksum, span, row_range)."""
    records, chunks = [], []
    for k in range(len(layout.chunks)):
        reader = ChunkReader(layout, k, text_key=text_key, keep_fields=keep, source=source)
        records += list(reader)
        chunks.append((reader.checksum, reader.span, reader.row_range))
    return records, chunks


def test_plan_chunks_takes_whole_groups_until_chunk_bytes():
    assert plan_chunks([], 10) == ()
    assert plan_chunks([4, 4, 4, 4, 4], 10) == ((0, 3), (3, 5))
    assert plan_chunks([30, 1, 1], 10) == ((0, 1), (1, 3))  # a large group is a chunk of its own
    assert plan_chunks([10, 10], 10) == ((0, 1), (1, 2))
    assert plan_chunks([0, 0, 0], 10) == ((0, 3),)


def expected(table, text_key="text"):
    texts = table.column(text_key).to_pylist() if "." not in text_key else \
        [m["text"] for m in table.column("metadata").to_pylist()]
    return [(i, t, (s, str(i))) for i, (t, s) in enumerate(zip(texts, table.column("source").to_pylist()))]


@pytest.mark.parametrize("codec", ["zstd", "snappy"])
@pytest.mark.parametrize("row_group_size", [7, 400])
def test_parquet_every_row_once_in_order_with_its_row_number(tmp_path, table, codec, row_group_size):
    path = write_parquet(tmp_path / "c.parquet", table, compression=codec, row_group_size=row_group_size)
    layout = plan(path, PARQUET, text_key="text", keep_fields=KEEP, chunk_bytes=20000)
    groups = pq.ParquetFile(path).metadata.num_row_groups
    assert len(layout.group_rows) == groups and layout.rows == N
    # chunks are consecutive runs of whole row groups covering the file
    assert [g for c in layout.chunks for g in range(*c)] == list(range(groups))
    assert layout.chunks == plan_chunks(layout.group_bytes, 20000) and len(layout.chunks) > 1
    assert (max(g1 - g0 for g0, g1 in layout.chunks) > 1) == (row_group_size == 7)
    records, chunks = read_all(layout)
    assert [(r.row, r.text, r.fields) for r in records] == expected(table)
    assert all(r.reason is None for r in records)
    assert [c[2] for c in chunks] == [list(layout.row_range(k)) for k in range(len(layout.chunks))]
    assert chunks[0][2][0] == 0 and chunks[-1][2][1] == N
    for k, (checksum, span, _) in enumerate(chunks):
        assert span == list(layout.chunks[k])
        assert checksum == chunk_checksum(layout, k, text_key="text", keep_fields=KEEP)  # without decoding


def test_every_format_yields_the_same_records(tmp_path, table):
    inputs = {
        "parquet zstd, small row groups": (write_parquet(tmp_path / "a.parquet", table, row_group_size=9), PARQUET),
        "parquet snappy, one row group": (write_parquet(tmp_path / "b.parquet", table, compression="snappy",
                                                        row_group_size=N), PARQUET),
        "arrow stream": (write_arrow(tmp_path / "s.arrow", table, stream=True, batch_rows=50), ARROW),
        "arrow file": (write_arrow(tmp_path / "f.arrow", table, stream=False, batch_rows=77), ARROW),
    }
    want = expected(table, "metadata.text")
    for name, (path, fmt) in inputs.items():
        layout = plan(path, fmt, text_key="metadata.text", keep_fields=KEEP, chunk_bytes=5000)
        assert formats.detect(path).kind == fmt
        records, _ = read_all(layout, "metadata.text")
        assert [(r.row, r.text, r.fields) for r in records] == want, name
    # a save_to_disk directory: its files in state.json order, rows numbered per file
    got = []
    for path in formats.saved_dataset_files(save_to_disk(tmp_path / "saved", table, num_shards=3)):
        records, _ = read_all(plan(path, ARROW, text_key="metadata.text", keep_fields=KEEP, chunk_bytes=5000),
                              "metadata.text")
        assert records[0].row == 0
        got += [(r.text, r.fields) for r in records]
    assert got == [(t, f) for _, t, f in want]


def test_a_chunk_reads_only_its_column_chunks(tmp_path, table):
    wide = table.append_column("big", pa.array(["z%d" % i * 500 for i in range(N)]))
    path = write_parquet(tmp_path / "w.parquet", wide, compression="snappy", row_group_size=50)
    layout = plan(path, PARQUET, text_key="text", chunk_bytes=30000)
    meta = pq.ParquetFile(path).metadata
    text = [c for c in range(meta.num_columns) if meta.schema.column(c).path == "text"][0]
    size = layout.size
    parquet._FOOTERS.clear()  # as in a new worker process
    for k in (0, len(layout.chunks) - 1):
        with ByteSource(path) as src:
            records = list(ChunkReader(layout, k, text_key="text", source=src))
            column_chunks = sum(meta.row_group(g).column(text).total_compressed_size for g in range(*layout.chunks[k]))
            footer = int.from_bytes(open(path, "rb").read()[-8:-4], "little") + 8
            assert footer == layout.footer_bytes > 64 << 10  # (statistics of the wide column)
            # the footer (the first chunk a process reads of the file), then its text column chunks
            assert src.bytes_read == (footer if k == 0 else 0) + column_chunks
        assert len(records) == sum(layout.group_rows[slice(*layout.chunks[k])])
    assert column_chunks < size / 20


def test_planning_an_arrow_stream_reads_its_message_headers_only(tmp_path, table):
    path = write_arrow(tmp_path / "s.arrow", corpus_table(3000), stream=True, batch_rows=100)
    with ByteSource(path) as src:
        layout = plan(path, ARROW, text_key="text", chunk_bytes=100000, source=src)
        assert len(layout.group_rows) == 30 and layout.rows == 3000
        assert src.bytes_read <= 31 * arrow_ipc.HEAD_READ + 2 * arrow_ipc.HEAD_READ < layout.size / 4


def test_checksum_follows_exactly_the_bytes_read(tmp_path, table):
    def checksums(t, name, **kw):
        layout = plan(write_parquet(tmp_path / name, t, row_group_size=100, **kw), PARQUET, text_key="text",
                      keep_fields=("source",), chunk_bytes=1)
        return [chunk_checksum(layout, k, text_key="text", keep_fields=("source",)) for k in range(len(layout.chunks))]

    base = checksums(table, "base.parquet")
    assert len(base) == 6 and len(set(base)) == 6
    texts = table.column("text").to_pylist()
    texts[250] = texts[250].replace("doc", "Doc")  # one byte of row group 2
    edited = checksums(table.set_column(1, "text", pa.array(texts)), "edited.parquet")
    assert [a == b for a, b in zip(base, edited)] == [True, True, False, True, True, True]
    # a column that is not read does not change any chunk; the kept field does
    assert checksums(table.set_column(0, "id", pa.array(range(1, N + 1))), "ids.parquet") == base
    sources = table.column("source").to_pylist()
    sources[599] = "other"
    assert checksums(table.set_column(2, "source", pa.array(sources)), "src.parquet")[:5] == base[:5]
    # the bytes themselves, not only their lengths: the same edit without a codec keeps every size
    plain = checksums(table, "plain.parquet", compression="none", write_statistics=False)
    edited_plain = checksums(table.set_column(1, "text", pa.array(texts)), "plain-edited.parquet",
                             compression="none", write_statistics=False)
    assert [a == b for a, b in zip(plain, edited_plain)] == [True, True, False, True, True, True]
    assert os.path.getsize(tmp_path / "plain.parquet") == os.path.getsize(tmp_path / "plain-edited.parquet")
    # Arrow: the batch messages as stored
    arrow = [plan(write_arrow(tmp_path / f"{i}.arrow", t, batch_rows=100), ARROW, text_key="text", chunk_bytes=1)
             for i, t in enumerate([table, table.set_column(1, "text", pa.array(texts))])]
    sums = [[chunk_checksum(a, k, text_key="text") for k in range(6)] for a in arrow]
    assert [a == b for a, b in zip(*sums)] == [True, True, False, True, True, True]


def test_bad_texts_are_records_with_their_reason_and_row(tmp_path):
    texts = ["good", None, "", "also good", b"\xff\xfe not utf-8", "last"]
    t = pa.table({"text": pa.array([x.encode() if isinstance(x, str) else x for x in texts], pa.binary()),
                  "source": pa.array(["a", "b", "c", "d", "e", None]),
                  "n": pa.array([1, 2, None, 4, 5, 6], pa.int32())})
    for path, fmt in [(write_parquet(tmp_path / "b.parquet", t, row_group_size=4), PARQUET),
                      (write_arrow(tmp_path / "b.arrow", t, batch_rows=4), ARROW)]:
        records, _ = read_all(plan(path, fmt, text_key="text", keep_fields=("source", "n"), chunk_bytes=1 << 20),
                              keep=("source", "n"))
        assert [(r.row, r.text, r.reason, r.value, r.fields) for r in records] == [
            (0, "good", None, None, ("a", "1")),
            (1, None, "null_text", None, ("b", "2")),
            (2, None, "empty_text", "", ("c", None)),
            (3, "also good", None, None, ("d", "4")),
            (4, None, "invalid_utf8", b"\xff\xfe not utf-8", ("e", "5")),
            (5, "last", None, None, (None, "6"))]
        assert records[4].detail == "invalid start byte at byte 0"
        assert [dead_letter(path, 3, r) for r in records if r.reason] == [
            {"file": path, "shard": 3, "row": 1, "reason": "null_text", "detail": "", "value": None},
            {"file": path, "shard": 3, "row": 2, "reason": "empty_text", "detail": "", "value": ""},
            {"file": path, "shard": 3, "row": 4, "reason": "invalid_utf8", "detail": "invalid start byte at byte 0",
             "value_base64": "//4gbm90IHV0Zi04"}]


def test_invalid_utf8_in_a_string_column_and_a_null_parent(tmp_path):
    text = pa.array([b"fine", b"\xc3(", b"ok"], pa.binary()).view(pa.string())
    meta = pa.StructArray.from_arrays([pa.array(["x", "y", "z"]), pa.array([b"s", b"\xff", b"u"]).view(pa.string())],
                                      names=["text", "src"], mask=pa.array([False, False, True]))
    t = pa.table({"text": text, "metadata": meta})
    path = write_parquet(tmp_path / "u.parquet", t)
    records, _ = read_all(plan(path, PARQUET, text_key="text", chunk_bytes=1 << 20), keep=())
    assert [(r.text, r.reason) for r in records] == [("fine", None), (None, "invalid_utf8"), ("ok", None)]
    records, _ = read_all(plan(path, PARQUET, text_key="metadata.text", keep_fields=("metadata.src",),
                               chunk_bytes=1 << 20), "metadata.text", ("metadata.src",))
    assert [(r.text, r.reason, r.fields) for r in records] == [
        ("x", None, ("s",)), (None, "bad_field", (b"\xff",)), (None, "null_text", (None,))]


def test_refusals_before_any_work(tmp_path, table):
    path = write_parquet(tmp_path / "r.parquet", table.rename_columns(["id", "content", "source", "metadata"]))
    with pytest.raises(BuildError, match=r"input file .*r.parquet has no column 'text' \(--text_key text\). Its "
                                         r"columns: id \(int64\), content \(string\).*; pass --text_key content\?"):
        plan(path, PARQUET, text_key="text", chunk_bytes=1000)
    with pytest.raises(BuildError, match="has no column 'metadata.body'"):
        plan(path, PARQUET, text_key="metadata.body", chunk_bytes=1000)
    with pytest.raises(BuildError, match="column 'id' is int64, not text; --text_key must name a string column"):
        plan(path, PARQUET, text_key="id", chunk_bytes=1000)
    with pytest.raises(BuildError, match="has no column 'url' \\(--keep_fields url\\)"):
        plan(path, PARQUET, text_key="content", keep_fields=("url",), chunk_bytes=1000)
    floats = write_parquet(tmp_path / "f.parquet", pa.table({"text": ["a"], "score": [0.5]}))
    with pytest.raises(BuildError, match="column 'score' is double; --keep_fields keeps string and integer columns"):
        plan(floats, PARQUET, text_key="text", keep_fields=("score",), chunk_bytes=1000)  # a cache before version 4
    shape = RecordShape(floats=True)  # version 4: a float column is kept as its shortest exact text
    layout = plan(floats, PARQUET, text_key="text", keep_fields=("score",), chunk_bytes=1000, shape=shape)
    assert [r.fields for r in ChunkReader(layout, 0, text_key="text", keep_fields=("score",), shape=shape)] == [("0.5",)]
    big = write_arrow(tmp_path / "big.arrow", table, batch_rows=N)
    with pytest.raises(BuildError, match=r"record batch 0 holds 1.1 MiB to decode \(600 rows\), above the 0.1 MiB "
                                         r"a worker decodes at once. Rewrite the file with smaller record batches"):
        plan(big, ARROW, text_key="text", chunk_bytes=1000, max_group_bytes=100000)
    with pytest.raises(BuildError, match="row group 0 .* smaller row groups .*row_group_size=ROWS"):
        plan(write_parquet(tmp_path / "g.parquet", table, row_group_size=N), PARQUET, text_key="text",
             chunk_bytes=1000, max_group_bytes=100000)


def damaged(path: str, match: str, fmt=PARQUET, k=None):
    with pytest.raises(DamagedFile, match=f"input file {path} is damaged: {match}"):
        layout = plan(path, fmt, text_key="text", chunk_bytes=1)
        for i in range(len(layout.chunks)) if k is None else [k]:
            list(ChunkReader(layout, i, text_key="text"))


def test_damaged_parquet_is_an_error_naming_the_file(tmp_path, table):
    data = open(write_parquet(tmp_path / "ok.parquet", table, row_group_size=100), "rb").read()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) * 2 // 3])
    damaged(str(tmp_path / "cut.parquet"), "no closing PAR1 magic")
    n = int.from_bytes(data[-8:-4], "little")
    garbled = data[:-8 - n] + bytes(b ^ 0x5A for b in data[-8 - n:-8]) + data[-8:]
    (tmp_path / "footer.parquet").write_bytes(garbled)
    damaged(str(tmp_path / "footer.parquet"), "an unreadable Parquet footer")
    # a corrupted page: only the chunk holding it fails, naming its row group. The codec notices (zstd), or
    # the page CRC when the writer stored one (here with no codec at all)
    for name, kw in [("zstd.parquet", {}), ("crc.parquet", dict(compression="none", write_page_checksum=True))]:
        data = open(write_parquet(tmp_path / f"ok-{name}", table, row_group_size=100, **kw), "rb").read()
        col = pq.ParquetFile(tmp_path / f"ok-{name}").metadata.row_group(2).column(1)
        at = col.dictionary_page_offset + col.total_compressed_size // 3
        (tmp_path / name).write_bytes(data[:at] + bytes(b ^ 0xFF for b in data[at:at + 8]) + data[at + 8:])
        layout = plan(str(tmp_path / name), PARQUET, text_key="text", chunk_bytes=1)
        assert len(list(ChunkReader(layout, 1, text_key="text"))) == 100
        damaged(str(tmp_path / name), r"its pages do not decode .* \(row group 2\)", k=2)


def test_damaged_arrow_is_an_error_naming_the_file(tmp_path, table):
    t = table.select(["text"])
    stream = open(write_arrow(tmp_path / "ok.arrow", t, batch_rows=100), "rb").read()
    ipc = arrow_ipc.scan("ok", lambda o, n: stream[o:o + n], len(stream))
    b = ipc.batches[3]
    (tmp_path / "mid.arrow").write_bytes(stream[:b.offset + b.length // 2])
    damaged(str(tmp_path / "mid.arrow"), "an Arrow message of .* runs past the end of the file", ARROW)
    (tmp_path / "boundary.arrow").write_bytes(stream[:b.offset])  # cut where a message starts: still damage
    damaged(str(tmp_path / "boundary.arrow"), "the Arrow stream ends without its end-of-stream marker", ARROW)
    body = b.offset + 8 + int.from_bytes(stream[b.offset + 4:b.offset + 8], "little")
    (tmp_path / "offsets.arrow").write_bytes(stream[:body] + b"\xff" * 16 + stream[body + 16:])
    damaged(str(tmp_path / "offsets.arrow"), r"it does not decode .* \(record batch 3 at byte", ARROW)
    (tmp_path / "header.arrow").write_bytes(stream[:b.offset + 8] + b"\x07" * 16 + stream[b.offset + 24:])
    damaged(str(tmp_path / "header.arrow"), "a damaged Arrow message header", ARROW)
    file_format = open(write_arrow(tmp_path / "f.arrow", t, stream=False), "rb").read()
    (tmp_path / "cut.arrow").write_bytes(file_format[:-3])
    damaged(str(tmp_path / "cut.arrow"), "an Arrow file without its closing ARROW1 magic", ARROW)


def test_a_file_changed_after_planning_is_refused(tmp_path, table):
    path = write_parquet(tmp_path / "c.parquet", table)
    layout = plan(path, PARQUET, text_key="text", chunk_bytes=1)
    write_parquet(tmp_path / "c.parquet", table.slice(0, N - 1))
    with pytest.raises(BuildError, match="changed during the build"):
        list(ChunkReader(layout, 0, text_key="text"))
    path = write_arrow(tmp_path / "c.arrow", table)
    layout = plan(path, ARROW, text_key="text", chunk_bytes=1)
    before = chunk_checksum(layout, 0, text_key="text")
    texts = table.column("text").to_pylist()
    write_arrow(tmp_path / "c.arrow", table.set_column(1, "text", pa.array([t.swapcase() for t in texts])))
    assert plan(path, ARROW, text_key="text", chunk_bytes=1) == layout  # same sizes: the layout cannot tell,
    assert chunk_checksum(layout, 0, text_key="text") != before  # the checksum does (a rerun rebuilds the chunk)
