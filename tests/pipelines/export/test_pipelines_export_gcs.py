"""The Beam export to gs:// (a local Cloud Storage emulator): the parts are joined by Cloud Storage compose,
through a tree of intermediate objects when there are more than 32, into the same bytes as the CLI's local
export, with no temporary object left."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="the gcs extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (test extra) is not installed")

import cachegen  # noqa: E402
import interop_ref as ref  # noqa: E402
from gcs_emulator import GcsEmulator  # noqa: E402
from pipelines.export import job as export  # noqa: E402
from pipelines.export.finalize import COMPOSE_LIMIT  # noqa: E402
from reader.cli.main import main as reader_main  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_gs_export_composes_the_parts_into_the_clis_bytes(tmp_path):
    root = str(tmp_path / "cache")
    chunks = cachegen.random_chunks(np.random.default_rng(11), 3 * COMPOSE_LIMIT // 2, vocab=1000, empty_prob=0.05)
    ref.synthetic_cache(root, chunks, vocab_size=1000, chunks_per_shard=[30, 18])
    assert reader_main(["export", root, "--format", "megatron", "--out", str(tmp_path / "cli" / "m")]) == 0
    with GcsEmulator(bucket="export-test") as emu, emu.beam_env():
        got = export.run([root, "--format", "megatron", "--out", emu.url("exports/m"), "--part_bytes", "1",
                          "--runner=FnApiRunner"])
        assert len(got["plan"].parts) > COMPOSE_LIMIT  # two levels of compose
        assert "joined by compose" in got["summary"]
        fs = emu.gcsfs()
        fs.invalidate_cache()
        assert sorted(fs.find(f"{emu.bucket}/exports")) == [f"{emu.bucket}/exports/m.bin",
                                                            f"{emu.bucket}/exports/m.idx"]
        for ext in ("bin", "idx"):
            assert fs.cat_file(f"{emu.bucket}/exports/m.{ext}") == (tmp_path / "cli" / f"m.{ext}").read_bytes(), ext
