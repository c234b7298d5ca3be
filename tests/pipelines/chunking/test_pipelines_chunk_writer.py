"""The chunk writer (pipelines/chunking/chunk_writer.py) and the record parser (pipelines/chunking/records.py): JSON
records and their bad-record reasons, dotted keys and kept fields, the chunks written."""

from __future__ import annotations

from pipelines.chunking import records
from pipelines.chunking.records import BAD_REASONS, parse_line
from pipelines.plan import MAX_JSON_DEPTH


def test_parse_line_reasons():
    assert parse_line(b'{"text": "hi"}', "text") == ("hi", None, "")
    assert parse_line(b'{"body": "hi"}', "body")[0] == "hi"
    assert parse_line(b'\xef\xbb\xbf{"text": "bom"}\r', "text")[0] == "bom"  # BOM and CRLF tolerated
    cases = {b"": "blank_line", b"{": "invalid_json", b"[1]": "not_an_object", b"{}": "missing_text",
             b'{"text": 1}': "text_not_string", b'{"text": ""}': "empty_text", b"\xc3(": "invalid_utf8"}
    for raw, reason in cases.items():
        assert parse_line(raw, "text")[1] == reason
        assert reason in BAD_REASONS


# -- the fast JSON path (orjson) against the standard parser ----------------------------------------
# Lines the two parsers treat differently, or that only the standard one accepts: each must get exactly
# the standard parser's verdict (text, or reason and detail).
DEEP = 150  # deeper than the fast path takes, shallow enough for json
NASTY_LINES = [
    b'{"text": "plain"}',
    b'{"text": "a", "text": "b"}',  # duplicate keys: the last wins
    b'{"text": "a", "text": 7}',
    b'{"text": 7, "text": "a"}',
    b'{"text": "\\ud800 lone high surrogate"}',
    b'{"text": "\\udc00"}',
    b'{"text": "\\udfff\\ud800 reversed pair"}',
    b'{"text": "\\ud83d\\ude00 a real pair"}',
    b'{"text": "ok", "meta": "\\ud800"}',  # orjson rejects the whole line, json keeps the text
    b'{"text": NaN}',
    b'{"text": "ok", "score": NaN}',
    b'{"text": "ok", "score": -Infinity}',
    b'{"text": "ok", "score": 1e400}',
    b'{"text": 123456789012345678901234567890}',  # orjson: a float; json: an int
    b'{"text": 18446744073709551616}',
    b'{"text": -9223372036854775809}',
    b'{"text": "ok", "n": 123456789012345678901234567890}',
    b'{"text": ' + b"9" * 5000 + b"}",  # beyond json's 4300-digit limit: a ValueError of its own
    b'{"text": "ok", "n": ' + b"9" * 5000 + b"}",
    b'{"text": "ok", "deep": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    b'{"text": "ok", "deep": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}",
    b'{"text": "ok", "deep": ' + b"[" * 99 + b"]" * 99 + b"}",
    b'{"text": "ok", "deep": ' + b"[" * 998 + b"]" * 998 + b"}",  # 999 deep: json needs headroom for it
    b'{"text": "ok", "deep": ' + b"[" * 999 + b"]" * 999 + b"}",  # 1000 deep: exactly MAX_JSON_DEPTH
    b'{"text": "ok", "deep": ' + b"[" * 1000 + b"]" * 1000 + b"}",  # one more: too_deep
    b'{"text": "ok", "deep": ' + b"[" * 1010 + b"]" * 1010 + b"}",  # orjson takes it, json alone could not
    b'{"text": "ok", "deep": ' + b"[" * 1030 + b"]" * 1030 + b"}",  # beyond both parsers' limits
    b"[" * 1030 + b"]" * 1030,
    b"[" * 5000,  # not JSON, but nested: too_deep, whatever the stack
    b'{"text": "ok", "a": ' + b"[" * 1200 + b"]" * 1200 + b', "a": 1}',  # orjson keeps the last "a" only
    b'{"text": "' + b"[{" * 1500 + b'"}',  # brackets in a string nest nothing: a document
    b'{"text": "ok", "s": "\\"' + b"[" * 1500 + b'"}',  # an escaped quote does not end the string
    b'{"text": "unterminated ' + b"[" * 1500,
    b'{"text": "ok"}' + b"]" * 1500 + b"[" * 1500,
    b'\xef\xbb\xbf{"text": "after a BOM"}',
    b'\xef\xbb\xbf',
    b'\xef\xbb\xbf\xef\xbb\xbf{"text": "two BOMs"}',
    b'{"text": "caf\xc3\xa9 ok"}',
    b'{"text": "\xff invalid"}',
    b'{"text": "\xed\xa0\x80 encoded surrogate"}',
    b'{"text": "\xc0\xaf overlong"}',
    b'{"text": "\xf4\x90\x80\x80 beyond U+10FFFF"}',
    b'{"text": "truncated \xe2\x82"}',
    b"\xff\xfe{}",
    b'[1, 2]', b'"a string"', b"42", b"null", b"true", b"1.5", b"[]",
    b"", b"   ", b"\t", b"\r", b" \x0c ",
    b'{"text": "ok"}\r', b'  {"text": "ok"}  ', b'\x0c{"text": "ok"}',
    b'{"text": "ok"} trailing', b'{"text": "ok"}\x00', b'{"text": "ok",}', b"{'text': 'single quotes'}",
    b'{"text": "tab\tinside"}', b'{"text": "nul\x00inside"}', b'{"text": "bad escape \\x41"}',
    b'{"text": "short \\u12"}', b'{"text": "\\u0000 nul escape"}', b'{"text": ""}', b"{}", b'{"TEXT": "case"}',
    b'{"text": null}', b'{"text": ["a"]}', b'{"text": {"a": 1}}', b'{"text": true}', b'{"text": 1.0}',
    b'{"text": "ok", "n": 1E5, "m": -0, "k": 1.7976931348623157e308}',
    b'{"\\u0074ext": "escaped key"}',
    b'{"text": "\xe2\x80\xa8 line separator \\u2028"}',
]


