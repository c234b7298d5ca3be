"""reader.torch across REAL torch.distributed processes: 2 ranks (gloo, 127.0.0.1) with DataLoader workers,
resumed on 1 rank with another worker count, and back onto 2 ranks.

Each rank (tests/support/torch_helpers/dist_worker.py) takes its rank and world size from torch.distributed,
iterates a StatefulDataLoader over TokenBatches and all-gathers every item; rank 0 writes the global
batches (rank r's rows put back at rows r::W). This test compares them with the single-process plain
reader, ``Reader(cache, opts, num_readers=1).batch(b)``:

1. world size 2, 1 DataLoader worker per rank, from batch ``s``: the loader state is saved after 3 items;
2. world size 1 (here, in the test process), 2 DataLoader workers, resumed from rank 1's saved state:
   it continues at ``s + 3``; its own state is saved after 1 more item;
3. world size 2, 2 DataLoader workers per rank, resumed from that world-size-1 state: continues at ``s + 4``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="reader.torch needs the optional 'torch' extra")
pytest.importorskip("torchdata", reason="the resume goes through torchdata's StatefulDataLoader")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from reader import ReadOptions, Reader  # noqa: E402
from reader.torch import TokenBatches, resume_step  # noqa: E402
from rank_processes import run_group  # noqa: E402
from torch_helpers.common import assert_item_equals, write_cache  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
WORKER = os.path.join(HERE, "torch_helpers", "dist_worker.py")
L, B = 8, 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(str(tmp_path_factory.mktemp("torchdist") / "cache"), L, B)


def run_ranks(cfg: dict, world: int, out_dir: str, timeout_s: float = 120) -> list[dict]:
    """Start ``world`` rank processes, wait (bounded), always kill leftovers; return their reports."""
    os.makedirs(out_dir, exist_ok=True)
    cfg_path = os.path.join(out_dir, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_group(lambda r, port: [sys.executable, WORKER, cfg_path, str(r), str(world), str(port), out_dir],
                     world, out_dir, env, lambda r: os.path.join(out_dir, f"rank{r}.json"), timeout_s, what="ranks")


def assert_global(out_dir: str, ref: Reader, steps: list[int]) -> None:
    z = np.load(os.path.join(out_dir, "global.npz"))
    assert z["gathered_steps"].tolist() == [[b, b] for b in steps]  # both ranks at the same batch, in order
    for i, b in enumerate(steps):
        want = ref.batch(b)
        assert set(z.files) - {"gathered_steps"} == set(want)
        for k, v in want.items():
            got = z[k][i].view(np.uint32) if v.dtype == np.uint32 else z[k][i]
            assert got.dtype == v.dtype and np.array_equal(got, v), (k, b)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["shuffled", "eval_flat"])
def test_two_ranks_equal_the_global_batches_before_and_after_resumes_on_other_world_sizes(cache, tmp_path, mode):
    opts = {"shuffled": dict(shuffle_seed=3), "eval_flat": dict(eval_mode=True, layout="flat")}[mode]
    opts.update(seq_len=L, batch_size=B, ideal_readers=2)
    ref = Reader(cache, ReadOptions(**opts))
    n = ref.num_batches
    # training: batches 2..; eval: the last 6 batches of the pass, iterated to its end (the last is padded)
    s = 2 if n is None else n - 6
    if n is not None:
        assert not ref.batch(n - 1)["valid"].all()

    # 1. two ranks, one DataLoader worker each
    a = str(tmp_path / "a")
    reports = run_ranks({"cache": cache, "opts": opts, "start": s, "num_workers": 1, "save_after": 3,
                         "count": 5 if n is None else None}, 2, a)
    assert [(r["rank"], r["world_size"], r["rows"]) for r in reports] == [(0, 2, [0, 2]), (1, 2, [1, 3])]
    first = list(range(s, s + 5)) if n is None else list(range(s, n))
    assert all(r["steps"] == first for r in reports)
    assert_global(a, ref, first)
    saved = [torch.load(os.path.join(a, f"state-rank{r}.pt"), weights_only=False) for r in range(2)]
    assert [resume_step(sd) for sd in saved] == [s + 3, s + 3]

    # 2. world size 1 with two DataLoader workers, resumed from rank 1's state
    ds = TokenBatches(cache, ReadOptions(**opts), rank=0, world_size=1)
    ds.load_state_dict(saved[1])
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    got = []
    for item in loader:
        got.append(item)
        if len(got) == 1:
            one = loader.state_dict()
            torch.save(one, str(tmp_path / "state-w1.pt"))
        if n is None and len(got) == 3:
            break
    assert [x["step"] for x in got] == (list(range(s + 3, s + 6)) if n is None else list(range(s + 3, n)))
    for item in got:
        assert_item_equals(item, ref.batch(item["step"]))
    assert resume_step(one) == s + 4

    # 3. back on two ranks, two DataLoader workers each, from the world-size-1 state
    c = str(tmp_path / "c")
    reports = run_ranks({"cache": cache, "opts": opts, "num_workers": 2, "load": str(tmp_path / "state-w1.pt"),
                         "count": 3 if n is None else None}, 2, c)
    rest = list(range(s + 4, s + 7)) if n is None else list(range(s + 4, n))
    assert all(r["steps"] == rest for r in reports)
    assert_global(c, ref, rest)
    ref.close()
