"""benchmarks/view_cost.py runs on a tiny cache and reports finite figures (no timing assertion); its view keeps
the documents it says."""

from __future__ import annotations

import json
import math

from benchmarks import view_cost
from benchmarks.common import RESULT_PREFIX
from reader import ReadOptions, Reader


def test_view_cost_runs_and_its_view_keeps_what_it_says(tmp_path, capsys):
    view_cost.main(["--work", str(tmp_path), "--tokens", "300000", "--rounds", "1"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RESULT_PREFIX)][-1]
    res = json.loads(line[len(RESULT_PREFIX):])
    for read in ("train", "train_1p", "best_fit_1p"):
        for figure in (f"view_{read}_ratio", f"view_{read}_cpu_ratio"):
            assert math.isfinite(res[figure]) and res[figure] > 0, figure
    assert 0.7 < res["view_kept_docs_share"] < 0.9 and 0.7 < res["view_kept_tokens_share"] < 0.9
    root = str(tmp_path / "cache-300000")
    opts = ReadOptions(seq_len=512, batch_size=4, ideal_readers=2, eval_mode=True)
    with Reader(root, opts) as whole, Reader(root, ReadOptions(**{**opts.__dict__, "view": "language_score >= 0.2"})) as view:
        ratio = view.num_examples / whole.num_examples
    assert abs(ratio - res["view_kept_tokens_share"]) < 0.01


def test_the_report_has_a_row_per_read_with_both_ratios():
    from benchmarks import report

    fig = {"view_train_ratio": 0.83, "view_cost_tokens": 96 << 20, "view_kept_docs_share": 0.8,
           "view_kept_tokens_share": 0.8, "view_cost_rounds": 3}
    for k, read in enumerate(("train", "train_1p", "best_fit_1p")):
        fig[f"view_{read}_ratio"], fig[f"view_{read}_cpu_ratio"] = 0.81 + k / 100, 0.71 + k / 100
    text = "\n".join(report.view_read_section(fig))
    assert "96 Mi tokens" in text and "80.0% of the documents" in text
    assert text.count("\n| ") == 4 and "through the chunk store" not in text  # (header, 3 reads: no decode-only one)
    assert report.view_read_section({}) == []
    assert any(key == "view_train_ratio" for key, _, _ in report.MAIN_ROWS)
