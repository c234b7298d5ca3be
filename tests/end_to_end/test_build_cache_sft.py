"""Supervised builds end to end: ``--record_format prompt_completion`` and ``chat`` from every input format give,
document for document, the tokens and loss spans pipelines/tokenize/sft.py computes; bad records are set aside
by reason; a split puts a record in the same split from any format; a killed build resumes to the same bytes;
another template is refused on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from build_helpers import build, load_ledger, read_dead_letters, tree_bytes, write_shard
from columnar_files import every_format, write_parquet
from pipelines.build_cache import BuildError
from reader.format.splits import SplitSpec
from pipelines.chunking.supervised import canonical, spans_of
from pipelines.tokenize import sft
from pipelines.tokenize import sft_encoders
from pipelines.tokenize.tokenizer import resolve
from sftgen import BOS, CHATML, EOS, chat_tokenizer_json, conversations

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TT = sft_encoders.TiktokenSft(resolve("tiktoken:cl100k_base").load_reference().enc)
EOT = 100257
# cl100k's own special tokens as role markers, the EOS written by the template
TEMPLATE = ("{% for m in messages %}<|fim_prefix|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
            "\n{% endfor %}")
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
CHUNK = 3000


def documents(root: str) -> list[dict]:
    """Every document in global order, straight from the Parquet files: tokens, loss spans, shard, offset."""
    ledger = load_ledger(root)
    out = []
    for c in ledger["chunks"]:
        t = pq.read_table(os.path.join(root, c["path"]))
        assert t.schema.names[4] == "loss_spans"  # the fifth column (readers find it there)
        for row in t.to_pylist():
            out.append({"tokens": row["token_ids"], "spans": row["loss_spans"], "shard": row["shard"],
                        "offset": row["offset"]})
    return out


def chat_records(n: int, seed: int) -> list[dict]:
    """Good conversations and, in between, bad ones that every input format can hold."""
    bad = [({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role"),
           ({"messages": [{"role": "user", "content": "only a question"}]}, "no_loss_tokens"),
           ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]},
            "missing_content"),
           ({"messages": []}, "empty_messages"),
           ({"messages": None}, "messages_not_list")]
    good = [{"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
            for msgs in conversations(n, seed) if any(m["role"] == "assistant" and m["content"] for m in msgs)]
    out = list(good)
    for i, (rec, _) in enumerate(bad):
        out.insert(7 * i + 3, rec)
    return out


def expected_chat(records: list[dict], encoder=TT, template: str = TEMPLATE, **tokens) -> list:
    """sft.py's tokens and spans of each record, or its BadRecord reason."""
    out = []
    for r in records:
        try:
            ids, mask = sft.encode_chat(r, template, encoder, **(tokens or {"eos_token": "<|endoftext|>"}))
            out.append((ids.tolist(), spans_of(mask).tolist()))
        except sft.BadRecord as e:
            out.append(e.reason)
    return out


def check_documents(root: str, expected: list) -> None:
    docs = documents(root)
    good = [e for e in expected if not isinstance(e, str)]
    assert [(d["tokens"], d["spans"]) for d in docs] == good
    assert sorted(d["reason"] for d in read_dead_letters(root)) == sorted(e for e in expected if isinstance(e, str))
    ledger = load_ledger(root)
    loss = sum(sum(s[1::2]) - sum(s[0::2]) for _, s in good)
    assert ledger["totals"]["loss_tokens"] == sum(c["loss_tokens"] for c in ledger["chunks"]) == loss
    assert ledger["format_version"] == 4 and ledger["totals"]["docs"] == len(good)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


# --------------------------------------------------------------------------------------------------
# prompt / completion


