"""Reading mixtures of caches (reader/mixture/mixture.py, reader/mixture/io.py) through the Reader, reader workers
and the loaders: every row is its component's own example, batches do not depend on the host split,
resume or the build, hosts read only their own streams, eval concatenates, schedules continue."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

import cachegen
from mixgen import write_components, write_mixture
from reader import ReadOptions, Reader
from reader.batch.schema import BATCH_KEYS
from reader.order.shuffle import ShuffleConfig

TOKEN_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "epochs", "valid")


@pytest.fixture(scope="module")
def mix():
    """Three components (12, 7 and 4 chunks) and a mixture with a schedule that zeroes one and revives it."""
    root = tempfile.mkdtemp(prefix="cl-mix-")
    paths, chunks = write_components(root, [12, 7, 4])
    f = write_mixture(os.path.join(root, "mix.json"), [("web", "c0", 0.5), ("code", "c1", 0.3), ("math", "c2", 0.2)],
                      schedule=[(6, {"web": 0.1, "math": 0.9}), (11, {"web": 1, "code": 1, "math": 1})], block=16)
    yield {"root": root, "paths": paths, "chunks": chunks, "file": f}
    shutil.rmtree(root, ignore_errors=True)


def same(a: dict, b: dict, keys=BATCH_KEYS) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in keys)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_every_row_is_its_components_own_example(mix, packed, shuffle_seed):
    """Row i of the mixture is example k of component c read alone with the same options, for the
    (c, k) of the mixture order; components says c; batches equal across batch/iter_batches."""
    opts = ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, packed=packed, shuffle_seed=shuffle_seed)
    with Reader(mix["file"], opts) as r:
        got = [x for _, x in r.iter_batches(0, 16)]
        comp, k = r.order.assign(np.arange(16 * 16))
        alone = [Reader(p, opts) for p in mix["paths"]]
        try:
            for i in range(comp.size):
                b, row = divmod(i, 16)
                want = alone[comp[i]].examples([k[i]])
                assert got[b]["components"][row] == comp[i]
                assert got[b]["example_ids"][row] == i
                for key in TOKEN_KEYS:
                    assert np.array_equal(got[b][key][row], want[key][0]), (i, key)
        finally:
            for a in alone:
                a.close()
        assert same(r.batch(13), got[13])
    assert set(np.unique(comp[:6 * 16])) == {0, 1, 2} and not (comp[6 * 16:11 * 16] == 1).any()


def test_global_batches_do_not_depend_on_hosts_and_each_host_reads_only_its_streams(tmp_path):
    """R = 1, 2, 4, 8, 16 hosts with R* = 8: the hosts' rows make up the same global batches, and each
    host opens only chunks of its own streams of every component (chunk j of a component is in stream
    j mod R* in its first pass): for R | R* the hosts' chunk sets are disjoint, and together they are
    what one host opens."""
    paths, _ = write_components(str(tmp_path), [24, 17, 16], max_docs=12, max_len=80)
    f = write_mixture(str(tmp_path / "m.json"), [("a", "c0", 2), ("b", "c1", 1), ("c", "c2", 1)],
                      schedule=[(3, {"a": 1, "c": 3})], block=8)
    small = ShuffleConfig(seed=1, first_window=64, max_window=256, block_size=16, mix_size=32, lanes=8)
    opts = ReadOptions(seq_len=8, batch_size=32, ideal_readers=8, shuffle=small, prefetch_threads=0)
    batches = range(6)
    with Reader(f, opts) as one:
        full = [one.batch(b) for b in batches]
        assert max(int(x["epochs"].max()) for x in full) == 0  # first pass of every stream: j mod R* is j's stream
        opened_one = [set(s.opened) for s in one.store.stores]
    for R in (1, 2, 4, 8, 16):  # R | R*, and R* | R (hosts r and r + 8 share stream r)
        hosts = [Reader(f, opts, num_readers=R, reader_index=r) for r in range(R)]
        try:
            for b in batches:
                for r, h in enumerate(hosts):
                    assert same(h.batch(b), {k: v[r::R] for k, v in full[b].items()}), (R, r, b)
            for c in range(3):
                sets = [set(h.store.stores[c].opened) for h in hosts]
                for r, got in enumerate(sets):
                    own = [r % 8] if R > 8 else range(r, 8, R)
                    assert got and all(j % 8 in own for j in got), (R, r, c, sorted(got))
                assert set().union(*sets) == opened_one[c]
                if R <= 8:
                    assert sum(len(x) for x in sets) == len(opened_one[c])  # disjoint
        finally:
            for h in hosts:
                h.close()


@pytest.mark.parametrize("rule", ["streams", "spans"])
def test_seek_equals_iterate_and_resume_is_the_step(mix, rule):
    opts = ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, shuffle_seed=3, pass_rule=rule)
    with Reader(mix["file"], opts) as r:
        seq = [x for _, x in r.iter_batches(0, 20)]
    rng = np.random.default_rng(0)
    with Reader(mix["file"], opts) as r:
        for b in rng.permutation(20).tolist():
            assert same(r.batch(b), seq[b]), b
    with Reader(mix["file"], opts) as r:  # a resumed run: the state is the step
        assert all(same(x, seq[12 + i]) for i, (_, x) in enumerate(r.iter_batches(12, 8)))
    far = 10**6
    with Reader(mix["file"], opts) as r, Reader(mix["file"], opts, num_readers=2, reader_index=1) as h:
        x = r.batch(far)
        assert same(h.batch(far), {k: v[1::2] for k, v in x.items()})
        comp, k = r.order.assign(far * 16 + np.arange(16))
        with Reader(mix["paths"][int(comp[3])], opts) as alone:
            assert np.array_equal(alone.examples([k[3]])["targets"][0], x["targets"][3])
        assert int(x["epochs"].max()) > 0  # far out, every component loops: its own epochs


def test_no_example_is_served_twice_across_weight_changes(mix):
    """Within the first pass of every component, no token of it appears twice, whatever the schedule
    does (token ids are distinct): each component continues where it was. (Windows wholly inside the
    first pass: the next window of the same stream starts in it too.)"""
    R = 4
    opts = ReadOptions(seq_len=8, batch_size=16, ideal_readers=R)
    with Reader(mix["file"], opts) as r:
        got = [x for _, x in r.iter_batches(0, 14)]
        comp, k = r.order.assign(np.arange(14 * 16))
    tg = np.concatenate([x["targets"] for x in got])
    ep = np.concatenate([x["epochs"] for x in got])
    mask = np.concatenate([x["loss_mask"] for x in got])
    epoch_of = {(int(c), int(j)): int(e) for c, j, e in zip(comp, k, ep)}
    for c in range(3):
        rows = [i for i in range(comp.size) if comp[i] == c and ep[i] == 0
                and epoch_of.get((c, int(k[i]) + R)) == 0]
        toks = tg[rows][mask[rows]]
        assert len(rows) > 20 and np.unique(toks).size == toks.size, c


@pytest.mark.parametrize("packed", [True, False])
def test_a_mixture_of_a_cache_with_itself_serves_every_example(tmp_path, packed):
    """Weights 0.5 / 0.5 of one cache: each component serves every example of the cache in its first
    pass (every token id shows up in rows of its epoch 0), and the two components are read apart."""
    paths, chunks = write_components(str(tmp_path), [9])
    f = write_mixture(str(tmp_path / "self.json"), [("x", "c0", 0.5), ("y", "c0", 0.5)], block=8)
    every = set(np.concatenate([d for c in chunks[0] for d in c]).tolist())
    L, R = 8, 4
    opts = ReadOptions(seq_len=L, batch_size=16, ideal_readers=R, packed=packed)
    with Reader(paths[0], opts) as alone:
        idx = alone.stream_index()
        per_stream = max(int(idx.pass_units([s])[0]) for s in range(R))
    need = (per_stream // (L if packed else 1) + 2) * 2 * R + 16 * R  # both components past one pass
    with Reader(f, opts) as r:
        got = [x for _, x in r.iter_batches(0, -(-need // 16))]
    comp = np.concatenate([x["components"] for x in got])
    ep = np.concatenate([x["epochs"] for x in got])
    tg = np.concatenate([x["targets"] for x in got])
    mask = np.concatenate([x["loss_mask"] for x in got])
    for c in (0, 1):
        rows = (comp == c) & (ep == 0)
        assert set(tg[rows][mask[rows]].tolist()) == every, c
        assert ((comp == c) & (ep == 1)).any()  # and it went on into its second pass


def test_eval_reads_each_component_once_in_order(mix):
    opts = ReadOptions(seq_len=8, batch_size=16, eval_mode=True)
    with Reader(mix["file"], opts) as r:
        got = [x for _, x in r.iter_batches()]
        n, nb = r.num_examples, r.num_batches
    parts = []
    for c, p in enumerate(mix["paths"]):
        with Reader(p, opts) as alone:
            m = alone.num_examples
            x = alone.examples(np.arange(m))
            parts.append((c, m, x))
    assert n == sum(m for _, m, _ in parts) and nb == len(got) == -(-n // 16)
    cat = {k: np.concatenate([x[k] for x in got]) for k in got[0]}
    start = 0
    for c, m, x in parts:
        assert (cat["components"][start:start + m] == c).all()
        for key in TOKEN_KEYS:
            assert np.array_equal(cat[key][start:start + m], x[key]), (c, key)
        start += m
    assert (cat["components"][n:] == -1).all() and not cat["valid"][n:].any() and cat["valid"][:n].all()
    assert (cat["example_ids"][:n] == np.arange(n)).all() and (cat["example_ids"][n:] == -1).all()


def test_single_caches_say_component_zero(mix):
    with Reader(mix["paths"][2], ReadOptions(seq_len=8, batch_size=16, eval_mode=True)) as r:
        got = [x for _, x in r.iter_batches()]
    comp = np.concatenate([x["components"] for x in got])
    valid = np.concatenate([x["valid"] for x in got])
    assert comp.dtype == np.int32 and (comp[valid] == 0).all() and (comp[~valid] == -1).all() and (~valid).any()


def test_reading_while_one_component_is_still_building(tmp_path):
    """A mixture of a finished cache and one being built: batches read during the build equal those read
    after it (from a finished twin), training and eval."""
    rng = np.random.default_rng(4)
    done_chunks = cachegen.random_chunks(rng, 6)
    live_chunks = cachegen.random_chunks(rng, 8)
    cps = [3, 3, 2]
    cachegen.write_synthetic_cache(str(tmp_path / "done"), done_chunks, chunks_per_shard=[3, 3], row_group_tokens=9)
    cachegen.write_synthetic_cache(str(tmp_path / "twin"), live_chunks, chunks_per_shard=cps, row_group_tokens=9)
    comps = lambda live: [("done", "done", 0.4), ("live", live, 0.6)]  # noqa: E731
    twin = write_mixture(str(tmp_path / "twin.json"), comps("twin"), schedule=[(3, {"done": 1, "live": 3})], block=8)
    live = write_mixture(str(tmp_path / "live.json"), comps("live"), schedule=[(3, {"done": 1, "live": 3})], block=8)
    for opts in (ReadOptions(seq_len=8, batch_size=8, ideal_readers=2, shuffle_seed=7),
                 ReadOptions(seq_len=8, batch_size=8, eval_mode=True)):
        shutil.rmtree(tmp_path / "live", ignore_errors=True)
        with Reader(twin, opts, num_readers=2, reader_index=1) as ref:
            want = list(ref.iter_batches(0, 12))
        t = cachegen.build_in_background(str(tmp_path / "live"), live_chunks, cps, first=(0,), seed=1)
        try:
            with Reader(live, opts, num_readers=2, reader_index=1, wait_timeout_s=60, poll_interval_s=0.01) as rd:
                assert not rd.cache.complete and rd.cache.caches[0].complete
                got = list(rd.iter_batches(0, 12))
        finally:
            t.join()
        assert [b for b, _ in got] == [b for b, _ in want]
        assert all(same(x, y) for (_, x), (_, y) in zip(got, want))


def test_reader_workers_prefetch_and_the_memory_budget(mix):
    opts = ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, shuffle_seed=2, memory_budget_bytes=3 << 20)
    with Reader(mix["file"], opts) as r:
        want = [x for _, x in r.iter_batches(0, 20)]
        # split equally, after the batches read ahead took their share
        assert [s.budget for s in r.store.stores] == [((3 << 20) - r.ahead_bytes) // 3] * 3
        assert r.store.decodes > 0 and r.lookahead_batches() >= 1
        with pytest.raises(TypeError, match="each component has its own"):
            r.stream_index()
    import dataclasses

    with Reader(mix["file"], dataclasses.replace(opts, num_workers=2)) as r:
        got = [{k: v.copy() for k, v in x.items()} for _, x in r.iter_batches(0, 20)]
    assert all(same(a, b) for a, b in zip(got, want))
    with Reader(mix["file"], dataclasses.replace(opts, layout="flat")) as r:
        from reader import expand_flat

        assert all(same(expand_flat(x), w) for (_, x), w in zip(r.iter_batches(0, 20), want))


def test_torch_and_jax_loaders_read_a_mixture(mix):
    opts = ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, shuffle_seed=9)
    with Reader(mix["file"], opts) as r:
        want = [r.batch(b) for b in range(6)]
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from reader.torch import TokenBatches

    ds = TokenBatches(mix["file"], opts, rank=1, world_size=2)
    for item, w in zip(DataLoader(ds, batch_size=None, num_workers=2), want):
        for key in BATCH_KEYS:
            assert np.array_equal(item[key].numpy(), w[key][1::2]), key
    assert isinstance(item["components"], torch.Tensor)
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, PartitionSpec as P

    from reader.jax import JaxLoader

    mesh = Mesh(np.asarray(jax.devices()[:2 if len(jax.devices()) >= 2 else 1]), ("data",))
    with JaxLoader(mix["file"], opts, mesh, P("data", None)) as loader:
        for (b, batch), w in zip(loader.iter_batches(0, 6), want):
            for key in ("targets", "inputs", "positions", "components", "valid"):
                assert np.array_equal(np.asarray(batch[key]), w[key]), (b, key)


@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_all_components_located_at_once_equal_one_at_a_time(mix, shuffle_seed):
    """Packed training reads of finished components locate every row in one stacked call: the same
    placement (chunks, offsets, epochs, windows over chunk ends) as asking each component in turn."""
    opts = ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, shuffle_seed=shuffle_seed, prefetch_threads=0)
    with Reader(mix["file"], opts) as r:
        order = r.order
        ex = np.arange(40 * 16, dtype=np.int64)  # past the schedule's weight changes, several epochs deep
        assert order._stacked() is not None
        fused = order.locate(ex)
        order._stack = ((), None)
        order._stacked = lambda: None  # the general path: each component's own locate
        alone = order.locate(ex)
    assert fused.spill and int(fused.epochs.max()) > 0
    for f in ("examples", "valid", "rows", "streams", "positions", "epochs", "chunks", "starts", "lengths",
              "components"):
        assert np.array_equal(getattr(fused, f), getattr(alone, f)), f
    assert fused.spill == alone.spill and fused.first_positions is None is alone.first_positions


def test_a_sequential_mixture_read_releases_what_each_component_has_passed(tmp_path):
    """Each component's store keeps only the row groups ahead of its reads (its release policy sees
    that component's windows), as when it is read alone."""
    paths, _ = write_components(str(tmp_path), [4, 4], max_docs=160, max_len=50)
    f = write_mixture(str(tmp_path / "m.json"), [("a", "c0", 0.6), ("b", "c1", 0.4)], block=8)
    with Reader(f, ReadOptions(seq_len=4, batch_size=4, ideal_readers=2)) as r:
        for _ in r.iter_batches(0, 300):
            pass
        for st in r.store.stores:
            live = len([k for k in st._lru if k[0] == "rg"])
            assert st.decodes >= 50 and live < st.decodes / 4, (st.decodes, live)


