"""The chunk writer (pipelines/chunk_writer.py): line parsing and its bad-record reasons."""

from __future__ import annotations

from pipelines.chunk_writer import BAD_REASONS, parse_line


def test_parse_line_reasons():
    assert parse_line(b'{"text": "hi"}', "text") == ("hi", None, "")
    assert parse_line(b'{"body": "hi"}', "body")[0] == "hi"
    assert parse_line(b'\xef\xbb\xbf{"text": "bom"}\r', "text")[0] == "bom"  # BOM and CRLF tolerated
    cases = {b"": "blank_line", b"{": "invalid_json", b"[1]": "not_an_object", b"{}": "missing_text",
             b'{"text": 1}': "text_not_string", b'{"text": ""}': "empty_text", b"\xc3(": "invalid_utf8"}
    for raw, reason in cases.items():
        assert parse_line(raw, "text")[1] == reason
        assert reason in BAD_REASONS
