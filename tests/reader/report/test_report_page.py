"""``python -m reader report``: the page's content for a cache, a mixture, a running build and a real build with
bad records; self-contained HTML; a bounded number of chunk reads on a cache of many chunks."""

import base64
import dataclasses
import html.parser
import json
import os
import re
import socket

import numpy as np
import pytest

from reader import ReadOptions
from reader.cli.main import main
from reader.format import spec as fmt
from reader.tokenizers import tokenizer_lib
from reader.report import collect as collect_mod
from reader.report import page
from reader.storage.cache import Cache
from reader.storage.validate import chunk_doc_lengths

import cachegen
import mixgen
from build_helpers import build, load_ledger, refinish, sample_texts, write_shard


class Page(html.parser.HTMLParser):
    """What a test needs of the page: tags seen, image sources, text by element id, all text."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.images, self.by_id, self.text, self._ids = set(), [], {}, [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "img":
            self.images.append((a.get("src", ""), a.get("alt", "")))
        self._ids.append(a.get("id"))
        if a.get("id"):
            self.by_id[a["id"]] = ""

    def handle_endtag(self, tag):
        if self._ids:
            self._ids.pop()

    def handle_data(self, data):
        self.text.append(data)
        for i in self._ids:
            if i:
                self.by_id[i] += data

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def report(path, out, *extra) -> Page:
    assert main(["report", str(path), "--out", str(out), *extra]) == 0
    text = open(os.path.join(out, "index.html"), encoding="utf-8").read()
    return Page(text)


def assert_self_contained(p: Page):
    assert not p.tags & {"script", "link", "iframe", "object", "embed"}
    assert p.images and all(src.startswith("data:image/png;base64,") for src, _ in p.images)
    for src, _ in p.images:
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def synthetic(tmp_path):
    rng = np.random.default_rng(5)
    chunks = cachegen.random_chunks(rng, 10, empty_prob=0.1)
    root = str(tmp_path / "c")
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[6, 4], row_group_tokens=16)
    return root, chunks


def test_the_page_of_a_cache(synthetic, tmp_path, capsys):
    root, chunks = synthetic
    out = tmp_path / "rep"
    p = report(root, out, "--seq_len", "16", "--batch_size", "4", "--steps", "7", "--ideal_readers", "2")
    assert capsys.readouterr().out.startswith(f"wrote {out}/index.html (")
    assert_self_contained(p)
    docs = sum(len(c) for c in chunks)
    assert p.by_id["documents"] == f"{docs:,}" and p.by_id["chunks"] == "10" and p.by_id["input-shards"] == "2"
    assert p.by_id["tokens"] == f"{sum(len(d) for c in chunks for d in c):,}"
    assert "Rows show token ids" in p.by_id["tokenizer"]  # a synthetic cache: no tokenizer to decode with
    alts = [alt for _, alt in p.images]
    assert alts == ["document lengths", "tokens per input shard", "chunk sizes"]  # no shuffle, no mixture
    text = p.all_text
    assert "finished" in text and "Batch 0" in text and "Batch 7" in text and "Bad records" in text
    assert p.by_id["command"] == (f"python -m reader report {root} --out {out} --seq_len 16 --batch_size 4 "
                                  "--ideal_readers 2 --steps 7 --rows 4 --max_chunks 64")


def test_the_page_shows_the_rows_decoded(tmp_path):
    """A cache of cl100k token ids: the page's rows are the tokenizer's text of the batch's tokens."""
    tok = tokenizer_lib.resolve("tiktoken:cl100k_base")
    docs = [tok.encode(t) + [tok.eos.id] for t in sample_texts(6, seed=2, max_words=30)]
    root = str(tmp_path / "c")
    cachegen.write_synthetic_cache(root, [docs[:3], docs[3:]], tokenizer=tok.identity())
    data = collect_mod.collect(root, ReadOptions(seq_len=32, batch_size=2, ideal_readers=1), 1, rows=2)
    flat = [t for d in docs for t in d]
    row0 = data.batches[0].rows[0]
    assert [i for piece in row0.pieces for i in piece.ids] == flat[:32]
    assert "".join(piece.text for piece in row0.pieces) == "".join(tok.decode(list(piece.ids)) for piece in row0.pieces)
    assert row0.pieces[0].text.startswith(tok.decode(flat[:5]))
    assert "EOS '<|endoftext|>' (id 100257, recorded in the cache)" in data.tokenizer
    p = Page(page.render(data))
    assert row0.pieces[0].text[:20] in p.all_text


