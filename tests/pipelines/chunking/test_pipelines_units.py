"""Building one work unit on a worker (pipelines/chunking/units.py)."""

from __future__ import annotations

import os

import pytest

from build_helpers import small_plan, work_units
from pipelines.errors import BuildError
from pipelines.tokenize.fast_tokenizer import load_cached
from pipelines.chunking.units import UnitBuilder


def test_input_changed_after_planning_is_an_error_naming_the_file(tmp_path):
    plan, tok, _, (a, b) = small_plan(tmp_path)
    units = work_units(plan)
    with open(a, "ab") as f:
        f.write(b'{"text": "appended later"}\n')
    builder = UnitBuilder(str(tmp_path / "out"), load_cached(tok), plan.config.to_json(), tok.eos_id)
    unit = next(u for u in units if u.path == a)
    with pytest.raises(BuildError, match="a.jsonl changed during the build"):
        builder.build(unit)


def test_a_done_file_with_absurd_numbers_is_not_trusted(tmp_path):
    """A compressed shard's ``_DONE.json`` claiming 2**40 chunks (or not JSON, or nested 100k deep): the shard is
    streamed again and the file rewritten, instead of checking 2**40 chunks."""
    import dataclasses
    import json

    from reader.format import spec as fmt

    plan, tok, _, (a, b) = small_plan(tmp_path)
    out = str(tmp_path / "out")
    builder = UnitBuilder(out, load_cached(tok), plan.config.to_json(), tok.eos_id)
    unit = dataclasses.replace(next(u for u in work_units(plan) if u.path == b), trusted=True)
    (first,) = builder.build(unit)
    done = os.path.join(out, fmt.shard_done_path(unit.shard))
    intact = open(done, "rb").read()
    assert json.loads(intact) == first.done
    for bogus in ({"chunks": 2 ** 40, "uncompressed_bytes": first.done["uncompressed_bytes"]},
                  {"chunks": 2 ** 40, "uncompressed_bytes": 2 ** 40 * plan.config.chunk_bytes},
                  {"chunks": -1, "uncompressed_bytes": -plan.config.chunk_bytes}, [1, 2], "[" * 100_000):
        with open(done, "w") as f:
            f.write(bogus if isinstance(bogus, str) else json.dumps(bogus))
        (again,) = builder.build(unit)
        assert again == first and open(done, "rb").read() == intact, bogus
