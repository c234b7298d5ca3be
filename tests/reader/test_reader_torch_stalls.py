"""reader.torch liveness: token_loader's DataLoader times out on a stalled worker (a real DataLoader worker
stopped with SIGSTOP) with ReaderStalled naming it, never on a worker waiting for a running build; a
TokenBatches under a DataLoader without a timeout warns once.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="reader.torch needs the optional 'torch' extra")

import cachegen  # noqa: E402
from reader import ReadOptions, Reader, ReaderStalled  # noqa: E402
from reader.torch import TokenBatches, resume_step, token_loader  # noqa: E402
from torch_helpers.common import assert_item_equals, write_cache  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L, B = 8, 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(str(tmp_path_factory.mktemp("torch-stalls") / "cache"), L, B)


def options(**kw) -> ReadOptions:
    return ReadOptions(seq_len=L, batch_size=B, ideal_readers=2, **kw)


def hold_worker_1(report_fd: int, gate_fd: int, worker_id: int) -> None:
    """worker_init_fn: worker 1 reports its pid, then waits for the gate to open."""
    if worker_id == 1:
        os.write(report_fd, b"%d\n" % os.getpid())
        os.read(gate_fd, 1)


def test_token_loader_sets_the_timeout_and_serves_the_same_batches(cache):
    opts = options(shuffle_seed=1, worker_timeout_s=30)
    with Reader(cache, opts) as rd:
        want = [rd.batch(b) for b in range(3, 9)]
    ds = TokenBatches(cache, opts, rank=0, world_size=1, start=3, reader_kwargs={"wait_timeout_s": 45})
    loader = token_loader(ds, num_workers=2)
    assert loader.timeout == 75 and ds.loader_timeout_s == 75  # worker_timeout_s + wait_timeout_s
    got = []
    for item in loader:
        got.append(item)
        if len(got) == len(want):
            break
    for b, (item, x) in enumerate(zip(got, want), start=3):
        assert_item_equals(item, x, b)
    assert token_loader(TokenBatches(cache, opts, rank=0, world_size=1), num_workers=0).timeout == 0  # torch's rule
    # the same call with a timeout works without workers too (torch would assert timeout == 0 there)
    same = token_loader(TokenBatches(cache, opts, rank=0, world_size=1, start=3), num_workers=0, timeout=120)
    assert same.timeout == 0
    assert_item_equals(next(iter(same)), want[0], 3)
    with pytest.raises(ValueError, match="drop batch_size"):
        token_loader(ds, batch_size=4)


def test_token_loader_makes_a_stateful_dataloader_that_resumes(cache):
    from torchdata.stateful_dataloader import StatefulDataLoader

    opts = options(worker_timeout_s=30)
    loader = token_loader(TokenBatches(cache, opts, rank=0, world_size=1), num_workers=2, loader=StatefulDataLoader)
    assert isinstance(loader, StatefulDataLoader) and loader.timeout == 630
    it = iter(loader)
    steps = [next(it)["step"] for _ in range(5)]
    assert steps == [0, 1, 2, 3, 4] and resume_step(loader.state_dict()) == 5


@pytest.mark.timeout(180)
def test_a_stopped_dataloader_worker_raises_naming_it(cache):
    """Worker 1 is stopped before it has queued a batch: a batch queued by a stopped worker would hang
    torch itself, which fetches the batch's shared-memory descriptor from the worker's own thread."""
    opts = options(worker_timeout_s=2)
    ds = TokenBatches(cache, opts, rank=0, world_size=1, reader_kwargs={"wait_timeout_s": 1})
    report_r, report_w = os.pipe()
    gate_r, gate_w = os.pipe()
    loader = token_loader(ds, num_workers=2, worker_init_fn=functools.partial(hold_worker_1, report_w, gate_r))
    it = iter(loader)
    pid = None
    try:
        pid = int(os.read(report_r, 64))
        os.kill(pid, signal.SIGSTOP)
        os.write(gate_w, b"x")  # (taken once the worker runs again)
        t0 = time.monotonic()
        assert next(it)["step"] == 0  # worker 0's
        with pytest.raises(ReaderStalled, match=rf"^DataLoader worker 1 \(pid {pid}\) delivered no batch for 3 s, "
                                                r"the DataLoader's timeout \(ReadOptions.worker_timeout_s=2 \+ "
                                                r"wait_timeout_s=1\), while global batch 1 was due from it"):
            next(it)
        elapsed = time.monotonic() - t0
        assert not os.path.exists(f"/proc/{pid}"), "the stopped worker was not shut down"
    finally:
        if pid is not None and os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        del it
        for fd in (report_r, report_w, gate_r, gate_w):
            os.close(fd)
    assert 3 <= elapsed < 60


def test_a_dataloader_without_a_timeout_warns_once(tmp_path):
    """The warning is printed in the workers (a subprocess shows what a user sees on the console)."""
    code = (
        "import sys, warnings\n"
        "sys.path.insert(0, 'tests/support')\n"
        "from torch.utils.data import DataLoader\n"
        "from reader import ReadOptions\n"
        "from reader.torch import TokenBatches, token_loader\n"
        "from torch_helpers.common import write_cache\n"
        "root = write_cache(sys.argv[1], 8, 4)\n"
        "ds = TokenBatches(root, ReadOptions(seq_len=8, batch_size=4, ideal_readers=2), rank=0, world_size=1)\n"
        "it = iter(DataLoader(ds, batch_size=None, num_workers=2))\n"
        "[next(it) for _ in range(6)]\n"
        "print('PLAIN DONE', file=sys.stderr, flush=True)\n"
        "it = iter(token_loader(ds, num_workers=2))\n"
        "[next(it) for _ in range(6)]\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    plain, _, loader = p.stderr.partition("PLAIN DONE")
    assert plain.count("with no timeout") == 1, p.stderr  # once, though two workers read six batches
    assert "token_loader(ds, num_workers=...)" in plain
    assert "with no timeout" not in loader, p.stderr


@pytest.mark.timeout(180)
def test_dataloader_workers_waiting_for_a_running_build_do_not_time_out(tmp_path):
    """worker_timeout_s=1, but the build writes nothing for 3 s while the workers wait for its chunks: the
    loader's timeout (worker_timeout_s + wait_timeout_s) leaves room for that wait."""
    rng = np.random.default_rng(8)
    chunks = cachegen.random_chunks(rng, 8, max_docs=5, max_len=40)
    opts = options(worker_timeout_s=1.0)
    done, live = str(tmp_path / "done"), str(tmp_path / "live")
    entries = cachegen.write_synthetic_cache(done, chunks, chunks_per_shard=[4, 4], row_group_tokens=9)
    with Reader(done, opts) as ref:
        want = [ref.batch(b) for b in range(8)]
    cachegen.write_synthetic_cache(live, chunks, finished=False, chunks_per_shard=[4, 4], written=[0],
                                   row_group_tokens=9)
    ds = TokenBatches(live, opts, rank=0, world_size=1, reader_kwargs={"wait_timeout_s": 60, "poll_interval_s": 0.05})
    got = []

    def consume():
        for item in token_loader(ds, num_workers=2):
            got.append(item)
            if len(got) == len(want):
                break

    cachegen.waits_then_finishes(consume, 3.0, live, done, entries)
    for b, (item, x) in enumerate(zip(got, want, strict=True)):
        assert_item_equals(item, x, b)