def test_prompt_completion_records_are_sft_tokens_and_spans_with_their_keys(tmp_path):
    rng = random.Random(1)
    records = [{"instruction": m[0]["content"] if rng.random() < 0.8 else "",
                "output": m[-1]["content"] + " <|endoftext|>", "id": i} for i, m in enumerate(conversations(150, 3))]
    bad = [(b'{"output": "no prompt"}', "missing_prompt"), (b'{"instruction": "q"}', "missing_completion"),
           (b'{"instruction": "q", "output": ""}', "empty_completion"),
           (b'{"instruction": 1, "output": "a"}', "prompt_not_string"), (b"not json", "invalid_json")]
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in records]
    for i, (raw, _) in enumerate(bad):
        lines.insert(11 * i + 2, raw)
    path = write_shard(str(tmp_path / "in" / "pc.jsonl"), lines)
    out, res = build(tmp_path, [path], record_format="prompt_completion", prompt_key="instruction",
                     completion_key="output", append_eos=True, chunk_bytes=CHUNK, max_bad_fraction=0.5,
                     keep_fields="id")
    want = []
    for r in records:
        ids, mask = sft.encode_prompt_completion(r["instruction"], r["output"], TT, EOT)
        want.append((ids.tolist(), spans_of(mask).tolist()))
        assert spans_of(mask).tolist()[1] == len(ids)  # one span: the completion and its EOS
    check_documents(out, want + [reason for _, reason in bad])
    ledger = load_ledger(out)
    assert len(ledger["chunks"]) > 3
    assert {k: ledger["config"][k] for k in ("record_format", "prompt_key", "completion_key", "append_eos")} == {
        "record_format": "prompt_completion", "prompt_key": "instruction", "completion_key": "output",
        "append_eos": True}
    assert "messages_key" not in ledger["config"] and "chat_template" not in ledger["config"]
    letters = {d["reason"]: d for d in read_dead_letters(out)}
    assert letters["missing_prompt"]["detail"] == "no key 'instruction'"
    assert letters["prompt_not_string"]["detail"] == "'instruction' is int"
    assert [t for d in documents(out) for t in d["tokens"]].count(EOT) == len(records)  # the content's is text
    kept = [f for c in ledger["chunks"] for f in pq.read_table(os.path.join(out, c["path"])).column("fields")
            .to_pylist()]
    assert [f["id"] for f in kept] == [str(i) for i in range(len(records))]
    assert "loss tokens" in res["summary"]


# --------------------------------------------------------------------------------------------------
# chat, in every input format


@pytest.fixture(scope="module")
def chat_table():
    records = chat_records(120, seed=5)
    return records, pa.table({"messages": pa.array([r["messages"] for r in records], pa.list_(MESSAGE))})


def test_chat_records_from_every_input_format_are_sft_tokens_and_spans(chat_table, template_file, tmp_path):
    records, table = chat_table
    want = expected_chat(records)
    assert sum(isinstance(e, str) for e in want) == 5
    docs = {}
    for name, path in every_format(tmp_path / "in", table).items():
        out, _ = build(tmp_path, [path], name=name, record_format="chat", chat_template=template_file,
                       chunk_bytes=CHUNK, max_bad_fraction=0.5)
        check_documents(out, want)
        docs[name] = [(d["tokens"], d["spans"]) for d in documents(out)]
        config = load_ledger(out)["config"]
        assert config["record_format"] == "chat" and config["messages_key"] == "messages"
        assert config["chat_template"] == {"sha256": "sha256:" + hashlib.sha256(TEMPLATE.encode()).hexdigest(),
                                           "source": template_file, "bos_token": None, "eos_token": "<|endoftext|>"}
    assert len(docs) == 7 and all(d == docs["jsonl"] for d in docs.values())


def test_a_bad_record_holding_binary_values_is_set_aside_with_them(template_file, tmp_path):
    """Messages carrying a binary field (``image: binary``) and one bad role: the dead letter could not be
    written (``TypeError: Object of type bytes is not JSON serializable``, exit 1 saying a rerun resumes, and
    every rerun failed the same way). A value JSON cannot hold is kept as its type and base64 (or text)."""
    import datetime

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("image", pa.binary()),
                         ("at", pa.timestamp("s"))])
    when = datetime.datetime(2024, 5, 6, 7, 8, 9)
    good = [{"role": "user", "content": "look", "image": b"\x89PNG\x00\xff", "at": when},
            {"role": "assistant", "content": "a cat", "image": None, "at": None}]
    bad = [{"role": "robot", "content": "x", "image": b"\x00\x01\xfe", "at": when}]
    table = pa.table({"messages": pa.array([good, bad, good], pa.list_(message))})
    path = write_parquet(tmp_path / "chat.parquet", table, row_group_size=2)
    out, res = build(tmp_path, [path], record_format="chat", chat_template=template_file, max_bad_fraction=0.5)
    assert res["ledger"]["totals"]["docs"] == 2 and res["ledger"]["bad_records"] == {"unknown_role": 1}
    (letter,) = read_dead_letters(out)
    assert letter["row"] == 1 and letter["value"] == {"messages": [
        {"role": "robot", "content": "x", "image": {"type": "bytes", "base64": "AAH+"},
         "at": {"type": "datetime", "value": "2024-05-06 07:08:09"}}]}


