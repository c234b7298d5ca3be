"""JSON a user may have edited (reader/format/checks.py): how deep it nests, measured on its text without
recursion, and refused past a limit before it is parsed."""

from __future__ import annotations

import pytest

from reader.format.checks import json_nesting, load_json


def test_json_nesting_is_measured_on_the_text_without_recursion():
    assert json_nesting('{"a": [1, {"b": []}]}', 4) == 4
    assert json_nesting('{"a": [1, {"b": []}]}', 3) is None
    assert json_nesting('["[[[[", "\\\\"]", "\\"[[["]', 1) == 1  # brackets in strings, escaped quotes
    assert json_nesting("[" * 100_000, 1000) is None
    assert json_nesting('"' + '\\"[' * 100_000, 10) == 0  # one unterminated string: linear, not quadratic
    with pytest.raises(ValueError, match="nested more than 32 deep"):
        load_json("[" * 200_000 + "]" * 200_000, 32)
    with pytest.raises(ValueError, match="nested too deep"):
        load_json("[" * 200_000 + "]" * 200_000)
    assert load_json(b'{"chunks": 3}', 32) == {"chunks": 3}
