"""`python -m pipelines.export --format megatron`: the Beam export writes the very bytes of
`python -m reader export --format megatron` (FnApiRunner and a 2-process DirectRunner), resumes after a
SIGKILL at any step to the same bytes with nothing temporary left, and turns bad input into a clear error
naming the file with no output left looking complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import cachegen
import interop_ref as ref
from build_helpers import DIRECT_MP2, FNAPI, SAMPLE_DIR, load_ledger
from pipelines import build_cache
from pipelines.export import job as export
from pipelines.export.layout import make_plan, plan_parts
from reader.format import spec as fmt
from reader.cli.main import main as reader_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
pytestmark = pytest.mark.timeout(300)


def _chunks(seed=7, n=24, vocab=1000):
    return cachegen.random_chunks(np.random.default_rng(seed), n, vocab=vocab, empty_prob=0.25)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A multi-shard cache (uneven shards, empty chunks) and the CLI's export of it: ``(cache, files)``."""
    d = tmp_path_factory.mktemp("export_src")
    root = str(d / "cache")
    ref.synthetic_cache(root, _chunks(), vocab_size=1000, chunks_per_shard=[10, 8, 6])
    assert reader_main(["export", root, "--format", "megatron", "--out", str(d / "cli" / "m")]) == 0
    return root, _files(str(d / "cli"))


def _files(directory: str) -> dict[str, bytes | None]:
    """Every file under ``directory`` (hidden ones too) by relative path, and every sub-directory (``None``)."""
    out: dict[str, bytes | None] = {}
    for base, dirs, names in os.walk(directory):
        out.update({os.path.relpath(os.path.join(base, d), directory) + "/": None for d in dirs})
        for n in names:
            p = os.path.join(base, n)
            out[os.path.relpath(p, directory)] = open(p, "rb").read()
    return out


def _export(cache_root, out, *extra, runner=FNAPI):
    return export.run([cache_root, "--format", "megatron", "--out", out, "--part_bytes", "120", *extra, *runner])


# --------------------------------------------------------------------------------------------------
# The plan (pure)


def test_parts_cover_every_document_once_at_the_ledgers_offsets():
    rng = np.random.default_rng(0)
    docs = rng.integers(0, 5, 200)
    tokens = np.where(docs > 0, docs * rng.integers(1, 50, 200), 0)
    for itemsize, part_bytes in ((2, 1), (2, 300), (4, 1000), (4, 1 << 40)):
        parts = plan_parts(docs, tokens, itemsize, part_bytes)
        assert all(p.docs > 0 for p in parts) and [p.index for p in parts] == list(range(len(parts)))
        covered = [c for p in parts for c in p.chunks]
        assert covered == sorted(covered) and set(np.flatnonzero(docs)) <= set(covered)
        for p in parts:
            assert p.doc_offset == docs[:p.chunk_lo].sum() and p.docs == docs[p.chunks].sum()
            assert p.byte_offset == tokens[:p.chunk_lo].sum() * itemsize
            assert p.nbytes == tokens[p.chunks].sum() * itemsize
            # a part starts a new slice of part_bytes: it holds at most that plus its last chunk
            assert p.nbytes <= part_bytes + tokens[p.chunks].max() * itemsize
        ends = [p.byte_offset + p.nbytes for p in parts]
        assert ends == [q.byte_offset for q in parts[1:]] + [tokens.sum() * itemsize]
    assert len(plan_parts(docs, tokens, 2, 1 << 40)) == 1
    assert plan_parts(np.zeros(3, int), np.zeros(3, int), 2, 10) == () == plan_parts([], [], 2, 10)


def test_the_fingerprint_names_the_chunks_the_dtype_and_the_part_size():
    docs, tokens = np.array([1, 2]), np.array([5, 7])
    base = make_plan("c", ["sha256:a", "sha256:b"], docs, tokens, "uint16", 1000, 64)
    assert base.bin_bytes == 24 and base.idx_bytes == 34 + 12 * 3 + 8 * 4
    for other in (make_plan("c", ["sha256:a", "sha256:c"], docs, tokens, "uint16", 1000, 64),
                  make_plan("c", ["sha256:a", "sha256:b"], docs, tokens, "int32", 1000, 64),
                  make_plan("c", ["sha256:a", "sha256:b"], docs, tokens, "uint16", 1000, 65)):
        assert other.fingerprint != base.fingerprint
    assert make_plan("elsewhere", ["sha256:a", "sha256:b"], docs, tokens, "uint16", 1000, 64).fingerprint == \
        base.fingerprint


# --------------------------------------------------------------------------------------------------
# Same bytes as the CLI


