"""--text_key and --keep_fields (pipelines/inputs/keys.py): nested keys and columns, kept values, and the
error that lists the keys a file does have."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from pipelines.inputs import keys
from pipelines.inputs.keys import MISSING, json_lookup, keep_value


def test_json_lookup_exact_key_first_then_dots():
    obj = {"text": "t", "metadata": {"text": "nested", "deep": {"x": 1}}, "a.b": "literal", "a": {"b": "nested b"}}
    assert json_lookup(obj, "text") == "t"
    assert json_lookup(obj, "metadata.text") == "nested"
    assert json_lookup(obj, "metadata.deep.x") == 1
    assert json_lookup(obj, "a.b") == "literal"  # a key written with a dot wins
    for absent in ("content", "metadata.nope", "text.more", "metadata.deep.x.y", "."):
        assert json_lookup(obj, absent) is MISSING, absent


def test_keep_value_keeps_strings_and_integers_as_text():
    assert keep_value("web") == ("web", True)
    assert keep_value(42) == ("42", True)
    assert keep_value(-(2 ** 70)) == (str(-(2 ** 70)), True)
    assert keep_value(None) == (None, True) and keep_value(MISSING) == (None, True)
    for bad in (True, False, 1.5, {"a": 1}, [1]):
        assert keep_value(bad) == (None, False), bad


def test_parse_keep_fields():
    assert keys.parse_keep_fields("source, url,metadata.lang") == ("source", "url", "metadata.lang")
    assert keys.parse_keep_fields(None) == () and keys.parse_keep_fields("") == ()
    with pytest.raises(ValueError, match="names 'url' twice"):
        keys.parse_keep_fields("url,source,url")


def test_missing_text_key_lists_the_keys_records_have_and_suggests_one():
    objs = [json.loads(json.dumps({"content": f"doc {i}", "id": i, "meta": {"source": "web"}})) for i in range(200)]
    msg = keys.missing_key_problem("data/a.jsonl", "text", objs)
    assert msg == ("input file data/a.jsonl: 200 of the first 200 records have no key 'text' (--text_key text). "
                   "Their keys (records having each): content (200), id (200), meta (200), meta.source (200); "
                   "pass --text_key content?")
    assert keys.missing_key_problem("a.jsonl", "content", objs) is None
    assert keys.missing_key_problem("a.jsonl", "meta.source", objs) is None  # nested keys are found too
    # at most half lacking it: bad records for those, no refusal
    half = objs[:100] + [{"text": "x"}] * 100
    assert keys.missing_key_problem("a.jsonl", "text", half) is None
    assert "101 of the first 201" in keys.missing_key_problem("a.jsonl", "text", half + [{}])
    assert keys.missing_key_problem("a.jsonl", "text", []) is None


SCHEMA = pa.schema([("id", pa.int64()), ("content", pa.large_string()),
                    ("metadata", pa.struct([("text", pa.string()), ("inner", pa.struct([("src", pa.string())]))])),
                    ("tags", pa.list_(pa.string())), ("a.b", pa.string())])


def test_schema_lookup_descends_structs_only():
    assert keys.schema_lookup(SCHEMA, "content") == (["content"], pa.large_string())
    assert keys.schema_lookup(SCHEMA, "metadata.text") == (["metadata", "text"], pa.string())
    assert keys.schema_lookup(SCHEMA, "metadata.inner.src") == (["metadata", "inner", "src"], pa.string())
    assert keys.schema_lookup(SCHEMA, "a.b") == (["a.b"], pa.string())
    for absent in ("text", "metadata.nope", "tags.item", "id.x"):
        assert keys.schema_lookup(SCHEMA, absent) is None, absent
    assert keys.column_paths(SCHEMA) == ["id", "content", "metadata", "metadata.text", "metadata.inner",
                                         "metadata.inner.src", "tags", "a.b"]


def test_missing_column_message_lists_columns_and_suggests_a_text_one():
    msg = keys.missing_column_message("x.parquet", "text", SCHEMA, "--text_key")
    assert msg.startswith("input file x.parquet has no column 'text' (--text_key text). Its columns: id (int64), "
                          "content (large_string), metadata (struct<")
    assert msg.endswith("; pass --text_key content?")
    assert "pass" not in keys.missing_column_message("x.parquet", "src", SCHEMA, "--keep_fields")


def test_types_accepted_for_text_and_kept_fields():
    assert all(keys.is_text_type(t) for t in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary()))
    assert not any(keys.is_text_type(t) for t in (pa.int64(), pa.list_(pa.string()), pa.struct([("a", pa.string())])))
    assert all(keys.is_keepable_type(t) for t in (pa.string(), pa.int8(), pa.uint64(), pa.null()))
    assert not any(keys.is_keepable_type(t) for t in (pa.float64(), pa.bool_(), pa.binary(), pa.list_(pa.int8())))


def test_records_of_another_format_built_as_text_get_their_record_format():
    pc = [{"prompt": f"q {i}", "completion": f"a {i}", "id": i} for i in range(50)]
    assert keys.missing_key_problem("sft.jsonl", "text", pc) == (
        "input file sft.jsonl: 50 of the first 50 records have no key 'text' (--text_key text). Their keys (records "
        "having each): prompt (50), completion (50), id (50); these are prompt/completion records: pass "
        "--record_format prompt_completion?")
    chat = [{"messages": [{"role": "user", "content": "hi"}]}] * 10
    assert keys.missing_key_problem("c.jsonl", "text", chat).endswith(
        "; these are chat records: pass --record_format chat?")
    sharegpt = [{"id": 1, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}] * 10
    assert keys.missing_key_problem("s.jsonl", "text", sharegpt).endswith(
        "; these are chat records: pass --record_format chat --messages_key conversations?")
    # a chat build of ShareGPT records: the key to pass
    assert keys.missing_key_problem("s.jsonl", "messages", sharegpt, "--messages_key", list).endswith(
        "; pass --messages_key conversations?")
    columns = pa.schema([("prompt", pa.string()), ("completion", pa.string())])
    assert keys.missing_column_message("p.parquet", "text", columns, "--text_key") == (
        "input file p.parquet has no column 'text' (--text_key text). Its columns: prompt (string), completion "
        "(string); these are prompt/completion records: pass --record_format prompt_completion?")
    messages = pa.schema([("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())])))])
    assert keys.is_messages_type(messages.field("conversations").type)
    assert keys.missing_column_message("c.parquet", "text", messages, "--text_key").endswith(
        "; these are chat records: pass --record_format chat --messages_key conversations?")