def parse_line_json(raw: bytes, text_key: str, max_depth: int = MAX_JSON_DEPTH) -> tuple[str | None, str | None, str]:
    """``parse_line`` with the standard library's parser alone (the fast path's reference)."""
    text, _, reason, detail = records.parse_record_json(raw, text_key, (), max_depth)
    return text, reason, detail


def _verdict(fn, raw):
    return fn(raw, "text")  # never raises: every failure is a reason


def test_fast_json_path_gives_the_standard_parsers_verdict_on_nasty_lines():
    from pipelines.chunking import records

    assert records._orjson_loads is not None, "orjson (a dependency of apache-beam) is not installed"
    for raw in NASTY_LINES:
        assert _verdict(parse_line, raw) == _verdict(parse_line_json, raw), raw[:80]
    # the nasty lines cover every reason but the tokenizer's, the line length's (decided before parsing), the
    # kept fields' (below) and the columnar text's (tests/pipelines/inputs/test_pipelines_columnar.py)
    reasons = {parse_line_json(raw, "text")[1] for raw in NASTY_LINES}
    assert set(BAD_REASONS) - reasons == {"invalid_unicode", "tokenizer_error", "too_long", "bad_field", "null_text"}
    deep = {raw.count(b"["): parse_line(raw, "text")[1] for raw in NASTY_LINES[22:27]}
    assert deep == {998: None, 999: None, 1000: "too_deep", 1010: "too_deep", 1030: "too_deep"}


def test_nesting_verdict_does_not_depend_on_the_stack():
    """A record 1000 deep (the limit) is a document and 1001 deep is too_deep, parsed on a deep stack too;
    the same holds with a smaller limit (a cache whose ledger records another)."""
    import sys

    from pipelines.chunking import records

    good = b'{"text": "ok", "deep": ' + b"[" * 999 + b"]" * 999 + b"}"
    bad = b'{"text": "ok", "deep": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    limit = sys.getrecursionlimit()

    def at_depth(n, fn, *args):
        return at_depth(n - 1, fn, *args) if n else fn(*args)

    try:
        for fn in (parse_line, parse_line_json):
            for stack in (0, 500, 900):
                assert at_depth(stack, fn, good, "text") == ("ok", None, "")
                assert at_depth(stack, fn, bad, "text") == (None, "too_deep",
                                                            "arrays or objects nested more than 1000 deep")
            assert fn(b'{"text": "ok", "d": [[[[]]]]}', "text", 5) == ("ok", None, "")
            assert fn(b'{"text": "ok", "d": [[[[[]]]]]}', "text", 5)[1] == "too_deep"
    finally:
        sys.setrecursionlimit(limit)


