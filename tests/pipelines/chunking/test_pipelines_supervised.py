"""pipelines/chunking/supervised.py: supervised records read from JSON and columnar values, their canonical form,
their loss spans, and their encoding with the build's encoder (reference and fast backends, the fast one
checked against the reference)."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pytest

from pipelines.chunking.supervised import Supervised, canonical, spans_of
from pipelines.inputs.rows import supervised_records
from pipelines.tokenize import fast_tokenizer as ft
from pipelines.tokenize import guarded_encoder
from pipelines.tokenize import sft
from pipelines.tokenize import sft_encoders
from pipelines.tokenize.tokenizer import resolve
from sftgen import conversations

SPEC = resolve("tiktoken:cl100k_base")
EOT = SPEC.eos_id
CHAT = ("{% for m in messages %}<|fim_prefix|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{{ eos_token }}{% endif %}\n"
        "{% endfor %}")
MARKER = "zebra"


def config(record_format: str, **kw) -> dict:
    return {"record_format": record_format, "prompt_key": "prompt", "completion_key": "completion",
            "messages_key": "messages", "append_eos": record_format == "prompt_completion", "keep_fields": [],
            "chat_template": {"bos_token": None, "eos_token": "<|endoftext|>"}, **kw}


@pytest.fixture(autouse=True)
def fresh_loads(monkeypatch):
    monkeypatch.setattr(ft, "_LOADED", {})


def supervised(record_format: str, backend: str = "reference", **kw) -> Supervised:
    encoder = ft.load_encoder(SPEC.with_backend(backend))
    return Supervised(config(record_format, **kw), encoder, EOT, CHAT if record_format == "chat" else "")


def test_canonical_form_sorts_keys_keeps_utf8_and_leaves_nulls_out():
    a = {"messages": [{"role": "user", "content": "café 🙂", "name": None, "tool_calls": [{"id": None, "x": 1}]}]}
    b = {"messages": [{"tool_calls": [{"x": 1}], "content": "café 🙂", "role": "user"}]}
    assert canonical(a) == canonical(b) == '{"messages":[{"content":"café 🙂","role":"user","tool_calls":[{"x":1}]}]}'
    assert canonical({"prompt": "", "completion": "x"}) == '{"completion":"x","prompt":""}'


def test_spans_are_the_maximal_runs_of_loss_tokens():
    assert spans_of(np.array([], dtype=bool)).tolist() == []
    assert spans_of(np.array([0, 1, 1, 0, 1, 0, 0, 1], dtype=bool)).tolist() == [1, 3, 4, 5, 7, 8]
    assert spans_of(np.ones(5, dtype=bool)).tolist() == [0, 5]
    rng = np.random.default_rng(0)
    for _ in range(200):
        mask = rng.random(rng.integers(0, 40)) < 0.5
        spans = spans_of(mask)
        back = np.zeros(len(mask), dtype=bool)
        for lo, hi in spans.reshape(-1, 2):
            assert lo < hi
            back[lo:hi] = True
        assert spans.dtype == np.int32 and (back == mask).all() and (np.diff(spans) > 0).all()


@pytest.mark.parametrize("raw, reason, detail", [
    (b'{"q": {"text": "x"}}', "missing_completion", "no key 'a'"),
    (b'{"a": "y"}', "missing_prompt", "no key 'q.text'"),
    (b'{"q": {"text": "x"}, "a": 3}', "completion_not_string", "'a' is int"),
    (b'{"q": {"text": 1}, "a": "y"}', "prompt_not_string", "'q.text' is int"),
    (b'{"q": {"text": "x"}, "a": ""}', "empty_completion", ""),
    (b'{"q": {"text": "x"}, "a": "y", "src": 1.5}', "bad_field", "'src' is float"),
    (b'{"q": ', "invalid_json", ""),
    (b'["x"]', "not_an_object", ""),
    (b'{"q": {"text": "x\\ud800"}, "a": "y"}', "invalid_unicode", ""),
])
def test_json_records_are_set_aside_with_reasons_naming_the_keys(raw, reason, detail):
    sup = supervised("prompt_completion", prompt_key="q.text", completion_key="a", keep_fields=["src"])
    record, fields, got, got_detail = sup.from_json(raw)
    assert record is None and got == reason and detail in got_detail


def test_a_float_field_is_kept_in_a_cache_that_keeps_floats():
    sup = supervised("prompt_completion", keep_fields=["src"], keep_floats=True)
    record, fields, reason, _ = sup.from_json(b'{"prompt": "p", "completion": "c", "src": 1.5}')
    assert (record, fields, reason) == ({"prompt": "p", "completion": "c"}, ("1.5",), None)


def test_json_records_and_columnar_rows_read_the_same():
    sup = supervised("prompt_completion", keep_fields=["src"])
    record, fields, reason, _ = sup.from_json(b'{"prompt": "p", "completion": "c", "src": 7}')
    assert (record, fields, reason) == ({"prompt": "p", "completion": "c"}, ("7",), None)
    assert sup.from_values(("p", "c")) == record
    with pytest.raises(sft.BadRecord, match="completion_not_string"):
        sup.from_values(("p", None))  # a column's null is a JSON null


def test_a_chat_record_holding_a_large_integer_is_read_as_the_standard_parser_reads_it():
    """orjson turns integers beyond 64 bits into floats; messages reach the template whole, so such a record
    is parsed again by the standard parser."""
    sup = supervised("chat")
    raw = b'{"messages": [{"role": "user", "content": "x", "n": 100000000000000000000}]}'
    record, _, reason, _ = sup.from_json(raw)
    assert reason is None and record == {"messages": json.loads(raw)["messages"]}
    assert type(record["messages"][0]["n"]) is int


def test_columnar_rows_of_messages_are_the_json_records():
    msgs = conversations(40, seed=2)
    typ = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    arrays = [pa.array(msgs, typ), pa.array([f"s{i}" for i in range(len(msgs))])]
    rows = list(supervised_records(arrays, 10, 1))
    sup = supervised("chat")
    for i, row in enumerate(rows):
        assert row.row == 10 + i and row.fields == (f"s{i}",) and row.reason is None
        record = sup.from_values(row.values)
        assert canonical(record) == canonical({"messages": msgs[i]})  # the struct's null "name" left out
    bad = pa.array([[{"role": "user", "content": b"\xff"}]], pa.list_(pa.struct([("role", pa.string()),
                                                                               ("content", pa.binary())])))
    bad = bad.cast(pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])), safe=False)
    [row] = supervised_records([bad], 0, 1)
    assert row.values is None and row.reason == "invalid_utf8"


def pc_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    convs = conversations(n, seed)
    return [{"prompt": m[0]["content"] if rng.random() < 0.8 else "", "completion": m[-1]["content"] or "x"}
            for m in convs]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_prompt_completions_encoded_in_one_call_are_sft_records(backend):
    sup = supervised("prompt_completion", backend)
    records = pc_records(300)
    out = sup.encode_many(records, list(range(len(records))), "test")
    tt = sft_encoders.TiktokenSft(SPEC.load_reference().enc)
    for record, (ids, spans) in zip(records, out):
        want_ids, want_mask = sft.encode_prompt_completion(*sft.prompt_completion_of(record), tt, EOT)
        assert ids.tolist() == want_ids.tolist() and spans.tolist() == spans_of(want_mask).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_chat_records_are_sft_records_with_either_backend(backend):
    sup = supervised("chat", backend)
    records = [{"messages": m} for m in conversations(200, seed=4)]
    out = sup.encode_many(records, list(range(len(records))), "test")
    tt = sft_encoders.TiktokenSft(SPEC.load_reference().enc)
    bad = 0
    for record, got in zip(records, out):
        try:
            ids, mask = sft.encode_chat(record, CHAT, tt, eos_token="<|endoftext|>")
        except sft.BadRecord as e:
            assert isinstance(got, sft.BadRecord) and got.reason == e.reason
            bad += 1
            continue
        assert got[0].tolist() == ids.tolist() and got[1].tolist() == spans_of(mask).tolist()
    assert 0 < bad < 40
    if backend == "fast":
        assert sup.reference is not None and sup.verified == len(guarded_encoder.sampled(range(len(records)), 1000))


class OneTokenOff(ft.FastEncoder):
    """A broken fast backend: the real one, but the first token of any text holding MARKER is changed."""

    def encode_many(self, texts):
        out = super().encode_many(texts)
        return [a if MARKER not in t or not len(a) else
                np.concatenate([[(a[0] + 1) % 1000], a[1:]]).astype(np.int32) for t, a in zip(texts, out)]


@pytest.mark.slow
@pytest.mark.parametrize("record_format", ["chat", "prompt_completion"])
def test_the_fast_backend_is_checked_against_the_reference_on_sampled_records(record_format):
    fast = ft.load_encoder(SPEC.with_backend("fast"))
    broken = OneTokenOff(fast.tok, fast.reference, cut_long=True, verify_every=1)
    sup = Supervised(config(record_format), broken, EOT, CHAT if record_format == "chat" else "")
    records = ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": t}]}
                for t in ("fine", f"a {MARKER}")] if record_format == "chat" else
               [{"prompt": "q", "completion": t} for t in ("fine", f"a {MARKER}")])
    sup.encode_many(records[:1], [0], "in.jsonl")
    with pytest.raises(guarded_encoder.TokenMismatchError, match=r"disagrees with the reference on the supervised record at "
                                                    r"position 70 of in\.jsonl"):
        sup.encode_many(records, [0, 70], "in.jsonl")
