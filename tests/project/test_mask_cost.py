"""benchmarks/mask_cost.py runs on a tiny pair of caches and reports finite figures (no timing assertion)."""

from __future__ import annotations

import json
import math

from benchmarks import mask_cost
from benchmarks.common import RESULT_PREFIX
from reader import ReadOptions, Reader


def test_mask_cost_runs_and_its_caches_are_the_same_documents(tmp_path, capsys):
    mask_cost.main(["--work", str(tmp_path), "--tokens", "300000", "--rounds", "1"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RESULT_PREFIX)][-1]
    res = json.loads(line[len(RESULT_PREFIX):])
    for read in ("decode", "train", "train_1p", "best_fit_1p"):
        for figure in (f"mask_{read}_ratio", f"mask_{read}_cpu_ratio"):
            assert math.isfinite(res[figure]) and res[figure] > 0, figure
    assert 0.3 < res["mask_loss_token_share"] < 0.9 and res["mask_bytes_per_token"] > 0
    opts = ReadOptions(seq_len=512, batch_size=4, ideal_readers=2)
    with Reader(str(tmp_path / "plain"), opts) as plain, Reader(str(tmp_path / "masked"), opts) as masked:
        a, b = plain.batch(3), masked.batch(3)
        assert (a["targets"] == b["targets"]).all() and a["loss_mask"].all() and not b["loss_mask"].all()


def test_the_report_has_a_row_per_read_with_both_ratios():
    from benchmarks import report

    fig = {"mask_train_ratio": 0.94, "mask_cost_tokens": 96 << 20, "mask_loss_token_share": 0.6,
           "mask_bytes_per_token": 0.014, "mask_cost_rounds": 3}
    for k, (read, _) in enumerate(report.MASK_READS):
        fig[f"mask_{read}_ratio"], fig[f"mask_{read}_cpu_ratio"] = 0.81 + k / 100, 0.71 + k / 100
    text = "\n".join(report.mask_read_section(fig))
    assert "96 Mi tokens" in text and "60% of the tokens" in text
    for k, (_, what) in enumerate(report.MASK_READS):
        assert f"| {what} | {0.81 + k / 100:.3f} | {0.71 + k / 100:.3f} |" in text
    assert report.mask_read_section({}) == []
    assert any(key == "mask_train_ratio" for key, _, _ in report.MAIN_ROWS)
