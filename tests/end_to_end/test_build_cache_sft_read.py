"""Supervised caches from the builder, read: a prompt/completion cache and a chat cache built by
``--record_format``, read by the Reader in every kind of read and both layouts, give every target token
the flag its document's ``loss_spans`` give it; best-fit and unpacked reads keep a record of at most
``seq_len`` tokens whole; ``validate`` passes them, ``inspect`` tells the loss share, ``export`` refuses.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from build_helpers import build, load_ledger, write_shard
from columnar_files import write_parquet
from passcheck import mixture_problems, pass_problems
from reader import ReadOptions, Reader, expand_flat
from reader.batch.schema import TOKEN_FIELDS
from reader.cli.main import main as cli
from reader.storage.cache import Cache
from sftgen import conversations

TEMPLATE = ("{% for m in messages %}<|fim_prefix|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
            "\n{% endfor %}")
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
KINDS = {"concat": dict(), "best_fit": dict(packing="best_fit"), "unpacked": dict(packed=False)}


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """``{name: root}``: a prompt/completion cache from JSON Lines (with a kept field, the column after
    ``loss_spans``) and a chat cache from Parquet, each of a few chunks and row groups."""
    work = tmp_path_factory.mktemp("sft_read")
    rng = random.Random(7)
    convs = conversations(200, 11)
    lines = [json.dumps({"prompt": m[0]["content"] if rng.random() < 0.8 else "", "completion": m[-1]["content"],
                         "id": i}, ensure_ascii=False).encode() for i, m in enumerate(convs) if m[-1]["content"]]
    pc, _ = build(work, [write_shard(str(work / "in" / "pc.jsonl"), lines)], name="pc", keep_fields="id",
                  record_format="prompt_completion", append_eos=True, chunk_bytes=3000, row_group_tokens=300)
    template = work / "chat.jinja"
    template.write_text(TEMPLATE)
    msgs = [[{"role": x["role"], "content": x["content"]} for x in m] for m in convs
            if any(x["role"] == "assistant" and x["content"] for x in m)]
    path = write_parquet(work / "chat.parquet", pa.table({"messages": pa.array(msgs, pa.list_(MESSAGE))}),
                         row_group_size=12)
    chat, _ = build(work, [path], name="chat", record_format="chat", chat_template=str(template),
                    chunk_bytes=3000, row_group_tokens=400)
    return {"prompt_completion": pc, "chat": chat}


def documents(root: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document in global order as (tokens, per-token loss flags), from the chunk files."""
    out = []
    for c in load_ledger(root)["chunks"]:
        for row in pq.read_table(f"{root}/{c['path']}", columns=["token_ids", "loss_spans"]).to_pylist():
            flags = np.zeros(len(row["token_ids"]), bool)
            for s, e in zip(row["loss_spans"][0::2], row["loss_spans"][1::2]):
                flags[s:e] = True
            out.append((np.asarray(row["token_ids"]), flags))
    return out


def check_mask(batch, docs) -> None:
    """Each row piece's ``loss_mask`` is the loss flags of its document at the piece's positions: of the
    document whose tokens there are the piece's targets (of one of them, for a piece of a few tokens that
    several documents hold at the same positions)."""
    mask = batch["loss_mask"]
    assert not mask[batch["segment_ids"] == 0].any()  # padding
    for r in range(mask.shape[0]):
        seg, pos, tgt = batch["segment_ids"][r], batch["positions"][r], batch["targets"][r]
        for s in np.unique(seg[seg > 0]):
            at = np.flatnonzero(seg == s)
            p0, n = int(pos[at[0]]), at.size
            flags = {tuple(f[p0:p0 + n]) for t, f in docs if t.size >= p0 + n and np.array_equal(t[p0:p0 + n], tgt[at])}
            assert tuple(mask[r, at]) in flags, (r, s)


def test_an_eval_pass_s_mask_is_the_documents_flags_in_order(caches):
    """Concatenated windows in global order: the mask is every document's flags, concatenated."""
    for root in caches.values():
        docs = documents(root)
        flags = np.concatenate([f for _, f in docs])
        with Reader(root, ReadOptions(seq_len=128, batch_size=2, ideal_readers=1, eval_mode=True)) as rd:
            got = np.concatenate([b["loss_mask"][b["valid"]].reshape(-1) for _, b in rd.iter_batches()])
        assert np.array_equal(got[:flags.size], flags) and not got[flags.size:].any()