def test_prefetch_chunks_of_all_components_at_once_equal_each_components_own(mix):
    """The prefetcher of a packed, unshuffled mixture plans every component in one stacked call: the
    same (chunk, token offsets) lists as each component's own plan of its examples."""
    with Reader(mix["file"], ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, prefetch_threads=0)) as r:
        order = r.order
        for b in (0, 7, 30):  # before, inside and after the schedule's weight changes; later epochs
            comp, k = order.assign(np.arange(b * 16, (b + 8) * 16, dtype=np.int64))
            plans = order.touched_by_component(comp, k)
            assert sum(len(p) for p in plans) > 0
            for c, plan in enumerate(plans):
                want = order.components[c].touched([k[comp == c]]) if (comp == c).any() else []
                assert [x for x, _ in plan] == [x for x, _ in want]
                assert all(np.array_equal(a, w) for (_, a), (_, w) in zip(plan, want))
    with Reader(mix["file"], ReadOptions(seq_len=8, batch_size=16, ideal_readers=4, shuffle_seed=1)) as r:
        comp, k = r.order.assign(np.arange(64, dtype=np.int64))
        assert r.order.touched_by_component(comp, k) is None  # shuffled: each component's own (mix-wise) plan


def write_limited(tmp_path, max_passes, rule_version=4):
    """A large component (17 chunks) and a 1-chunk one of format version ``rule_version``, the small one
    limited to ``max_passes``."""
    rng = np.random.default_rng(3)
    big = cachegen.random_chunks(rng, 17, empty_prob=0.0, max_docs=8, max_len=40)
    small = [[np.arange(100_000 + 10 * d, 100_000 + 10 * d + 7, dtype=np.int32) for d in range(9)]]
    for name, chunks in (("big", big), ("small", small)):
        cachegen.write_synthetic_cache(str(tmp_path / name), chunks, row_group_tokens=16,
                                       format_version=rule_version)
    doc = {"mixture": 1, "components": [{"name": "big", "path": "big", "weight": 3},
                                        {"name": "small", "path": "small", "weight": 1, "max_passes": max_passes}]}
    f = tmp_path / "lim.json"
    f.write_text(__import__("json").dumps(doc))
    return str(f)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_max_passes_stops_before_the_step_that_would_exceed_it(tmp_path, num_workers):
    """A component's max_passes: every step before the first one that would draw its example past
    max_passes * E is served, then a clear error names the component and that step; asking for the
    step directly raises it too, before anything is read."""
    from reader import MaxPassesReached

    f = write_limited(tmp_path, 2)
    opts = ReadOptions(seq_len=4, batch_size=8, ideal_readers=4, shuffle_seed=1, num_workers=num_workers)
    with Reader(f, ReadOptions(seq_len=4, batch_size=8, ideal_readers=4)) as plain:
        E = plain.examples_per_pass[1]
        assert E == 63 // 4  # 9 documents of 7 tokens: 15 whole rows of 4
        comp, k = plain.order.assign(np.arange(400 * 8))
        first = next(i for i in range(comp.size) if comp[i] == 1 and k[i] >= 2 * E) // 8
    with Reader(f, opts) as r:
        got = []
        with pytest.raises(MaxPassesReached) as e:
            for b, _ in r.iter_batches(0, 400):
                got.append(b)
        assert got == list(range(first))
        msg = str(e.value)
        assert msg.startswith(f + ": component 'small' has max_passes 2") and f"step {first} would draw" in msg
        with pytest.raises(MaxPassesReached, match=f"step {first} would"):
            r.batch(first)
        assert r.batch(first - 1)["valid"].all()
        assert list(b for b, _ in r.iter_batches(0, first)) == list(range(first))  # (the limit not reached)