def test_fast_json_path_equals_the_standard_parser_on_mutated_lines():
    """Random byte edits of good and nasty lines: the fast path never disagrees with the standard parser."""
    import random

    from pipelines.chunking import records

    rng = random.Random(7)
    seeds = [raw for raw in NASTY_LINES if len(raw) < 400] + [
        '{"text": "Grüße, 東京 and emoji 🙂", "id": 12, "meta": {"a": [1, 2.5, null, true]}}'.encode(),
        b'{"text": "x\\ny\\t\\"quoted\\" \\\\ back", "n": -1.25e-3}']
    pool = [b"\\", b'"', b"\\u", b"\\ud800", b"\xff", b"\xc3", b"\xef\xbb\xbf", b"{", b"}", b"[", b"]", b",",
            b":", b"NaN", b"1e999", b" ", b"\x00", b"\n", b"\r", b"text", b"99999999999999999999"]
    checked = 0
    for _ in range(4000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            pos = rng.randint(0, len(raw))
            op = rng.random()
            if op < 0.4:
                raw[pos:pos] = rng.choice(pool)
            elif op < 0.7 and len(raw) > 1:
                del raw[pos:pos + rng.randint(1, 3)]
            else:
                raw[pos:pos + 1] = bytes([rng.randrange(256)])
        raw = bytes(raw)
        assert _verdict(parse_line, raw) == _verdict(parse_line_json, raw), raw
        checked += 1
    assert checked == 4000


def test_dead_letters_identical_with_and_without_the_fast_json_path(tmp_path, monkeypatch):
    """A chunk built from every nasty line: dead letters, sidecar and Parquet bytes as with ``json`` alone."""
    from pipelines.chunking import records
    from pipelines.chunking.chunk_writer import ChunkBuilder
    from pipelines.tokenize.fast_tokenizer import load_cached
    from pipelines.tokenize.tokenizer import resolve
    from reader.format import spec as fmt

    lines = [raw for raw in NASTY_LINES if b"\n" not in raw]
    body = b"".join(raw + b"\n" for raw in lines)
    src = tmp_path / "nasty.jsonl"
    src.write_bytes(body)
    tok = resolve("tiktoken:cl100k_base").with_backend("reference")
    enc = load_cached(tok)
    config = {"text_key": "text", "append_eos": True, "row_group_tokens": 64, "compression": "zstd",
              "compression_level": 3, "token_encoding": "PLAIN"}

    def build(root, fast: bool):
        if not fast:
            monkeypatch.setattr(records, "_orjson_loads", None)
        b = ChunkBuilder(root=str(root), input_path=str(src), shard=0, index=0, lo=0, encoder=enc, config=config,
                         eos_id=tok.eos_id)
        off = 0
        for raw in lines:
            b.add(off, raw)
            off += len(raw) + 1
        (sidecar,) = b.finish(len(body), len(body))  # one cache: one sidecar
        monkeypatch.undo()
        return sidecar

    fast = build(tmp_path / "fast", True)
    slow = build(tmp_path / "slow", False)
    assert fast == slow
    assert fast["bad_records"] > 40 and "invalid_unicode" in fast["bad_reasons"]
    for rel in (fmt.chunk_path(0, 0), fmt.sidecar_path(0, 0), fmt.dead_letter_path(0, 0)):
        assert (tmp_path / "fast" / rel).read_bytes() == (tmp_path / "slow" / rel).read_bytes(), rel


def test_a_config_without_the_record_limits_builds_as_before_them(tmp_path):
    """A ledger written before ``max_doc_bytes`` / ``max_json_depth`` existed builds with no size limit and
    depth 1000 (what ``json`` allowed then); with the keys, a longer line is ``too_long``."""
    import json

    from pipelines.chunking.chunk_writer import ChunkBuilder
    from pipelines.tokenize.fast_tokenizer import load_cached
    from pipelines.tokenize.tokenizer import resolve

    tok = resolve("tiktoken:cl100k_base").with_backend("reference")
    enc = load_cached(tok)
    long = b'{"text": "' + b"word " * 20_000 + b'"}'
    deep = b'{"text": "deep", "m": ' + b"[" * 999 + b"]" * 999 + b"}"
    base = {"text_key": "text", "append_eos": False, "row_group_tokens": 1024, "compression": "zstd",
            "compression_level": 3, "token_encoding": "PLAIN"}

    def build(name, **limits):
        b = ChunkBuilder(root=str(tmp_path / name), input_path="in.jsonl", shard=0, index=0, lo=0, encoder=enc,
                         config={**base, **limits}, eos_id=None)
        b.add(0, long)
        b.add(len(long) + 1, deep)
        (sidecar,) = b.finish(len(long) + len(deep) + 2, len(long) + len(deep) + 2)
        return sidecar

    assert build("old")["docs"] == 2
    assert build("new", max_doc_bytes=1 << 20, max_json_depth=1000)["docs"] == 2
    limited = build("limited", max_doc_bytes=len(long) - 1, max_json_depth=999)
    assert limited["docs"] == 0 and limited["bad_reasons"] == {"too_long": 1, "too_deep": 1}
    dead = [json.loads(line) for line in (tmp_path / "limited" / limited["dead_letters"]).read_text().splitlines()]
    assert dead[0]["size"] == len(long) and dead[0]["line"] == long[:4096].decode()
    assert dead[1]["line"] == deep.decode() and "size" not in dead[1]


def test_a_hand_edited_sidecar_is_an_incomplete_chunk_not_a_crash(tmp_path):
    import json

    from pipelines.chunking.chunk_writer import verify_chunk
    from reader.format.sidecar import SIDECAR_KEYS
    from reader.format import spec as fmt

    path = tmp_path / fmt.sidecar_path(0, 0)
    path.parent.mkdir(parents=True)
    path.write_text("[" * 100_000 + "]" * 100_000)
    assert verify_chunk(str(tmp_path), 0, 0).problem == "sidecar is not valid JSON"
    sidecar = {**{k: 1 for k in SIDECAR_KEYS}, "path": fmt.chunk_path(0, 0), "shard": 0, "index_in_shard": 0,
               "byte_range": 5}
    path.write_text(json.dumps(sidecar))
    assert verify_chunk(str(tmp_path), 0, 0, (0, 10)).problem == "sidecar has another byte range"


def test_dotted_text_keys_and_kept_fields_of_json_records():
    from pipelines.chunking.records import parse_record, parse_record_json

    keep = ("source", "meta.id", "n")
    cases = [
        (b'{"meta": {"text": "nested", "id": 7}, "source": "web", "n": 18446744073709551616}',
         ("nested", ("web", "7", "18446744073709551616"), None)),  # orjson reads that integer as a float
        (b'{"meta.text": "literal wins", "meta": {"text": "not this"}}', ("literal wins", (None, None, None), None)),
        (b'{"meta": {"text": 5}}', (None, (), "text_not_string")),
        (b'{"meta": "flat"}', (None, (), "missing_text")),
        (b'{"meta": {"text": "t"}, "source": 1.5}', (None, (), "bad_field")),
        (b'{"meta": {"text": "t"}, "n": true}', (None, (), "bad_field")),
        (b'{"meta": {"text": "t", "id": {"a": 1}}}', (None, (), "bad_field")),
        (b'{"meta": {"text": "t"}, "source": null}', ("t", (None, None, None), None)),
    ]
    for raw, (text, fields, reason) in cases:
        for fn in (parse_record, parse_record_json):
            got = fn(raw, "meta.text", keep)
            assert (got[0], got[1], got[2]) == (text, fields, reason), (fn.__name__, raw)
    assert "'source' is float" in parse_record(cases[4][0], "meta.text", keep)[3]
    # a cache of format version 4 keeps floats as their shortest exact text, whichever parser read them: an
    # integer literal beyond 64 bits (a float to orjson) stays the standard parser's integer
    for raw, fields in ((b'{"text": "t", "s": 0.93, "n": 1}', ("0.93", "1")), (b'{"text": "t", "s": 1e20}', ("1e+20", None)),
                        (b'{"text": "t", "s": 18446744073709551616}', ("18446744073709551616", None)),
                        (b'{"text": "t", "s": -0.0, "n": 2.5}', ("-0.0", "2.5"))):
        for fn in (parse_record, parse_record_json):
            assert fn(raw, "text", ("s", "n"), floats=True)[:3] == ("t", fields, None), (fn.__name__, raw)
    assert parse_record(b'{"text": "t", "s": true}', "text", ("s",), floats=True)[2:] == (
        "bad_field", "'s' is bool: --keep_fields keeps strings, integers and floats")
    assert parse_record(b'{"text": "x", "n": 2.0}', "text")[:3] == ("x", (), None)  # not kept: not checked
