"""Columnar inputs on gs:// (a local Cloud Storage emulator): detected, planned and read by byte ranges like
local files, with the same records and checksums."""

from __future__ import annotations

import pytest

pytest.importorskip("gcsfs", reason="the gcs extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")

import dataclasses  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402

from columnar_files import corpus_table, save_to_disk, write_arrow, write_parquet  # noqa: E402
from gcs_emulator import GcsEmulator  # noqa: E402
from pipelines.inputs import formats  # noqa: E402
from pipelines.inputs.columnar import ARROW, PARQUET, ChunkReader, plan  # noqa: E402
from pipelines.inputs.ranges import ByteSource  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("columnar_gcs")
    t = corpus_table(400)
    saved = save_to_disk(d / "saved", t, num_shards=2)
    return {"a.parquet": (write_parquet(d / "a.parquet", t, row_group_size=50), PARQUET),
            "b.arrow": (write_arrow(d / "b.arrow", t, batch_rows=60), ARROW),
            "c.arrow": (write_arrow(d / "c.arrow", t, stream=False, batch_rows=60), ARROW)}, saved


@pytest.fixture(scope="module")
def emulator(files):
    singles, saved = files
    with GcsEmulator(bucket="columnar") as emu:
        for name, (path, _) in singles.items():
            emu.upload(path, "in/" + name)
        for name in ("state.json", "dataset_info.json", "data-00000-of-00002.arrow", "data-00001-of-00002.arrow"):
            emu.upload(f"{saved}/{name}", "saved/" + name)
        yield emu


def records(layout, opts=None, source=None):
    out = []
    for k in range(len(layout.chunks)):
        r = ChunkReader(layout, k, text_key="text", keep_fields=("source",), storage_options=opts, source=source)
        out += [(rec.row, rec.text, rec.fields) for rec in r]
        out.append(r.checksum)
    return out


@pytest.mark.slow
def test_gs_inputs_read_like_local_files(files, emulator):
    singles, _ = files
    opts = emulator.storage_options
    for name, (local, fmt) in singles.items():
        url = emulator.url("in/" + name)
        assert formats.detect(url, opts) == formats.detect(local)
        remote = plan(url, fmt, text_key="text", keep_fields=("source",), chunk_bytes=30000, storage_options=opts)
        here = plan(local, fmt, text_key="text", keep_fields=("source",), chunk_bytes=30000)
        assert dataclasses.replace(remote, path=local) == here
        assert records(remote, opts) == records(here)
    whole = plan(emulator.url("in/a.parquet"), PARQUET, text_key="text", keep_fields=("source",), chunk_bytes=1 << 30,
                 storage_options=opts)
    meta = pq.ParquetFile(singles["a.parquet"][0]).metadata
    columns = sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
                  for c in range(meta.num_columns) if meta.schema.column(c).path in ("text", "source"))
    # one chunk: its text and source columns (the footer was parsed when planned, and is parsed once per
    # process while the object keeps its generation)
    with ByteSource(emulator.url("in/a.parquet"), opts) as src:
        assert len(records(whole, opts, src)) == 401 and src.bytes_read == columns


def test_gs_save_to_disk_directory(files, emulator):
    _, saved = files
    paths = formats.saved_dataset_files(emulator.url("saved"), emulator.storage_options)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    local = formats.saved_dataset_files(saved)
    for url, path in zip(paths, local):
        remote = plan(url, ARROW, text_key="text", keep_fields=("source",), chunk_bytes=30000,
                      storage_options=emulator.storage_options)
        assert records(remote, emulator.storage_options) == records(
            plan(path, ARROW, text_key="text", keep_fields=("source",), chunk_bytes=30000))
