"""Building one work unit on a worker (pipelines/build/units.py)."""

from __future__ import annotations

import pytest

from build_helpers import small_plan
from pipelines.errors import BuildError
from pipelines.plan import work_units
from pipelines.tokenize.fast_tokenizer import load_cached
from pipelines.build.units import UnitBuilder


def test_input_changed_after_planning_is_an_error_naming_the_file(tmp_path):
    plan, tok, _, (a, b) = small_plan(tmp_path)
    units = work_units(plan)
    with open(a, "ab") as f:
        f.write(b'{"text": "appended later"}\n')
    builder = UnitBuilder(str(tmp_path / "out"), load_cached(tok), plan.config.to_json(), tok.eos_id)
    unit = next(u for u in units if u.path == a)
    with pytest.raises(BuildError, match="a.jsonl changed during the build"):
        builder.build(unit)
