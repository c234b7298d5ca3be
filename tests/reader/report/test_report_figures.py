"""The numbers behind the report page's figures (reader/report/figures.py, reader/report/summary.py)."""

import numpy as np
import pytest

from reader.mixture.quotas import QuotaIndex
from reader.mixture.mixture_file import parse_mixture
from reader.order.shuffle import ShuffleConfig, shuffle_example_indices
from reader.report import figures
from reader.report.summary import length_sample


def test_log_histogram_counts_every_value_in_log_spaced_bins():
    values = [1, 1, 2, 10, 99, 100, 1000, 0]  # 0 (an empty document) counts in the first bin
    h = figures.log_histogram(values, bins=3)
    assert h.log and np.allclose(h.edges, [1, 10, 100, 1000])
    assert h.counts.tolist() == [4, 2, 2]  # [1,10): 0 1 1 2; [10,100): 10 99; [100,1000]: 100 1000
    assert h.total == len(values)
    assert figures.log_histogram([]).total == 0


def test_linear_histogram_spans_the_values():
    h = figures.linear_histogram([10, 20, 20, 30], bins=2)
    assert h.edges.tolist() == [10, 20, 30] and h.counts.tolist() == [1, 3]
    same = figures.linear_histogram([7, 7, 7], bins=4)  # one value: a bin around it
    assert same.total == 3 and same.edges[0] < 7 < same.edges[-1]


def test_tokens_per_shard_sums_the_chunks_of_each_shard():
    got = figures.tokens_per_shard([0, 1, 0, 2, 0], [5, 7, 1, 3, 10], num_shards=4)
    assert got.tolist() == [16, 7, 3, 0]


def test_tokens_per_value_keeps_the_largest_and_sums_the_rest():
    tally = {"web": (10, 500), "code": (3, 900), None: (1, 5), "books": (2, 500), "wiki": (1, 1)}
    assert figures.tokens_per_value(tally, top=3) == [("code", 900), ("books", 500), ("web", 500),
                                                      ("other (2 values)", 6)]
    assert figures.tokens_per_value({"a": 4, None: 9}) == [("(none)", 9), ("a", 4)]  # plain token counts too


def test_bad_record_rows_most_frequent_first_with_shares():
    rows = figures.bad_record_rows({"invalid_json": 3, "blank_line": 1, "empty_text": 0, "missing_text": 3})
    assert rows == [("invalid_json", 3, 3 / 7), ("missing_text", 3, 3 / 7), ("blank_line", 1, 1 / 7)]
    assert figures.bad_record_rows({}) == []


def test_dead_letter_examples_are_few_per_reason_and_truncated():
    records = [{"reason": "invalid_json", "file": "a.jsonl", "offset": i * 10, "detail": "x", "line": "y" * 500}
               for i in range(5)]
    records.append({"reason": "invalid_utf8", "file": "b.jsonl", "offset": 3, "detail": "", "line_base64": "AAAA"})
    got = figures.dead_letter_examples(records, per_reason=2, limit=20)
    assert [e["offset"] for e in got["invalid_json"]] == [0, 10]
    assert got["invalid_json"][0]["line"] == "y" * 20 + "… (500 characters)"
    assert got["invalid_utf8"][0]["line"].startswith("(not UTF-8: 3 bytes")
    assert figures.truncate("short", 20) == "short"


def test_checkpoints_spread_and_end_at_the_last_step():
    assert figures.checkpoints(5, points=50).tolist() == [1, 2, 3, 4, 5]
    got = figures.checkpoints(1000, points=11)
    assert got[0] == 1 and got[-1] == 1000 and len(got) == 11
    assert figures.checkpoints(0).size == 0


def test_target_shares_average_the_schedule_over_the_steps():
    segs = [(0, [0.5, 0.5]), (10, [0.0, 1.0])]
    got = figures.target_shares(segs, [5, 10, 20])
    assert np.allclose(got, [[0.5, 0.5], [0.5, 0.5], [0.25, 0.75]])  # 20 steps: 10 at 50/50, 10 at 0/100