def test_a_parquet_row_s_bad_record_keeps_its_fields_in_its_dead_letter(chat_table, template_file, tmp_path):
    records, table = chat_table
    path = write_parquet(tmp_path / "chat.parquet", table, row_group_size=30)
    out, _ = build(tmp_path, [path], record_format="chat", chat_template=template_file, max_bad_fraction=0.5)
    letters = {d["reason"]: d for d in read_dead_letters(out)}
    assert letters["unknown_role"]["value"] == {"messages": [{"role": "robot", "content": "x"}]}
    assert letters["unknown_role"]["row"] == records.index({"messages": [{"role": "robot", "content": "x"}]})
    assert letters["messages_not_list"]["value"] == {"messages": None}


@pytest.mark.slow
def test_chat_with_a_hugging_face_tokenizer_and_its_own_template(tmp_path):
    tok = chat_tokenizer_json(tmp_path)
    (tok.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": BOS,
                                                                  "eos_token": EOS}))
    records = chat_records(80, seed=6)
    path = write_shard(str(tmp_path / "in" / "chat.jsonl"), records)
    out, _ = build(tmp_path, [path], tokenizer=str(tok.parent), record_format="chat", max_bad_fraction=0.5)
    from tokenizers import Tokenizer

    encoder = sft_encoders.HFSft(Tokenizer.from_file(str(tok)), CHATML)
    check_documents(out, expected_chat(records, encoder, CHATML, bos_token=BOS, eos_token=EOS))
    assert load_ledger(out)["config"]["chat_template"] == {
        "sha256": "sha256:" + hashlib.sha256(CHATML.encode()).hexdigest(), "source": "tokenizer_config.json",
        "bos_token": BOS, "eos_token": EOS}


@pytest.mark.parametrize("extra, message", [
    ([], "a tiktoken encoding has no chat template; pass --chat_template FILE"),
    (["--chat_template", "{template}x{% if %}"], "does not compile"),
    (["--chat_template", "{template}", "--append_eos"], "--append_eos does not apply to --record_format chat"),
    (["--chat_template", "{template}", "--text_key", "body"], "--text_key applies to --record_format text"),
    (["--chat_template", "{template}", "--prompt_key", "q"], "--prompt_key applies to --record_format "
                                                             "prompt_completion, not chat"),
    (["--chat_template", "{template}", "--messages_key", "conversation"],
     r"records have no key 'conversation' \(--messages_key conversation\).*pass --messages_key messages\?"),
])
def test_chat_builds_that_cannot_be_are_refused_before_they_start(extra, message, template_file, tmp_path):
    bad_template = tmp_path / "bad.jinja"
    bad_template.write_text(TEMPLATE + "{% if %}")
    path = write_shard(str(tmp_path / "in" / "chat.jsonl"), chat_records(10, seed=7))
    extra = [bad_template.as_posix() if e == "{template}x{% if %}" else template_file if e == "{template}" else e
             for e in extra]
    argv = ["--input", path, "--output", str(tmp_path / "out"), "--tokenizer", "tiktoken:cl100k_base",
            "--record_format", "chat", *extra, "--runner=FnApiRunner"]
    from pipelines import build_cache

    with pytest.raises(BuildError, match=message):
        build_cache.run(argv)
    assert not os.path.exists(tmp_path / "out" / "ledger.json")


def test_a_messages_column_of_another_type_is_refused_naming_it(tmp_path, template_file):
    path = write_parquet(tmp_path / "t.parquet", pa.table({"messages": ["a string, not messages"]}))
    with pytest.raises(BuildError, match=r"column 'messages' is string; --messages_key must name a list of messages"):
        build(tmp_path, [path], record_format="chat", chat_template=template_file)


# --------------------------------------------------------------------------------------------------
# splits, resume, identity


