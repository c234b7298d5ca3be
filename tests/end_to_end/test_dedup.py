"""``python -m pipelines.dedup`` on built caches with planted duplicates (tests/support/dupgen.py).

Exact: 10% of the documents copied into other shards (a fifth of them twice) and one duplicate the corpus
already had; the marks must be exactly the brute-force grouping of the cache's token sequences. Near: the
copies have 1-3% of their words changed and two lines swapped; against the brute-force Jaccard of every pair
over 5-token shingles, recall >= 0.9 over the pairs with J >= 0.8 and at most 5% of the marked pairs below
0.7. The files are the same from the FnApiRunner, 2 local worker processes and a Dask cluster, and after a
SIGKILL mid-job and a rerun.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from build_helpers import DIRECT_MP2, FNAPI, REPO, build, read_documents, tree_bytes
from dupgen import exact_truth, jaccard_pairs, near_scores, planted
from pipelines.dedup import job
from reader.format import attributes as attrs
from reader.format import spec as fmt
from reader.storage.attributes import AttributeSet
from reader.storage.cache import Cache

CHUNK = 16 << 10
DOCS = 800


def _cache(tmp_path_factory, near: bool) -> str:
    d = tmp_path_factory.mktemp("near" if near else "exact")
    pattern = planted(str(d / "in"), docs=DOCS, shards=4, seed=7 if near else 3, near=near)
    out, _ = build(d, [pattern], chunk_bytes=CHUNK, append_eos=True)
    return out


@pytest.fixture(scope="module")
def exact_cache(tmp_path_factory):
    return _cache(tmp_path_factory, near=False)


@pytest.fixture(scope="module")
def near_cache(tmp_path_factory):
    return _cache(tmp_path_factory, near=True)


def copy_cache(src: str, dst) -> str:
    """The cache without its attribute sets (each runner computes them afresh)."""
    shutil.copytree(src, str(dst), ignore=shutil.ignore_patterns(attrs.ATTRIBUTES_DIR))
    return str(dst)


def marks(root: str, name: str) -> dict[str, np.ndarray]:
    """Every document's columns of the set, in global order (each file verified)."""
    s = AttributeSet(Cache(root), name)
    cols = [s.chunk(c) for c in range(len(s.cache.table))]
    return {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}


def set_files(root: str, name: str) -> dict[str, bytes]:
    return tree_bytes(os.path.join(root, attrs.set_dir(name)))


def dedup(root: str, *extra: str, runner=FNAPI) -> dict:
    return job.run([root, *extra, *runner])


def computed(exact_cache: str, near_cache: str, near: bool) -> tuple[str, str, list[str]]:
    """``(cache, set name, flags)`` of one kind, its set computed by the FnApiRunner."""
    src, name, flags = (near_cache, job.NEAR_NAME, ["--near"]) if near else (exact_cache, job.EXACT_NAME, [])
    if not os.path.exists(os.path.join(src, attrs.manifest_path(name))):
        dedup(src, *flags)
    return src, name, flags


def test_exact_marks_are_the_brute_force_grouping(exact_cache):
    result = dedup(exact_cache)
    assert result["state"] == "computed"
    docs = [np.asarray(d["tokens"]) for d in read_documents(exact_cache)]
    truth = exact_truth(docs)
    assert len(truth) == len(docs) - DOCS  # every planted copy, and the duplicate the corpus had
    keeper = marks(exact_cache, job.EXACT_NAME)["keeper"]
    want = np.full(len(docs), attrs.KEPT)
    want[list(truth)] = list(truth.values())
    assert keeper.tolist() == want.tolist()
    m = result["manifest"]
    assert m.raw["totals"]["marked"] == len(truth)
    assert m.raw["totals"]["marked_tokens"] == sum(len(docs[d]) for d in truth)
    assert int(m.marked.sum()) == len(truth)
    # a second run finds the set complete and changes nothing
    before = set_files(exact_cache, job.EXACT_NAME)
    assert dedup(exact_cache)["state"] == "complete"
    assert set_files(exact_cache, job.EXACT_NAME) == before


def test_near_marks_find_the_planted_copies(near_cache, capsys):
    dedup(near_cache, "--near")
    docs = [np.asarray(d["tokens"]) for d in read_documents(near_cache)]
    got = marks(near_cache, job.NEAR_NAME)
    keeper, jac = got["keeper"], got["jaccard"]
    truth = jaccard_pairs(docs)
    scores = near_scores(keeper, truth)
    with capsys.disabled():
        print(f"\nnear duplicates on the test corpus: {scores}")
    assert scores["pairs"] >= 25  # planted copies with J >= 0.8 (1-3% of words changed: J of 0.6 to 0.9)
    assert scores["recall"] >= 0.9, scores
    assert scores["false_share"] <= 0.05, scores
    marked = keeper >= 0
    assert (keeper[marked] < np.flatnonzero(marked)).all()  # a keeper precedes its copies
    assert (jac[marked] >= job.NEAR_THRESHOLD).all() and (jac[~marked] == 0).all()
    assert not [p for p, j in truth.items() if j >= 0.9 and keeper[p[0]] < 0 and keeper[p[1]] < 0]


