"""The resume state of :class:`reader.torch.TokenBatches` (no torch needed to read it).

The state is the next global batch. ``TokenBatches.state_dict()`` marks its dict with :data:`STATE_KEY`;
torchdata's ``StatefulDataLoader`` keeps one such dict per DataLoader worker plus the items it has
yielded, and :func:`resume_step` turns either into the next global batch.
"""

from __future__ import annotations

from typing import Any, Mapping

STATE_KEY = "chunkledger_torch"  # marks (and versions) a TokenBatches.state_dict()
STATE_VERSION = 1


def _ours(state: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or STATE_KEY not in state:
        raise ValueError(f"{where} holds no TokenBatches state (got {type(state).__name__}"
                         f"{' with keys ' + str(sorted(state)) if isinstance(state, Mapping) else ''}); was "
                         f"the DataLoader's dataset a reader.torch.TokenBatches?")
    return state


def resume_step(state: Mapping[str, Any]) -> int:
    """The next global batch recorded in ``state``.

    Args:
      state: a :meth:`reader.torch.TokenBatches.state_dict` of the process that iterated (not of one DataLoader
        worker), or a whole ``torchdata.stateful_dataloader.StatefulDataLoader.state_dict()`` over a
        :class:`reader.torch.TokenBatches`, saved with any ``num_workers`` and any world size (every rank of a job
        holds the same step; any rank's state will do).

    A StatefulDataLoader with ``k`` workers stores each worker's own next batch plus the number of
    items it has yielded in order; every worker's state also holds the batch its iteration began at,
    so the next global batch is that batch plus the items yielded. At the end of an eval pass this is
    the pass's ``num_batches``.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if STATE_KEY in state:
        if int(state.get("num_workers", 1)) > 1:
            raise ValueError(
                f"this is the state of DataLoader worker {state.get('worker_id')} of {state.get('num_workers')}, "
                "which knows only its own batches; pass the StatefulDataLoader's whole state_dict(), or the "
                "step of the last item you trained on + 1 ({'step': n})")
        return int(state["step"])
    if "_snapshot" in state:  # StatefulDataLoader, num_workers > 0
        snap = state["_snapshot"]
        workers = [_ours((ws or {}).get("dataset_state"), f"StatefulDataLoader worker state {key!r}")
                   for key, ws in sorted(snap.get("_worker_snapshots", {}).items())]
        starts = {int(w["start"]) for w in workers}
        if len(starts) != 1:
            raise ValueError(f"the StatefulDataLoader's workers began at different batches {sorted(starts)}; "
                             "the state is not one TokenBatches iteration")
        return starts.pop() + int(snap["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))
    if "_num_yielded" in state:  # StatefulDataLoader, num_workers == 0: the dataset iterated in-process
        return resume_step(_ours(state.get("dataset_state"), "the StatefulDataLoader state"))
    raise ValueError(f"not a TokenBatches or StatefulDataLoader state (keys {sorted(state)}); "
                     "pass TokenBatches.state_dict(), StatefulDataLoader.state_dict(), or {'step': n}")