def test_a_report_of_many_chunks_reads_a_bounded_sample(tmp_path):
    n = 1500
    chunks = [[[k % 100 + 1] * (1 + k % 7)] for k in range(n)]
    root = str(tmp_path / "big")
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=[500, 500, 500], row_group_tokens=8)
    reads = []

    def counting(cache, c):  # the real reader of a chunk's num_tokens column, counted
        reads.append(c)
        return chunk_doc_lengths(cache, c)

    data = collect_mod.collect(root, ReadOptions(seq_len=8, batch_size=4, ideal_readers=2, shuffle_seed=0), 50,
                               read=counting)
    assert len(reads) == len(set(reads)) == 64 and reads != list(range(64))  # spread over the cache
    # the sample, and the chunks behind the 8 rows shown: a row of 8 tokens spans at most 9 chunks here
    assert 64 < data.chunks_read <= 64 + 8 * 9 < n // 10
    assert data.lengths.total == 64 and data.length_note.startswith("64 documents, from 64 of 1,500 chunks")
    # the per-chunk and per-shard figures cover every chunk, from the ledger
    assert data.chunk_tokens.total == n
    assert [t for _, t in data.shard_tokens] == [sum(1 + k % 7 for k in range(n) if k % 3 == s) for s in range(3)]
    assert data.locality is not None and data.locality.steps.max() == 50