def test_a_split_puts_a_record_in_the_same_split_from_json_lines_and_parquet(chat_table, template_file, tmp_path):
    records, _ = chat_table
    spec = SplitSpec(validation_fraction=0.3, seed=4)
    want = expected_chat(records)
    to_validation = [spec.is_validation(canonical(r)) for r, e in zip(records, want) if not isinstance(e, str)]
    assert 0 < sum(to_validation) < len(to_validation)
    good = [e for e in want if not isinstance(e, str)]
    splits = {}
    # JSON as a person writes it (keys in another order, no null fields); Parquet with a field that is null
    # in every row: the same records
    lines = [r if not isinstance(r["messages"], list) else
             {"messages": [{"content": m["content"], "role": m["role"]} for m in r["messages"]]} for r in records]
    with_name = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    wide = pa.table({"messages": pa.array([r["messages"] for r in records], with_name)})
    for name, path in (("jsonl", str(tmp_path / "t.jsonl")), ("parquet", str(tmp_path / "t.parquet"))):
        if name == "jsonl":
            write_shard(path, lines)
        else:
            write_parquet(path, wide, row_group_size=25)
        out, _ = build(tmp_path, [path], name=name, record_format="chat", chat_template=template_file,
                       validation_fraction=0.3, split_seed=4, chunk_bytes=CHUNK, max_bad_fraction=0.5)
        splits[name] = {s: [(d["tokens"], d["spans"]) for d in documents(os.path.join(out, s))]
                        for s in ("train", "validation")}
    assert splits["jsonl"] == splits["parquet"]
    assert splits["jsonl"]["validation"] == [g for g, v in zip(good, to_validation) if v]
    assert splits["jsonl"]["train"] == [g for g, v in zip(good, to_validation) if not v]


def run_killed(args: list[str], kill_at: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "kill_at.py"), kill_at, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_killed_supervised_build_resumes_to_the_same_bytes(template_file, tmp_path):
    records = chat_records(160, seed=8)
    inputs = [write_shard(str(tmp_path / "in" / "a.jsonl"), records[:80]),
              write_shard(str(tmp_path / "in" / "b.jsonl.gz"), records[80:])]
    options = dict(record_format="chat", chat_template=template_file, chunk_bytes=CHUNK, max_bad_fraction=0.5)
    clean, _ = build(tmp_path, [str(tmp_path / "in" / "*")], name="clean", **options)
    clean_files = tree_bytes(clean)
    total_writes = len(clean_files) + 1
    for i, point in enumerate(["2:before_rename", f"{total_writes // 2}:after_rename",
                               f"{total_writes - 2}:before_rename"]):
        out = str(tmp_path / f"k{i}")
        args = ["--input", str(tmp_path / "in" / "*"), "--output", out, "--tokenizer", "tiktoken:cl100k_base",
                "--record_format", "chat", "--chat_template", template_file, "--chunk_bytes", str(CHUNK),
                "--max_bad_fraction", "0.5", "--runner=FnApiRunner"]
        proc = run_killed(args, point)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr[-2000:])
        assert load_ledger(out)["finished"] is False
        _, res = build(tmp_path, [str(tmp_path / "in" / "*")], name=f"k{i}", **options)
        assert res["resumed"]
        assert tree_bytes(out) == clean_files, f"resume after kill at {point} differs from a clean build"
    assert len(inputs) == 2


def test_another_template_is_refused_on_resume_and_a_damaged_loss_count_is_repaired(template_file, tmp_path):
    path = write_shard(str(tmp_path / "in" / "chat.jsonl"), chat_records(40, seed=9))
    options = dict(record_format="chat", chunk_bytes=CHUNK, max_bad_fraction=0.5)
    out, _ = build(tmp_path, [path], chat_template=template_file, **options)
    files = tree_bytes(out)
    other = tmp_path / "other.jinja"
    other.write_text(TEMPLATE.replace("\n{% endfor %}", "\n\n{% endfor %}"))
    with pytest.raises(BuildError, match=r"config\.chat_template: .*sha256:.* in the cache, .*sha256:.* now"):
        build(tmp_path, [path], chat_template=str(other), **options)
    # a sidecar whose loss_tokens lies is not complete: the rerun rebuilds it, the recorded bytes again
    ledger = load_ledger(out)
    sidecar = os.path.join(out, ledger["chunks"][0]["path"].replace(".parquet", ".json"))
    with open(sidecar, encoding="utf-8") as f:
        text = f.read()
    with open(sidecar, "w", encoding="utf-8") as f:
        f.write(text.replace(f'"loss_tokens": {ledger["chunks"][0]["loss_tokens"]}',
                             f'"loss_tokens": {ledger["chunks"][0]["loss_tokens"] + 1}'))
    assert tree_bytes(out) != files
    _, res = build(tmp_path, [path], chat_template=template_file, **options)
    assert res["resumed"] and tree_bytes(out) == files
