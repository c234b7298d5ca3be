"""Reading a Parquet input chunk by chunk holds one row group, not the file: a file of 10 times the row
groups peaks at the same memory (benchmarks/columnar_memory.py measures it at 200 MB and 2 GB)."""

from __future__ import annotations

import pytest

from benchmarks.columnar_memory import make_parquet, measure

pytestmark = pytest.mark.timeout(300)
ROW_GROUP = 4 << 20


@pytest.mark.slow
def test_peak_memory_follows_the_row_group_not_the_file(tmp_path):
    small = measure(make_parquet(tmp_path / "small.parquet", 3 * ROW_GROUP, ROW_GROUP), ROW_GROUP)
    large = measure(make_parquet(tmp_path / "large.parquet", 30 * ROW_GROUP, ROW_GROUP), ROW_GROUP)
    assert (small["chunks"], large["chunks"]) == (3, 30) and large["chars"] == 30 * ROW_GROUP
    # pyarrow's allocations peak at about one decoded row group, whatever the file's size
    assert ROW_GROUP <= large["arrow_pool_peak"] <= 1.25 * small["arrow_pool_peak"]
    assert large["arrow_pool_peak"] < 30 * ROW_GROUP / 4
    # and so does the process's (the file is 120 MiB: read whole, it would exceed this bound)
    assert large["peak_rss"] <= 1.25 * small["peak_rss"]
