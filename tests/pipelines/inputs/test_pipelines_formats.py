"""Input formats (pipelines/inputs/formats.py): chosen by name, checked against the bytes, refused when they
disagree; datasets' save_to_disk directories in state.json order."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
import zstandard

from columnar_files import corpus_table, save_to_disk, write_arrow, write_jsonl, write_parquet
from pipelines.errors import DamagedFile
from pipelines.inputs import formats
from pipelines.inputs.formats import ARROW, JSON_ARRAY, JSONL, PARQUET, InputFormat, UnsupportedInput, detect

LINES = b'{"text": "a"}\n{"text": "b"}\n'


@pytest.fixture(scope="module")
def table():
    return corpus_table(50)


def test_text_formats_by_name_plain_and_compressed(tmp_path):
    cases = {
        "a.jsonl": (LINES, InputFormat(JSONL)),
        "b.ndjson": (LINES, InputFormat(JSONL)),
        "c.JSONL.GZ": (gzip.compress(LINES), InputFormat(JSONL, "gzip")),
        "d.jsonl.zst": (zstandard.ZstdCompressor().compress(LINES), InputFormat(JSONL, "zstd")),
        "e.json": (LINES, InputFormat(JSONL)),
        # one JSON array: told apart by the first byte that is not whitespace (after a byte-order mark)
        "f.json": (b"\xef\xbb\xbf \n\t[{\"text\": \"a\"}]", InputFormat(JSON_ARRAY)),
        "g.json.gz": (gzip.compress(b'[{"text": "a"}]'), InputFormat(JSON_ARRAY, "gzip")),
        "h.json.zst": (zstandard.ZstdCompressor().compress(b'  [{"text": "a"}]'), InputFormat(JSON_ARRAY, "zstd")),
        "empty.jsonl": (b"", InputFormat(JSONL)),
        "blank.json": (b"  \n", InputFormat(JSONL)),
    }
    for name, (data, want) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert detect(str(tmp_path / name)) == want, name


def test_columnar_formats_by_name_and_magic(tmp_path, table):
    for codec in ("zstd", "snappy"):
        assert detect(write_parquet(tmp_path / f"{codec}.parquet", table, compression=codec)) == InputFormat(PARQUET)
    assert detect(write_arrow(tmp_path / "s.arrow", table, stream=True)) == InputFormat(ARROW)
    assert detect(write_arrow(tmp_path / "f.arrow", table, stream=False)) == InputFormat(ARROW)
    saved = save_to_disk(tmp_path / "saved", table, num_shards=2)
    for path in formats.saved_dataset_files(saved):
        assert detect(path) == InputFormat(ARROW)  # datasets writes the stream format
        assert open(path, "rb").read(4) == b"\xff\xff\xff\xff"


def refusal(path) -> str:
    with pytest.raises(UnsupportedInput) as e:
        detect(str(path))
    msg = str(e.value)
    assert str(path) in msg and "formats accepted" in msg or "Parquet compresses" in msg or "encrypted" in msg, msg
    return msg


def test_a_parquet_file_named_jsonl_is_refused_naming_what_it_is(tmp_path, table):
    pq_path = write_parquet(tmp_path / "x.parquet", table)
    shutil.copy(pq_path, tmp_path / "part-0.jsonl")
    msg = refusal(tmp_path / "part-0.jsonl")
    assert "holds a Parquet file; rename it to *.parquet" in msg
    shutil.copy(write_arrow(tmp_path / "s.arrow", table), tmp_path / "s.jsonl")
    assert "an Arrow IPC stream; rename it to *.arrow" in refusal(tmp_path / "s.jsonl")


@pytest.mark.parametrize("name,data,says", [
    ("notes.txt", LINES, "unknown format (extension '.txt')"),
    ("data.csv", b"a,b\n", "unknown format (extension '.csv')"),
    ("README", b"hello", "unknown format (no extension)"),
    ("x.parquet.gz", b"", "Parquet compresses its own data"),
    ("gz-named-plain.jsonl", gzip.compress(LINES), "holds gzip-compressed data; rename it to *.jsonl.gz"),
    ("plain-named-gz.jsonl.gz", LINES, "named *.gz but holds bytes that are not gzip data"),
    ("plain-named-zst.jsonl.zst", LINES, "named *.zst but holds bytes that are not zstd data"),
    ("text.parquet", LINES, "named *.parquet but holds text"),
    ("text.arrow", LINES, "named *.arrow but holds text"),
    ("binary.jsonl", b'{"text": "a"}\n' + b"\x00\x01\x02" * 20, "binary data (NUL bytes in its first 4 KiB)"),
    ("utf16.jsonl", '{"text": "a"}\n'.encode("utf-16"), "UTF-16 text (convert it to UTF-8)"),
    ("zip.json", b"PK\x03\x04rest", "a zip archive"),
    ("encrypted.parquet", b"PAR1" + b"\0" * 20 + b"PARE", "an encrypted Parquet file"),
])
def test_refusals_name_the_file_and_the_fix(tmp_path, name, data, says):
    (tmp_path / name).write_bytes(data)
    assert says in refusal(tmp_path / name)


def test_truncated_columnar_files_are_damage_not_another_format(tmp_path, table):
    for path in [write_parquet(tmp_path / "p.parquet", table), write_arrow(tmp_path / "f.arrow", table, stream=False)]:
        data = open(path, "rb").read()
        cut = tmp_path / f"cut-{path.rsplit('/', 1)[1]}"
        cut.write_bytes(data[:len(data) // 2])
        with pytest.raises(DamagedFile, match=f"input file {cut} is damaged: .*truncated"):
            detect(str(cut))


def test_save_to_disk_directory_lists_its_arrow_files_in_state_order(tmp_path, table):
    saved = save_to_disk(tmp_path / "saved", table, num_shards=3)
    state = json.loads((tmp_path / "saved" / "state.json").read_text())
    names = [d["filename"] for d in state["_data_files"]]
    assert formats.saved_dataset_files(saved) == [f"{saved}/{n}" for n in names] and len(names) == 3
    # the order is state.json's, not the names' (datasets writes them in the same order, but it is the state
    # that defines the dataset)
    state["_data_files"].reverse()
    (tmp_path / "saved" / "state.json").write_text(json.dumps(state))
    assert formats.saved_dataset_files(saved) == [f"{saved}/{n}" for n in reversed(names)]
    # a directory of something else is not a saved dataset
    (tmp_path / "other").mkdir()
    write_jsonl(tmp_path / "other" / "a.jsonl", table)
    assert formats.saved_dataset_files(str(tmp_path / "other")) is None


def test_save_to_disk_refusals(tmp_path, table):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset(table), "test": datasets.Dataset(table.slice(0, 5))})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UnsupportedInput, match=r"DatasetDict \(splits: train, test\); pass one split's directory, "
                                               rf"e.g. --input {tmp_path}/dd/train"):
        formats.saved_dataset_files(str(tmp_path / "dd"))
    saved = save_to_disk(tmp_path / "s", table, num_shards=2)
    (tmp_path / "s" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(UnsupportedInput, match="state.json names 'data-00001-of-00002.arrow' .*, missing"):
        formats.saved_dataset_files(saved)
    (tmp_path / "s" / "state.json").write_text("{}")
    with pytest.raises(UnsupportedInput, match="is not a datasets state file"):
        formats.saved_dataset_files(saved)


def test_a_bad_line_holding_a_nul_byte_is_a_bad_record_not_a_binary_file(tmp_path):
    path = tmp_path / "some-bad.jsonl"
    path.write_bytes(LINES + b"\xff\xfe\x00garbage\n" + LINES)
    assert detect(str(path)) == InputFormat(JSONL)
