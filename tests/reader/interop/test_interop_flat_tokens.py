"""`python -m reader export --format flat-tokens` and `import-flat-tokens` (`--tokenizer_from`, and
`python -m pipelines.interop import-flat-tokens --tokenizer SPEC`), checked against the flat-tokens invariants by
an independent checker (tests/support/interop_ref.py) and by round trips."""

import json
import os

import numpy as np
import zarr

import interop_ref as ref
from pipelines import interop
from reader.cli.main import main

import cachegen


def _export(src, out, *extra):
    assert main(["export", str(src), "--format", "flat-tokens", "--out", str(out), *extra]) == 0
    return zarr.open_group(str(out), mode="r")


def test_seed_example(tmp_path):
    docs = ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2], [3, 4, 5]], [[6, 7, 8]]], vocab_size=100)
    root = _export(tmp_path / "c", tmp_path / "d.zarr")
    assert root["train"]["encoded_tokens"][:].tolist() == [3, 4, 7, 8, 10, 13, 14, 16]
    assert root["train"]["seq_starts"][:].tolist() == [0, 2, 5, 8]
    assert root["train"].attrs["max_token_id"] == 8
    ref.check_flat_tokens_array(root["train"], docs)
    assert root["validation"]["encoded_tokens"].shape == (0,)  # a plain cache: validation empty
    assert ref.check_flat_tokens_array(root["validation"]) == []


def test_layout_codecs_and_chunking_match_seqax(tmp_path):
    chunks = cachegen.random_chunks(np.random.default_rng(7), 10, vocab=5000, empty_prob=0.2)
    docs = ref.synthetic_cache(str(tmp_path / "c"), chunks, vocab_size=5000, chunks_per_shard=[6, 4])
    root = _export(tmp_path / "c", tmp_path / "d.zarr", "--tokens_chunk_size", "37", "--seq_starts_chunk_size", "5")
    ref.check_flat_tokens_array(root["train"], docs)
    meta = {k: json.loads((tmp_path / "d.zarr" / "train" / k / ".zarray").read_text())
            for k in ("encoded_tokens", "seq_starts")}
    assert meta["encoded_tokens"]["dtype"] == "<u4" and meta["encoded_tokens"]["chunks"] == [37]
    assert meta["seq_starts"]["dtype"] == "<u8" and meta["seq_starts"]["chunks"] == [5]
    assert meta["seq_starts"]["filters"][0]["id"] == "delta"
    for m in meta.values():
        assert m["zarr_format"] == 2
        assert (m["compressor"]["id"], m["compressor"]["cname"], m["compressor"]["shuffle"]) == ("blosc", "lz4", 2)
    # defaults are seqax's chunk sizes
    root = _export(tmp_path / "c", tmp_path / "e.zarr")
    assert root["train"]["encoded_tokens"].chunks == (1 << 22,) and root["train"]["seq_starts"].chunks == (1 << 20,)


def test_appended_eos_is_left_out_unless_kept(tmp_path):
    chunks = [[[5, 6, 0], [7, 0]], [[9, 9, 9, 0]]]
    ref.synthetic_cache(str(tmp_path / "c"), chunks, vocab_size=50, append_eos=True, eos_id=0)
    root = _export(tmp_path / "c", tmp_path / "d.zarr")
    assert ref.check_flat_tokens_array(root["train"]) == [[5, 6], [7], [9, 9, 9]]
    root = _export(tmp_path / "c", tmp_path / "k.zarr", "--keep_eos")
    assert ref.check_flat_tokens_array(root["train"]) == [[5, 6, 0], [7, 0], [9, 9, 9, 0]]


