"""reader.jax across REAL JAX processes: 2 and 4 processes on localhost (jax.distributed, coordinator on
127.0.0.1), each with several virtual CPU devices.

Each worker (tests/support/jax_helpers/mp_worker.py) builds global batches with JaxLoader on a mesh over all 8
devices and reports the rows it read, a checksum per addressable shard, checksums of the all-gathered
global arrays (multihost_utils.process_allgather) and the outputs of a jit-ed toy step, straight and
resumed at step k. This test compares all of it with the single-process plain reader
(Reader(num_readers=1).batch(b)), computed here without jax.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("jax", reason="reader.jax needs the optional 'jax' extra")

from cachegen import random_chunks, write_synthetic_cache  # noqa: E402
from rank_processes import run_group  # noqa: E402
from jax_helpers.common import expected_device_rows, index_from_json, sha, toy_reference  # noqa: E402
from reader import ReadOptions, Reader  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
WORKER = os.path.join(HERE, "jax_helpers", "mp_worker.py")
TOTAL_DEVICES = 8
B, L = 8, 16

# (mesh shape, axis names, spec): devices are jax.devices() reshaped, so process p owns a contiguous
# block of device ids. Batch axis across processes, inside processes, over two axes, with the
# sequence axis sharded too, and an interleaved layout where a process holds non-contiguous rows.
SETUPS = [
    ((8,), ["data"], ["data"]),
    ((2, 4), ["data", "model"], ["data", None]),
    ((2, 2, 2), ["data", "fsdp", "model"], [["data", "fsdp"], None]),
    ((2, 4), ["replica", "data"], ["data"]),
    ((4, 2), ["data", "seq"], ["data", "seq"]),
    ((2, 4), ["model", "data"], [["data", "model"], None]),
]


def expected_process_rows(mesh_shape, axis_names, spec, nproc) -> list[list[int]]:
    """Rows each process must read: the union over its devices (process p owns devices
    [p*local, (p+1)*local) of the row-major device list)."""
    local = TOTAL_DEVICES // nproc
    per_device = expected_device_rows(mesh_shape, axis_names, spec, B)
    return [sorted(set().union(*per_device[p * local:(p + 1) * local])) for p in range(nproc)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("jaxmp") / "cache")
    rng = np.random.default_rng(5)
    write_synthetic_cache(root, random_chunks(rng, 14), chunks_per_shard=[5, 5, 4])
    return root


def run_processes(cfg_path, nproc, out_dir, timeout_s=150):
    """Start nproc workers, wait (bounded), always kill leftovers; return their JSON results."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={TOTAL_DEVICES // nproc}"
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    out = lambda i: os.path.join(out_dir, f"out{i}.json")  # noqa: E731
    return run_group(lambda i, port: [sys.executable, WORKER, cfg_path, str(i), str(nproc), str(port), out(i)],
                     nproc, out_dir, env, out, timeout_s, what="workers")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc,mode", [(2, "packed_shuffled"), (4, "unpacked"), (2, "eval_packed"),
                                       (2, "packed_shuffled_workers")])
def test_multiprocess_global_batches(cache, tmp_path, nproc, mode):
    opts = dict(seq_len=L, batch_size=B, ideal_readers=4)
    opts.update({"packed_shuffled": dict(packed=True, shuffle_seed=7), "unpacked": dict(packed=False),
                 "eval_packed": dict(packed=True, eval_mode=True),
                 # each process's rows (a block, or interleaved) through 2 reader worker processes
                 "packed_shuffled_workers": dict(packed=True, shuffle_seed=7, num_workers=2)}[mode])
    reader = Reader(cache, ReadOptions(**opts), num_readers=1, reader_index=0)
    if reader.num_batches is None:
        first, steps, until_end = 0, 4, False
    else:  # eval: the last 3 batches, iterated until the pass ends (the last one is padded)
        first, steps, until_end = reader.num_batches - 3, 3, True
    restart_at = first + 2
    setups = SETUPS if nproc == 2 and mode == "packed_shuffled" else SETUPS[1:3] + SETUPS[-1:]
    cfg = {"cache": cache, "opts": opts,
           "setups": [{"mesh_shape": list(s), "axis_names": n, "spec": p, "steps": steps, "first": first,
                       "until_end": until_end, "restart_at": restart_at} for s, n, p in setups]}
    cfg_path = str(tmp_path / "cfg.json")
    json.dump(cfg, open(cfg_path, "w"))

    # the workers run jax without x64: int64 per-row fields arrive as int32 (documented in reader.jax)
    ref = [{k: (v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in reader.batch(b).items()}
           for b in range(first, first + steps)]
    if until_end:
        assert not ref[-1]["valid"].all(), "the test cache is sized so that the last eval batch is padded"
    toy_ref = toy_reference(ref, L)

    results = run_processes(cfg_path, nproc, str(tmp_path))
    assert sorted(r["process_index"] for r in results) == list(range(nproc))
    assert all(r["process_count"] == nproc and r["local_devices"] == TOTAL_DEVICES // nproc for r in results)
    for si, (shape, names, spec) in enumerate(setups):
        want_rows = expected_process_rows(shape, names, spec, nproc)
        for res in results:
            p = res["process_index"]
            rec = res["setups"][si]
            # Each process reads only the rows its devices hold, once per batch (one rows() call).
            assert rec["rows"] == want_rows[p], (shape, names, spec, p)
            if mode.endswith("_workers"):  # every batch came from the loader's 2 worker processes
                assert rec["pools"] == [[2]] * steps
            else:
                assert sorted(b for b, _ in rec["calls"][:steps]) == list(range(first, first + steps))
                assert all(rows == want_rows[p] for _, rows in rec["calls"])
                assert rec["hints"] and all(rows == want_rows[p] for _, rows in rec["hints"])  # read-ahead too
                assert len(rec["calls"]) == steps + (first + steps - restart_at)
            assert [got["step"] for got in rec["batches"]] == list(range(first, first + steps))
            for bi, got in enumerate(rec["batches"]):
                for name, shards in got["shards"].items():
                    for index, digest in shards:
                        assert digest == sha(ref[bi][name][index_from_json(index)]), (name, index, p)
                for name, digest in got["global"].items():
                    assert digest == sha(ref[bi][name]), (name, got["step"], p, spec)
            assert [tuple(t) for t in rec["toy"]] == toy_ref
            assert [tuple(t) for t in rec["toy_resumed"]] == [
                (k,) + toy_ref[k - first] for k in range(restart_at, first + steps)]