def test_a_running_build_shows_what_exists(tmp_path):
    rng = np.random.default_rng(3)
    chunks = cachegen.random_chunks(rng, 8, empty_prob=0)
    root = str(tmp_path / "live")
    cachegen.write_synthetic_cache(root, chunks, finished=False, chunks_per_shard=[4, 4], written=[0, 1, 2, 5])
    p = report(root, tmp_path / "r1", "--seq_len", "8", "--batch_size", "2", "--steps", "500", "--ideal_readers", "1")
    text = p.all_text
    assert "BUILD UNFINISHED" in text and "no builder holds the lock" in text
    assert "written 4 of 8 chunks (3 readable in global order)" in text
    assert "Batch 500" in text and "not readable yet" in text  # batch 500 needs chunks not written yet
    assert p.by_id["chunks"] == "3"  # the readable prefix
    with open(os.path.join(root, fmt.LOCK_NAME), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    p = report(root, tmp_path / "r2", "--seq_len", "8", "--batch_size", "2", "--steps", "1", "--ideal_readers", "1")
    assert "BUILD RUNNING" in p.all_text and "ETA" in p.all_text


def test_the_page_of_a_mixture(tmp_path):
    paths, _ = mixgen.write_components(str(tmp_path), [5, 8])
    mix = mixgen.write_mixture(str(tmp_path / "mix.json"), [("web", paths[0], 0.75), ("code", paths[1], 0.25)],
                               schedule=[(20, {"web": 0.25, "code": 0.75})])
    p = report(mix, tmp_path / "rep", "--seq_len", "8", "--batch_size", "8", "--ideal_readers", "2", "--steps", "40",
               "--shuffle_seed", "2", "--rows", "8")
    assert_self_contained(p)
    assert [alt for _, alt in p.images] == ["document lengths", "mixture proportions", "shuffle locality"]
    text = p.all_text
    assert "Components" in text and "weight from batch 20" in text
    assert "from 13 of 13 chunks" in text  # both components' chunks sampled (5 + 8: under --max_chunks)
    comps = re.findall(r"row \d+ \(example [\d,]+, epoch \d+, component (\w+)\)", text)
    assert len(comps) == 16 and set(comps) == {"web", "code"}  # 8 rows of batches 0 and 40
    info = json.loads(json.dumps(collect_mod.collect(mix, ReadOptions(seq_len=8, batch_size=8, ideal_readers=2), 40)
                                 .summary))
    drawn = {c["name"]: c["examples_drawn"] for c in info["components"]}
    assert f"{drawn['web']:,}" in text and sum(drawn.values()) == 40 * 8


def test_bad_records_by_reason_with_escaped_examples(tmp_path):
    lines = [{"text": t} for t in sample_texts(30, seed=4)]
    lines[3:3] = [b"<script>alert(1)</script>", b"x" * 600, b"", b'{"text": ""}']
    out, res = build(tmp_path, [write_shard(str(tmp_path / "in" / "a.jsonl"), lines)], chunk_bytes=4000,
                     max_bad_fraction=1.0)
    assert res["ledger"]["bad_records"] == {"invalid_json": 2, "blank_line": 1, "empty_text": 1}
    assert main(["report", out, "--out", str(tmp_path / "rep"), "--seq_len", "64", "--batch_size", "2"]) == 0
    text = open(tmp_path / "rep" / "index.html", encoding="utf-8").read()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "x" * 200 + "… (600 characters)" in text and "x" * 201 not in text
    p = Page(text)
    table = p.all_text.split("Bad records", 1)[1]
    assert table.index("invalid_json") < table.index("blank_line")  # most frequent first
    assert "50.0%" in table and "25.0%" in table
    assert p.by_id["documents"] == f"{res['ledger']['totals']['docs']:,}"


def test_kept_field_values_are_drawn_when_given(synthetic, tmp_path):
    root, _ = synthetic
    data = collect_mod.collect(root, ReadOptions(seq_len=8, batch_size=2), 0)
    assert data.field_tokens == {}  # the cache keeps no field
    with_fields = dataclasses.replace(data, field_tokens={"source": [("web", 900), ("books", 100)]})
    p = Page(page.render(with_fields))
    assert ("tokens per source" in [alt for _, alt in p.images]) and "kept field 'source'" in p.all_text
    # a field with a value per document: a line in the summary, no chart
    note = "20,000 distinct values in the sampled chunks; ... (no chart)"
    p = Page(page.render(dataclasses.replace(with_fields, field_notes={"url": note})))
    assert p.by_id["kept-field-url"] == note and "tokens per url" not in [alt for _, alt in p.images]


def test_masked_text_stays_readable_and_the_legend_explains_every_mark(synthetic):
    root, _ = synthetic
    text = page.render(collect_mod.collect(root, ReadOptions(seq_len=8, batch_size=2), 0))
    assert ".masked { color: #6b7280; font-style: italic; }" in text and "line-through" not in text
    legend = Page(text).all_text.split("Batches", 1)[1]
    assert ("| a document start; … first in a row: the row begins inside a document that started before it; "
            "grey italics: masked out of the loss; ··· padding.") in legend


def test_a_wrong_tokenizer_is_a_one_line_error(synthetic, tmp_path, capsys):
    root, _ = synthetic
    assert main(["report", root, "--out", str(tmp_path / "r"), "--tokenizer", "cl100k_base"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Did you mean tiktoken:cl100k_base?" in err[0]
    assert not os.path.exists(tmp_path / "r" / "index.html")


def test_the_summary_is_inspects(synthetic, capsys):
    root, _ = synthetic
    assert main(["inspect", root, "--json", "--max_chunks", "64", "--seq_len", "8", "--batch_size", "2",
                 "--steps", "0"]) == 0
    info = json.loads(capsys.readouterr().out)
    data = collect_mod.collect(root, ReadOptions(seq_len=8, batch_size=2), 0)
    assert data.summary == info
    assert Cache(root).complete and "progress" not in info


@pytest.fixture
def with_bad_records(tmp_path):
    lines = [{"text": t, "source": "web"} for t in sample_texts(30, seed=4)]
    lines[3:3] = [b"not json", b'{"text": ""}']
    out, _ = build(tmp_path, [write_shard(str(tmp_path / "in" / "a.jsonl"), lines)], chunk_bytes=4000,
                   max_bad_fraction=1.0)
    return out


def _dead_letter_file(out: str) -> tuple[str, dict]:
    entry = next(c for c in load_ledger(out)["chunks"] if c.get("dead_letters"))
    return os.path.join(out, entry["dead_letters"]), entry


def _forge(out: str, lines: list[bytes]) -> str:
    """Replace the first dead-letter file with ``lines`` and make every checksum agree (its sidecar's
    dead_letters_checksum, the ledger's sidecar_checksum): a tampered cache only content can tell."""
    from reader.format.sidecar import sidecar_bytes

    path, entry = _dead_letter_file(out)
    data = b"".join(line + b"\n" for line in lines)
    open(path, "wb").write(data)
    side_path = os.path.join(out, fmt.sidecar_path(entry["shard"], entry["index_in_shard"]))
    side = json.load(open(side_path))
    side["dead_letters_checksum"] = fmt.checksum(data)
    open(side_path, "wb").write(sidecar_bytes(side))
    refinish(out)
    return path


def _report_fails(capsys, out, tmp_path, said: str) -> None:
    assert main(["report", out, "--out", str(tmp_path / "rep"), "--seq_len", "64", "--batch_size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "rep" / "index.html")


def test_dead_letters_are_verified_before_they_are_shown_and_every_value_escaped(with_bad_records, tmp_path, capsys):
    """A dead letter's ``offset`` went into the page unescaped, so a tampered dead-letter file put markup in
    it; ``validate`` never checked ``dead_letters_checksum`` (it passed an emptied file). Now the file must
    match its sidecar before the page shows it, ``validate`` names one that does not, and every value of a
    dead letter is escaped (a forged file whose checksums were all made again)."""
    out = with_bad_records
    path, _ = _dead_letter_file(out)
    good = open(path, "rb").read()
    letters = [json.loads(line) for line in good.splitlines()]
    letters[0]["offset"] = "<img src=x onerror=alert(1)>"
    tampered = b"".join(json.dumps(d).encode() + b"\n" for d in letters)
    for data, said in ((tampered, "dead-letter file changed: its sha256 is"),
                       (b"", "dead-letter file changed: its sha256 is")):
        open(path, "wb").write(data)
        _report_fails(capsys, out, tmp_path, f"{path}: {said}")
        assert main(["validate", out]) == 1
        assert f"PROBLEM {path}: {said}" in capsys.readouterr().out
    _forge(out, [json.dumps(d).encode() for d in letters])
    assert main(["report", out, "--out", str(tmp_path / "rep"), "--seq_len", "64", "--batch_size", "2"]) == 0
    text = open(tmp_path / "rep" / "index.html", encoding="utf-8").read()
    assert "<img src=x" not in text and "&lt;img src=x onerror=alert(1)&gt;" in text


def test_a_dead_letter_line_nested_too_deep_or_not_an_object_is_one_line_naming_the_file(with_bad_records, tmp_path,
                                                                                          capsys):
    """Forged lines (every checksum made again): 200k deep gave a RecursionError traceback, a line that is
    not an object a TypeError. Each is one line naming the file and the line."""
    out = with_bad_records
    path, _ = _dead_letter_file(out)
    first = open(path, "rb").read().splitlines()[0]
    for bad, said in ((b"[" * 200_000 + b"]" * 200_000, "line 2 is not a dead letter (nested too deep)"),
                      (b'"a string"', "line 2 is not a dead letter (not a JSON object)")):
        _forge(out, [first, bad])
        _report_fails(capsys, out, tmp_path, f"{path}: {said}")


def test_kept_field_values_are_drawn_as_text_never_as_mathtext(synthetic):
    """A kept field's value ``$\\undefinedcmd$`` made ``report`` fail with matplotlib's four-line
    ParseFatalException naming nothing, and ``$x^2$`` was drawn as math."""
    root, _ = synthetic
    data = collect_mod.collect(root, ReadOptions(seq_len=8, batch_size=2), 0)
    values = [("$\\undefinedcmd$", 900), ("$x^2$", 100), ("50$ and 20$", 5)]
    p = Page(page.render(dataclasses.replace(data, field_tokens={"source": values})))
    assert "tokens per source" in [alt for _, alt in p.images]