def test_realised_shares_are_the_mixtures_draws():
    spec = parse_mixture('{"mixture": 1, "components": [{"name": "a", "path": "a", "weight": 3}, '
                         '{"name": "b", "path": "b", "weight": 1}]}', "/m.json")
    index = QuotaIndex(spec.quotas(4, 8))
    at = [1, 10, 100]
    got = figures.realised_shares(index.consumed, 8, at)
    for row, s in zip(got, at):  # the same as assigning every example of the first s steps
        comp, _ = index.assign(np.arange(s * 8))
        assert np.allclose(row, np.bincount(comp, minlength=2) / (s * 8))
    assert abs(got[-1][0] - 0.75) < 0.02


def test_shuffle_locality_is_the_shuffles_source_of_each_sampled_row():
    cfg = ShuffleConfig(seed=3, lanes=4)
    full = figures.shuffle_locality(cfg, batch_size=8, steps=9, max_points=1000)  # every row of steps 0..9
    assert full.steps.tolist() == np.repeat(np.arange(10), 8).tolist()
    assert full.sources.tolist() == shuffle_example_indices(np.arange(80), cfg).tolist()
    assert (full.components == 0).all()
    loc = figures.shuffle_locality(cfg, batch_size=8, steps=999, max_points=400)  # sampled: steps and rows
    assert loc.steps.size <= 400 and loc.steps.min() == 0 and loc.steps.max() == 999
    for s in np.unique(loc.steps)[:50].tolist():
        rows = shuffle_example_indices(s * 8 + np.arange(8), cfg)
        assert set(loc.sources[loc.steps == s].tolist()) <= set(rows.tolist())


def test_shuffle_locality_of_a_spans_read_shuffles_each_pass():
    cfg = ShuffleConfig(seed=3, lanes=4)
    loc = figures.shuffle_locality(cfg, batch_size=8, steps=9, max_points=1000, passes=[30])  # passes of 30
    ex = np.arange(80)
    p, k = np.divmod(ex, 30)
    assert loc.sources.tolist() == (p * 30 + shuffle_example_indices(k, cfg, epoch_length=30, passes=p)).tolist()


def test_shuffle_locality_of_a_mixture_shuffles_component_examples():
    spec = parse_mixture('{"mixture": 1, "components": [{"name": "a", "path": "a", "weight": 1}, '
                         '{"name": "b", "path": "b", "weight": 1}]}', "/m.json")
    index = QuotaIndex(spec.quotas(2, 4))
    cfg = ShuffleConfig(seed=1, lanes=2)
    loc = figures.shuffle_locality(cfg, batch_size=4, steps=9, assign=index.assign)  # every row of 10 steps
    comp, k = index.assign(np.arange(40))
    assert loc.steps.tolist() == np.repeat(np.arange(10), 4).tolist()
    assert loc.components.tolist() == comp.tolist() and set(comp.tolist()) == {0, 1}
    assert loc.sources.tolist() == shuffle_example_indices(k, cfg).tolist()


@pytest.mark.parametrize("n,cap,want", [(5, 0, [0, 1, 2, 3, 4]), (5, 10, [0, 1, 2, 3, 4]), (100, 3, [0, 49, 99])])
def test_length_sample_reads_at_most_the_cap_spread_over_the_cache(n, cap, want):
    assert length_sample(n, cap) == want


def test_a_kept_field_gets_a_chart_only_when_it_has_few_values_or_a_few_hold_most_tokens():
    assert figures.field_note({"web": (10, 500), "code": (3, 900)}) is None
    skewed = {"big": 10_000, **{f"v{i}": 1 for i in range(100)}}  # 101 values, one holds nearly all
    assert figures.field_note(skewed) is None
    urls = {f"https://x.org/{i}": 100 + i % 7 for i in range(20_000)}  # one value per document
    assert figures.field_note(urls) == ("20,000 distinct values in the sampled chunks; the 20 most frequent hold "
                                        "0.1% of the tokens, the largest 0.01% (no chart)")
