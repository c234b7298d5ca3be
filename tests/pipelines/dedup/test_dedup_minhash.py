"""The signatures and the rules of pipelines/dedup (minhash.py, groups.py), against their definitions."""

from __future__ import annotations

import numpy as np

from pipelines.dedup import groups, minhash


def shingles(doc) -> set:
    return {tuple(doc[i:i + minhash.SHINGLE]) for i in range(len(doc) - minhash.SHINGLE + 1)}


def test_shingle_hashes_stay_inside_documents_and_follow_the_definition():
    values = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], np.int32)
    h, doc = minhash.shingle_hashes(values, np.array([6, 2, 3], np.int32))
    assert doc.tolist() == [0, 0]  # the second and third documents are shorter than a shingle
    want = minhash.mix64(np.array([sum(int(v) * int(m) for v, m in zip(range(1, 6), minhash.MULTIPLIERS))
                                   % (1 << 64)], np.uint64))
    assert h[0] == want[0]


def test_the_estimate_follows_the_true_jaccard():
    rng = np.random.default_rng(0)
    errors = []
    for _ in range(60):
        a = rng.integers(0, 50_000, size=int(rng.integers(40, 2000)), dtype=np.int32)
        b = a.copy()
        change = rng.random(len(b)) < rng.uniform(0.002, 0.06)
        b[change] = rng.integers(0, 50_000, size=int(change.sum()))
        sig, has = minhash.signatures(np.concatenate([a, b]), np.array([len(a), len(b)], np.int32))
        sa, sb = shingles(a.tolist()), shingles(b.tolist())
        true = len(sa & sb) / len(sa | sb)
        errors.append(float(minhash.jaccard(sig[:1], sig[1:])[0]) - true)
        assert has.all()
    errors = np.asarray(errors)
    assert abs(errors.mean()) < 0.02 and np.abs(errors).max() < 0.15, errors


def test_identical_documents_have_identical_signatures_and_band_keys_wherever_they_are():
    rng = np.random.default_rng(1)
    d = rng.integers(0, 1000, size=300, dtype=np.int32)
    other = rng.integers(0, 1000, size=77, dtype=np.int32)
    s1, _ = minhash.signatures(np.concatenate([d, other]), np.array([300, 77], np.int32))
    s2, _ = minhash.signatures(np.concatenate([other, other[:3], d]), np.array([77, 3, 300], np.int32))
    assert (s1[0] == s2[2]).all()
    assert (minhash.band_keys(s1[:1]) == minhash.band_keys(s2[2:])).all()
    assert not (minhash.band_keys(s1[:1]) == minhash.band_keys(s1[1:])).any()


def test_exact_groups_keep_the_first_document():
    hi = np.array([5, 5, 7, 5, 7, 9], np.uint64)
    lo = np.array([1, 1, 2, 1, 2, 3], np.uint64)
    ntok = np.array([3, 3, 4, 3, 5, 3])
    doc = np.array([40, 10, 11, 30, 12, 13])
    marked, keeper, _ = groups.exact_marks(hi, lo, ntok, doc)
    assert dict(zip(marked.tolist(), keeper.tolist())) == {30: 10, 40: 10}  # 11 and 12 differ in length


def test_candidates_of_a_large_bucket_reach_its_first_members():
    keys = np.array([1] * 30 + [2, 2], np.uint64)
    doc = np.arange(32)[::-1].copy()
    a, b = groups.candidate_pairs(keys, doc)
    pairs = set(zip(a.tolist(), b.tolist()))  # buckets: documents 2..31, and 0, 1
    assert (0, 1) == (int(a[0]), int(b[0]))
    assert all((2, d) in pairs for d in range(3, 32))  # the bucket's first member, from every other one
    assert (9, 31) in pairs and (10, 31) not in pairs  # its first 8 members ...
    assert (22, 31) not in pairs and (23, 31) in pairs  # ... and the 8 before
    assert len(pairs) == len(a)


def test_greedy_marks_never_chain():
    # 1 ~ 2 ~ 3 (1 and 3 not similar): 2 goes with 1, 3 is kept; 5 picks the kept neighbour of the higher estimate
    a = np.array([1, 2, 1, 4, 0])
    b = np.array([2, 3, 5, 5, 5])
    j = np.array([0.9, 0.9, 0.8, 0.95, 0.8], np.float32)
    doc, keeper, jac = groups.greedy_marks(a, b, j)
    assert dict(zip(doc.tolist(), keeper.tolist())) == {2: 1, 5: 4}
    assert jac.tolist() == [np.float32(0.9), np.float32(0.95)]
