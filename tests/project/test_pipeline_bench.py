"""benchmarks/pipeline_bench.py: the steady state and the itemized fixed seconds from a build's trace."""

from __future__ import annotations

import pytest

from benchmarks.pipeline_bench import trace_figures


def _ev(t, pid, event, **kw):
    return {"t": t, "pid": pid, "event": event, **kw}


def test_trace_figures_separate_steady_work_from_fixed_costs():
    t0 = 1000.0
    ev = [
        _ev(t0 + 0.1, 1, "launcher_start"), _ev(t0 + 1.5, 1, "launcher_imported"), _ev(t0 + 1.7, 1, "planned"),
        _ev(t0 + 1.8, 1, "run_start"),
        _ev(t0 + 4.0, 2, "setup_start", proc_start=t0 + 2.0), _ev(t0 + 4.2, 2, "setup_done"),
        _ev(t0 + 4.1, 3, "setup_start", proc_start=t0 + 2.1), _ev(t0 + 4.3, 3, "setup_done"),
        # worker 2: 100 tokens/s over 10 s; worker 3: 50 tokens/s over 9 s (two units with a gap)
        _ev(t0 + 4.2, 2, "unit_start", shard=0, index=0), _ev(t0 + 14.2, 2, "unit_done", shard=0, index=0, tokens=1000),
        _ev(t0 + 4.3, 3, "unit_start", shard=1, index=0), _ev(t0 + 8.3, 3, "unit_done", shard=1, index=0, tokens=200),
        _ev(t0 + 8.3, 3, "unit_start", shard=1, index=1), _ev(t0 + 13.3, 3, "unit_done", shard=1, index=1, tokens=250),
        _ev(t0 + 14.4, 2, "finalize_start"), _ev(t0 + 14.5, 2, "finalize_done"), _ev(t0 + 16.0, 1, "run_done"),
        _ev(t0 + 16.0, 1, "launcher_exit"),
    ]
    f = trace_figures(ev, t0, 16.5, 1450)
    assert f["steady_tokens_per_s"] == pytest.approx(150.0)
    assert f["busy_s"] == pytest.approx(1450 / 150)
    fx = f["fixed"]
    assert fx["before_first_unit_s"] == pytest.approx(4.2)
    assert fx["after_last_unit_s"] == pytest.approx(16.5 - 14.2)
    assert fx["tail_s"] == pytest.approx(10.0 - 1450 / 150)
    # the itemized fixed costs add up to the wall time outside the steady state
    assert fx["before_first_unit_s"] + fx["tail_s"] + fx["after_last_unit_s"] + f["busy_s"] == pytest.approx(16.5)
    assert fx["launcher_imports_s"] == pytest.approx(1.4) and fx["plan_s"] == pytest.approx(0.2)
    assert fx["first_worker_process_s"] == pytest.approx(2.0)
    assert fx["runner_shutdown_s"] == pytest.approx(1.5) and fx["launcher_exit_s"] == pytest.approx(0.5)
    assert f["units"] == 3 and f["workers_seen"] == 2


def test_trace_figures_empty_without_units():
    assert trace_figures([_ev(1.0, 1, "launcher_start")], 0.0, 5.0, 10) == {}