def test_train_and_validation_subcaches(tmp_path):
    train = ref.synthetic_cache(str(tmp_path / "ds/train"), [[[1, 2, 3]], [[4]]], vocab_size=100)
    val = ref.synthetic_cache(str(tmp_path / "ds/validation"), [[[9, 8]]], vocab_size=100)
    root = _export(tmp_path / "ds", tmp_path / "d.zarr")
    ref.check_flat_tokens_array(root["train"], train)
    ref.check_flat_tokens_array(root["validation"], val)
    # ... and back: a non-empty validation group gives CACHE/train and CACHE/validation
    assert main(["import-flat-tokens", str(tmp_path / "d.zarr"), "--tokenizer_from", str(tmp_path / "ds/train"),
                 "--out", str(tmp_path / "back")]) == 0  # the tokenizer the exported caches record
    assert ref.cache_documents(str(tmp_path / "back/train")) == train
    assert ref.cache_documents(str(tmp_path / "back/validation")) == val
    assert main(["validate", str(tmp_path / "back/validation")]) == 0


def test_round_trips(tmp_path):
    from build_helpers import tree_bytes

    chunks = cachegen.random_chunks(np.random.default_rng(8), 12, vocab=3000, empty_prob=0.2)
    chunks = [[list(map(int, d)) + [0] for d in c] for c in chunks]  # built with --append_eos, EOS id 0
    docs = ref.synthetic_cache(str(tmp_path / "c"), chunks, vocab_size=100277, append_eos=True, eos_id=0)
    _export(tmp_path / "c", tmp_path / "a.zarr")
    # flat-tokens -> cache (EOS appended again, as the builder does) -> flat-tokens: same files
    assert interop.main(["import-flat-tokens", str(tmp_path / "a.zarr"), "--tokenizer", "tiktoken:cl100k_base",
                         "--append_eos", "--out", str(tmp_path / "imp"), "--chunk_tokens", "60",
                         "--row_group_tokens", "20"]) == 0
    assert main(["validate", str(tmp_path / "imp")]) == 0
    led = json.loads((tmp_path / "imp" / "ledger.json").read_text())
    assert led["totals"]["chunks"] > 3 and led["config"]["append_eos"] is True
    assert [d[:-1] + [100257] for d in docs] == ref.cache_documents(str(tmp_path / "imp"))  # cl100k's EOS
    _export(tmp_path / "imp", tmp_path / "b.zarr")
    a, b = tree_bytes(str(tmp_path / "a.zarr")), tree_bytes(str(tmp_path / "b.zarr"))
    a.pop(".zattrs"), b.pop(".zattrs")  # the root's attributes name the tokenizer (synthetic vs cl100k)
    assert a == b


def test_output_exists_and_overwrite(tmp_path):
    ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2]]], vocab_size=10)
    _export(tmp_path / "c", tmp_path / "d.zarr")
    assert main(["export", str(tmp_path / "c"), "--format", "flat-tokens", "--out", str(tmp_path / "d.zarr")]) == 2
    ref.synthetic_cache(str(tmp_path / "c2"), [[[3, 4, 5]]], vocab_size=10)
    root = _export(tmp_path / "c2", tmp_path / "d.zarr", "--overwrite")
    assert ref.check_flat_tokens_array(root["train"]) == [[3, 4, 5]]
    assert sorted(os.listdir(tmp_path)) == ["c", "c2", "d.zarr"]  # no temporary directories left


def test_missing_zarr_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    ref.synthetic_cache(str(tmp_path / "c"), [[[1]]], vocab_size=10)
    monkeypatch.setitem(sys.modules, "zarr", None)
    assert main(["export", str(tmp_path / "c"), "--format", "flat-tokens", "--out", str(tmp_path / "d.zarr")]) == 2
    assert "--format flat-tokens needs zarr: pip install 'chunkledger[export]'" in capsys.readouterr().err
    assert not (tmp_path / "d.zarr").exists()
    assert main(["import-flat-tokens", str(tmp_path / "x.zarr"), "--tokenizer_from", str(tmp_path / "c"), "--out",
                 str(tmp_path / "imp")]) == 2
    assert "import-flat-tokens needs zarr: pip install 'chunkledger[export]'" in capsys.readouterr().err
    assert not (tmp_path / "imp").exists()
