"""One JAX process of the multi-process reader.jax test (run by tests/reader/test_reader_jax_multiprocess.py).

Usage: python mp_worker.py CONFIG.json PROCESS_ID NUM_PROCESSES PORT OUT.json

Initializes jax.distributed with the coordinator on 127.0.0.1:PORT, builds a JaxLoader on a shared mesh
for every setup in the config, and writes (to OUT.json) the rows this process read, a checksum of every
addressable shard, checksums of the all-gathered global batches, and the toy step's outputs, both for
a straight run from step ``first`` and for a run resumed at step ``restart_at``.
"""

from __future__ import annotations

import json
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_TESTS, os.path.dirname(os.path.dirname(_TESTS))]  # tests/support/, and the checkout's own reader/ before an installed one

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main(argv) -> int:
    cfg_path, pid, nproc, port, out_path = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
    cfg = json.load(open(cfg_path))
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid, initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from jax_helpers.common import CountingReader, index_to_json, make_toy_step, sha, spec_from_json
    from reader import ReadOptions, Reader
    from reader.jax import JaxLoader

    result = {"process_index": jax.process_index(), "process_count": jax.process_count(),
              "local_devices": jax.local_device_count(), "setups": []}
    reader = Reader(cfg["cache"], ReadOptions(**cfg["opts"]), num_readers=1, reader_index=0)
    L = reader.options.seq_len
    toy = make_toy_step(L)
    workers = reader.options.num_workers  # > 0: the loader reads through worker processes (a Reader only)
    for setup in cfg["setups"]:
        counting = reader if workers else CountingReader(reader)
        mesh = Mesh(np.array(jax.devices()).reshape(setup["mesh_shape"]), tuple(setup["axis_names"]))
        loader = JaxLoader(counting, None, mesh, spec_from_json(setup["spec"]), prefetch=2)
        rec = {"rows": loader.rows.tolist(), "batches": [], "toy": [], "toy_resumed": []}
        state = np.int32(0)
        first = setup.get("first", 0)
        count = None if setup.get("until_end") else setup["steps"]  # eval: let the pass end by itself
        for step, batch in loader.iter_batches(start=first, count=count):
            shards = {name: sorted([index_to_json(s.index), sha(s.data)] for s in arr.addressable_shards)
                      for name, arr in batch.items()}
            gathered = {name: sha(multihost_utils.process_allgather(arr, tiled=True))
                        for name, arr in batch.items()}
            state, per_segment = toy(state, batch)
            rec["batches"].append({"step": step, "shards": shards, "global": gathered})
            rec.setdefault("pools", []).append([len(p._procs) for p in loader._worker_pools])
            rec["toy"].append([int(multihost_utils.process_allgather(state, tiled=True)),
                               sha(multihost_utils.process_allgather(per_segment, tiled=True))])
        # Simulated restart: a fresh loader resumed at step k, with the state checkpointed after step k-1.
        k = setup["restart_at"]
        state = np.int32(rec["toy"][k - first - 1][0]) if k > first else np.int32(0)
        loader.close()
        loader = JaxLoader(counting, None, mesh, spec_from_json(setup["spec"]), start=k, prefetch=2)
        for step, batch in loader.iter_batches(count=None if count is None else first + count - k):
            state, per_segment = toy(state, batch)
            rec["toy_resumed"].append([step, int(multihost_utils.process_allgather(state, tiled=True)),
                                       sha(multihost_utils.process_allgather(per_segment, tiled=True))])
        loader.close()
        rec["calls"] = getattr(counting, "calls", None)
        rec["hints"] = getattr(counting, "hints", None)
        result["setups"].append(rec)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
