"""One rank of the torch.distributed reader.torch test (run by tests/reader/test_reader_torch_distributed.py).

Usage: python dist_worker.py CONFIG.json RANK WORLD_SIZE PORT OUT_DIR

Joins a gloo process group on 127.0.0.1:PORT, iterates a StatefulDataLoader over TokenBatches (rank and
world size taken from torch.distributed), optionally resumed from a saved loader state first, and
all-gathers every field of every item so that rank 0 can write the GLOBAL batches (each rank's rows put
back at rows r::W) to OUT_DIR/global.npz. Each rank saves the loader's state_dict() after ``save_after``
items to OUT_DIR/state-rank{r}.pt and reports what it saw in OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_TESTS, os.path.dirname(os.path.dirname(_TESTS))]  # tests/support/, and the checkout's own reader/ before an installed one

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's rows of one field, put back in global row order (rank r holds rows r::W)."""
    send = t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    whole = torch.empty((send.shape[0] * world,) + tuple(send.shape[1:]), dtype=send.dtype)
    for r, p in enumerate(parts):
        whole[r::world] = p
    return whole.to(t.dtype)


def main(argv) -> int:
    cfg_path, rank, world, port, out_dir = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
    cfg = json.load(open(cfg_path))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from torchdata.stateful_dataloader import StatefulDataLoader

    from reader import ReadOptions
    from reader.torch import TokenBatches

    ds = TokenBatches(cfg["cache"], ReadOptions(**cfg["opts"]), start=cfg.get("start", 0))
    report = {"rank": ds.rank, "world_size": ds.world_size, "rows": ds.rows.tolist(), "steps": []}
    if cfg.get("load"):
        ds.load_state_dict(torch.load(cfg["load"], weights_only=False))
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=cfg["num_workers"])
    fields: dict[str, list] = {}
    steps = []
    for item in loader:
        report["steps"].append(item["step"])
        step = torch.tensor([item["step"]], dtype=torch.int64)
        steps.append(gather_rows(step, world).tolist())  # every rank at the same global batch
        for k, t in item.items():
            if k != "step":
                fields.setdefault(k, []).append(gather_rows(t, world).numpy())
        if len(report["steps"]) == cfg.get("save_after"):
            torch.save(loader.state_dict(), os.path.join(out_dir, f"state-rank{rank}.pt"))
        if cfg.get("count") and len(report["steps"]) == cfg["count"]:
            break
    if rank == 0:
        np.savez(os.path.join(out_dir, "global.npz"), gathered_steps=np.array(steps, dtype=np.int64),
                 **{k: np.stack(v) for k, v in fields.items()})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