@pytest.mark.slow
@pytest.mark.parametrize("runner", [FNAPI, DIRECT_MP2], ids=["fnapi", "direct_mp2"])
def test_byte_identical_to_the_cli(cache, tmp_path, runner):
    root, want = cache
    got = _export(root, str(tmp_path / "out" / "m"), runner=runner)
    assert got["state"] == "fresh" and len(got["plan"].parts) >= 8  # really split into many parts
    assert _files(str(tmp_path / "out")) == want  # m.bin, m.idx: same bytes, nothing else left
    assert got["counters"].get("parts_written") == len(got["plan"].parts)


@pytest.mark.slow
def test_int32_and_a_forced_dtype_match_the_cli(tmp_path):
    root = str(tmp_path / "c")
    ref.synthetic_cache(root, _chunks(seed=3, n=10, vocab=70000), vocab_size=70000, chunks_per_shard=[6, 4])
    for extra, name in (([], "auto"), (["--dtype", "int32"], "forced")):
        assert reader_main(["export", root, "--format", "megatron", "--out", str(tmp_path / "cli" / name / "m"),
                            *extra]) == 0
        got = _export(root, str(tmp_path / "beam" / name / "m"), *extra)
        assert got["plan"].dtype == "int32"
        assert _files(str(tmp_path / "beam" / name)) == _files(str(tmp_path / "cli" / name))


# --------------------------------------------------------------------------------------------------
# Killed, then rerun

KILLER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
kind, n, stage = sys.argv[2], int(sys.argv[3]), sys.argv[4]
real, seen = os.replace, [0]

def replace(src, dst, *a, **k):
    # every atomic write of the export ends in this rename (local files); count the ones of `kind`
    hit = (kind == "part" and "/part-" in os.fspath(dst)) or os.fspath(dst).endswith("/" + kind)
    if hit:
        seen[0] += 1
    if hit and seen[0] == n and stage == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst, *a, **k)
    if hit and seen[0] == n and stage == "after":
        os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
from pipelines.export.job import main
main(sys.argv[5:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind,n,stage", [("part", 13, "after"), ("m.bin", 1, "before"), ("m.bin", 1, "after"),
                                          ("m.idx", 1, "after")])