@pytest.mark.parametrize("name", ["prompt_completion", "chat"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_built_supervised_cache_reads_with_its_loss_spans(caches, name, kind):
    root = caches[name]
    docs = documents(root)
    longest = max(t.size for t, _ in docs)
    seq_len = 256 if kind == "concat" else longest  # best-fit and unpacked: every record fits a row
    opts = ReadOptions(seq_len=seq_len, batch_size=4, ideal_readers=2, shuffle_seed=3, **KINDS[kind])
    flat_opts = dataclasses.replace(opts, layout="flat") if kind != "unpacked" else opts  # (flat: packed only)
    with Reader(root, opts) as arrays, Reader(root, flat_opts) as flat:
        assert arrays.masked and flat.masked
        whole = 0
        for b in range(6):
            a = arrays.batch(b)
            assert a["loss_mask"].any() and not a["loss_mask"].all()
            check_mask(a, docs)
            if kind != "concat":  # a record of at most seq_len tokens is never cut: each piece starts it
                starts = np.diff(a["segment_ids"], axis=1, prepend=0) != 0
                assert not a["positions"][starts & (a["segment_ids"] > 0)].any()
                whole += int(starts.sum())
            if kind != "unpacked":
                f = flat.batch(b)
                assert f["loss_mask"].shape == f["tokens"][:, 1:].shape and f["loss_mask"].dtype == bool
                e = expand_flat(f)
                for k in TOKEN_FIELDS:
                    assert np.array_equal(e[k], a[k]), k
        assert kind == "concat" or whole >= 24


@pytest.mark.parametrize("name", ["prompt_completion", "chat"])
def test_validate_inspect_and_export_on_a_built_supervised_cache(caches, name, tmp_path, capsys):
    root = caches[name]
    assert cli(["validate", root]) == 0
    capsys.readouterr()
    if name == "prompt_completion":  # the kept field beside the spans: every record's id, in input order
        n = len(documents(root))
        ids = Cache(root).fields(0, n)["id"]
        assert len(set(ids)) == n and ids == sorted(ids, key=int)
    assert cli(["inspect", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    docs = documents(root)
    loss = sum(int(f.sum()) for _, f in docs)
    assert info["loss_tokens"] == load_ledger(root)["totals"]["loss_tokens"] == loss
    assert 0 < info["loss_token_share"] < 1
    assert cli(["export", root, "--format", "megatron", "--out", str(tmp_path / "out")]) == 2
    assert "a cache with loss masks" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["prompt_completion", "chat"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("r_star", [1, 4, 16, 64])
def test_every_pass_of_a_built_supervised_cache_covers_it_once(caches, name, kind, r_star):
    """The builds' caches are format version 4: a training read's first pass is its eval pass's rows, loss
    masks included, shuffled or not (tests/support/passcheck.py)."""
    for shuffle_seed in (None, 3):
        opts = ReadOptions(seq_len=64, batch_size=8, ideal_readers=r_star, shuffle_seed=shuffle_seed, **KINDS[kind])
        assert pass_problems(caches[name], opts) == [], (shuffle_seed,)


def test_a_1mb_chat_file_builds_reads_and_mixes_with_the_defaults(caches, tmp_path):
    """A 1 MB chat file with every default: one chunk (64 MiB chunks), read with ReadOptions() (R* = 16,
    batch 64, seq_len 2048: a pass of fewer rows than streams once repeated most of them), unpacked and
    shuffled as a fine-tuning run reads it, and mixed with another chat cache: no row twice within a pass."""
    rng = random.Random(5)
    lines, size = [], 0
    while size < 1 << 20:
        msgs = conversations(1, rng.randrange(1 << 30))[0]
        if any(m["role"] == "assistant" and m["content"] for m in msgs):
            lines.append(json.dumps({"messages": msgs}, ensure_ascii=False).encode())
            size += len(lines[-1]) + 1
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    root, _ = build(tmp_path, [write_shard(str(tmp_path / "in" / "chat.jsonl"), lines)], name="mb",
                    record_format="chat", chat_template=str(template))
    ledger = load_ledger(root)
    assert ledger["format_version"] == 4 and len(ledger["chunks"]) == 1
    for opts in (ReadOptions(), ReadOptions(packed=False), ReadOptions(packed=False, shuffle_seed=0)):
        assert pass_problems(root, opts) == [], opts
    with Reader(root, ReadOptions(packed=False)) as r:
        assert r.examples_per_pass == len(lines)  # every conversation, once a pass
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"mixture": 1, "components": [{"name": "mb", "path": root, "weight": 3},
                                                            {"name": "chat", "path": caches["chat"], "weight": 1}]}))
    for opts in (ReadOptions(packed=False), ReadOptions(packed=False, shuffle_seed=0)):
        assert mixture_problems(str(mix), opts) == [], opts