@pytest.mark.slow
@pytest.mark.parametrize("near", [False, True], ids=["exact", "near"])
def test_the_same_files_from_two_local_workers(exact_cache, near_cache, tmp_path, near):
    src, name, flags = computed(exact_cache, near_cache, near)
    other = copy_cache(src, tmp_path / "mp2")
    dedup(other, *flags, runner=DIRECT_MP2)
    assert set_files(other, name) == set_files(src, name)


def run_killed(root: str, point: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "kill_at.py"), point, "--module",
                           "pipelines.dedup.job", root, *flags, *FNAPI], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("near", [False, True], ids=["exact", "near"])
def test_sigkill_mid_job_then_rerun_gives_the_same_files(exact_cache, near_cache, tmp_path, near):
    src, name, flags = computed(exact_cache, near_cache, near)
    want = set_files(src, name)
    chunks = len(Cache(src).table)
    for point in (f"{chunks // 2}:after_rename", f"{chunks + 1}:before_rename"):  # mid-way; the manifest
        root = copy_cache(src, tmp_path / point.replace(":", "-"))
        killed = run_killed(root, point, *flags)
        assert killed.returncode == -9, killed.stderr[-2000:]
        assert not os.path.exists(os.path.join(root, attrs.manifest_path(name)))
        written = {k: os.stat(os.path.join(root, attrs.set_dir(name), k)).st_ino
                   for k in set_files(root, name) if k.endswith(".parquet")}
        assert written
        assert dedup(root, *flags)["state"] == "computed"
        assert set_files(root, name) == want  # no temporary file or lock left either
        for k, ino in written.items():  # what the killed run wrote is kept, not written again
            assert os.stat(os.path.join(root, attrs.set_dir(name), k)).st_ino == ino, k


def test_refuses_an_unfinished_cache_and_stray_arguments(exact_cache, tmp_path):
    from cachegen import write_synthetic_cache
    from pipelines.errors import BuildError

    root = str(tmp_path / "running")
    write_synthetic_cache(root, [[[1, 2, 3]], [[4, 5]]], finished=False)
    with pytest.raises(BuildError, match="ledger.json: the build has not finished"):
        dedup(root)
    with pytest.raises(BuildError, match="unexpected argument.*--nearr"):
        dedup(exact_cache, "--nearr")
    proc = subprocess.run([sys.executable, "-m", "pipelines.dedup", str(tmp_path / "nothing"), *FNAPI], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "nothing" in proc.stderr, proc.stderr


def test_a_set_of_another_cache_is_refused(exact_cache, near_cache, tmp_path):
    """A set copied beside chunks other than those it was computed from (another build, another cache): its
    manifest's cache fingerprint is not the ledger's."""
    src, name, _ = computed(exact_cache, near_cache, near=False)
    root = copy_cache(near_cache, tmp_path / "c")
    shutil.copytree(os.path.join(src, attrs.set_dir(name)), os.path.join(root, attrs.set_dir(name)))
    with pytest.raises(fmt.DamagedCache, match="computed from another build of this cache"):
        AttributeSet(Cache(root), name)


@pytest.mark.slow
def test_the_same_files_on_a_dask_cluster(exact_cache, near_cache, tmp_path):
    from test_build_cache_dask import dask_cluster

    kinds = [computed(exact_cache, near_cache, near) for near in (False, True)]
    with dask_cluster(tmp_path) as cluster:
        for src, name, flags in kinds:
            root = copy_cache(src, tmp_path / name)
            proc = subprocess.run([sys.executable, "-m", "pipelines.dedup", root, *flags, "--runner=DaskRunner",
                                   f"--dask_client_address={cluster.address}"], cwd=REPO, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert set_files(root, name) == set_files(src, name), name


def test_a_view_without_exact_duplicates_reads_each_distinct_document_once(exact_cache, near_cache):
    from reader import Reader, ReadOptions

    src, _, _ = computed(exact_cache, near_cache, near=False)
    docs = [np.asarray(d["tokens"]) for d in read_documents(src)]
    truth = exact_truth(docs)
    want = [d.tolist() for i, d in enumerate(docs) if i not in truth]
    L = max(len(d) for d in docs)
    opts = ReadOptions(seq_len=L, batch_size=16, packed=False, eval_mode=True, view="not exact_duplicate")
    got = []
    with Reader(src, opts) as r:
        for _, b in r.iter_batches(0):
            for row, seg, ok in zip(b["targets"], b["segment_ids"], b["valid"]):
                if ok:
                    got.append(row[seg > 0].tolist())
    assert len(got) == DOCS and got == want
    from reader.storage.views import tally  # (inspect --view): the largest clusters, keeper beside a copy
    (c,) = tally(Cache(src), "not exact_duplicate")["clusters"]
    assert c["marked"] == len(truth) and c["clusters"] == len(set(truth.values()))
    assert all(x["keeper_tokens"] == x["copy_tokens"] and truth[x["copy"]] == x["keeper"] for x in c["largest"])