def test_killed_export_reruns_to_the_same_bytes(cache, tmp_path, kind, n, stage):
    root, want = cache
    out = tmp_path / "out"
    argv = [root, "--format", "megatron", "--out", str(out / "m"), "--part_bytes", "120", *FNAPI]
    proc = subprocess.run([sys.executable, "-c", KILLER, REPO, kind, str(n), stage, *argv], cwd=REPO,
                          capture_output=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    left = _files(str(out))
    parts = [k for k in left if k.startswith(".tmp-m.parts/part-") and k.endswith(".json")]
    assert parts, "the killed run left no parts to resume from"
    if "m.idx" in left:  # an .idx with its final name only ever describes a complete .bin
        assert left["m.idx"] == want["m.idx"] and left["m.bin"] == want["m.bin"]
    damaged = []
    if kind == "part":  # a kept part must match its record: flip a byte of one, cut another short
        assert len(parts) >= 2
        for k, cut in zip(sorted(parts)[:2], (False, True)):
            p = str(out / k.replace(".json", ".bin"))
            data = open(p, "rb").read()
            with open(p, "wb") as f:
                f.write(data[:-2] if cut else bytes([data[0] ^ 1]) + data[1:])
            damaged.append(k)
    got = export.run(argv)
    assert _files(str(out)) == want
    if kind == "m.idx":
        assert got["state"] == "complete"
    else:
        assert got["state"] == "resume" and got["counters"].get("parts_kept", 0) == len(parts) - len(damaged) > 0


# --------------------------------------------------------------------------------------------------
# Bad input


def _main(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        export.main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_an_unfinished_cache_is_refused_before_anything_is_written(tmp_path, capsys):
    root = str(tmp_path / "c")
    cachegen.write_synthetic_cache(root, _chunks(n=4), finished=False, written=[0, 1])
    code, err = _main(capsys, root, "--format", "megatron", "--out", str(tmp_path / "out" / "m"), *FNAPI)
    assert code == 2 and f"{root}/{fmt.LEDGER_NAME}: the build has not finished" in err
    assert _files(str(tmp_path / "out")) == {}


@pytest.mark.slow
def test_a_damaged_chunk_is_named_and_a_rerun_after_the_repair_resumes(cache, tmp_path, capsys):
    import shutil

    root = str(tmp_path / "c")
    shutil.copytree(cache[0], root)
    ledger = load_ledger(root)
    full = [c for c in ledger["chunks"] if c["docs"] > 0]
    victim = os.path.join(root, full[len(full) // 2]["path"])
    good = open(victim, "rb").read()
    with open(victim, "wb") as f:
        f.write(good[:10] + bytes([good[10] ^ 0xFF]) + good[11:])
    out = str(tmp_path / "out" / "m")
    # worker processes: the launcher reports the error the worker recorded, not the runner's wrapping
    code, err = _main(capsys, root, "--format", "megatron", "--out", out, "--part_bytes", "120", *DIRECT_MP2)
    assert code == 1 and f"{victim}: checksum mismatch" in err  # 1: the cache is damaged, as python -m reader
    left = _files(str(tmp_path / "out"))
    assert "m.bin" not in left and "m.idx" not in left
    assert all(k.startswith(".tmp-m.parts/") for k in left)  # only the hidden parts directory
    with open(victim, "wb") as f:
        f.write(good)  # the rebuild rewrites the chunk with the same bytes
    got = export.run([root, "--format", "megatron", "--out", out, "--part_bytes", "120", *FNAPI])
    assert _files(str(tmp_path / "out")) == cache[1]
    c = got["counters"]
    assert c["parts_written"] >= 1 and c["parts_written"] + c.get("parts_kept", 0) == len(got["plan"].parts)


@pytest.mark.parametrize("bad", [1000, -1])
def test_a_token_outside_the_vocabulary_is_named(tmp_path, capsys, bad):
    root = str(tmp_path / "c")
    ref.synthetic_cache(root, [[[1, 2]], [[3, bad]]], vocab_size=1000)
    code, err = _main(capsys, root, "--format", "megatron", "--out", str(tmp_path / "o" / "m"), *FNAPI)
    assert code == 2 and f"token id {bad} is outside the tokenizer's vocabulary [0, 1000)" in err
    assert not {"m.bin", "m.idx"} & set(_files(str(tmp_path / "o")))


def test_existing_output_options_and_formats(cache, tmp_path, capsys):
    root, want = cache
    out = str(tmp_path / "m")
    _export(root, out)
    code, err = _main(capsys, root, "--format", "megatron", "--out", out, *FNAPI)
    assert code == 2 and f"{out}.idx exists; pass --overwrite" in err
    assert _files(str(tmp_path)) == want  # the refused run left nothing (not even an empty parts directory)
    os.remove(out + ".idx")  # a lone .bin of another run is not ours to replace either
    code, err = _main(capsys, root, "--format", "megatron", "--out", out, *FNAPI)
    assert code == 2 and f"{out}.bin exists; pass --overwrite" in err
    assert _export(root, out, "--overwrite")["state"] == "fresh"
    assert _files(str(tmp_path)) == want
    code, err = _main(capsys, root, "--format", "flat-tokens", "--out", str(tmp_path / "d.zarr"), *FNAPI)
    assert code == 2 and "use python -m reader export" in err
    code, err = _main(capsys, root, "--format", "megatron", "--out", out, "--part_byte", "1", *FNAPI)
    assert code == 2 and "--part_byte" in err


@pytest.mark.slow
def test_a_split_builds_top_directory_is_refused_as_the_cli_does_and_each_split_exports(tmp_path, capsys):
    top = str(tmp_path / "ds")
    build_cache.run(["--input", os.path.join(SAMPLE_DIR, "*.jsonl"), "--output", top, "--tokenizer",
                     "tiktoken:cl100k_base", "--chunk_bytes", "20000", "--validation_fraction", "0.2", *FNAPI])
    capsys.readouterr()
    assert reader_main(["export", top, "--format", "megatron", "--out", str(tmp_path / "cli" / "m")]) == 2
    cli_err = capsys.readouterr().err
    code, err = _main(capsys, top, "--format", "megatron", "--out", str(tmp_path / "beam" / "m"), *FNAPI)
    assert code == 2
    for command, text in (("python -m reader export", cli_err), ("python -m pipelines.export", err)):
        assert f"{top}: the top of a split build" in text, text
        for split in ("train", "validation"):
            assert f"{command} {top}/{split} --format megatron --out PREFIX_{split}" in text, text
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # neither wrote anything
    for split in ("train", "validation"):  # what the message says to do works, with the CLI's bytes
        sub = f"{top}/{split}"
        assert reader_main(["export", sub, "--format", "megatron", "--out", str(tmp_path / "cli" / split)]) == 0
        _export(sub, str(tmp_path / "beam" / split))
        for ext in ("bin", "idx"):
            assert (tmp_path / "beam" / f"{split}.{ext}").read_bytes() == \
                (tmp_path / "cli" / f"{split}.{ext}").read_bytes(), (split, ext)
