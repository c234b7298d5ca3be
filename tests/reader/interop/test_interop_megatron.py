"""`python -m reader export --format megatron` and `import-megatron` (and `python -m pipelines.interop
import-megatron --tokenizer SPEC`): checked with an independent reader of the .idx layout
(tests/support/interop_ref.py), with Megatron-Core's own IndexedDataset / IndexedDatasetBuilder, and by round trips."""

import json
import os
import warnings

import numpy as np
import pytest

import interop_ref as ref
from build_helpers import load_ledger
from reader import ReadOptions, Reader
from reader.format import spec as fmt
from reader.interop import importer
from pipelines import interop
from pipelines.tokenize.tokenizer import resolve
from reader.cli.main import main
from reader.interop.import_megatron import import_megatron

import cachegen

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on CPU machines
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder


CL100K = resolve("tiktoken:cl100k_base").identity()


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from build_helpers import train_tiny_tokenizer

    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _chunks(seed=3, n=9, vocab=1000):
    return cachegen.random_chunks(np.random.default_rng(seed), n, vocab=vocab, empty_prob=0.25)


def test_export_matches_independent_reader(tmp_path, capsys):
    docs = ref.synthetic_cache(str(tmp_path / "c"), _chunks(), vocab_size=1000, chunks_per_shard=[4, 3, 2])
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "out/m")]) == 0
    assert "uint16" in capsys.readouterr().out
    idx, got = ref.read_megatron(str(tmp_path / "out/m"))
    assert idx["version"] == 1 and idx["code"] == 8  # uint16: vocab 1000 < 65500
    assert idx["sequences"] == len(docs) and idx["doc_index"] == list(range(len(docs) + 1))
    assert idx["lengths"] == [len(d) for d in docs]
    assert got == docs  # global order: ledger chunks (round-robin over 3 shards), documents in chunk order
    assert sorted(os.listdir(tmp_path / "out")) == ["m.bin", "m.idx"]  # no temporary files left


@pytest.mark.parametrize("vocab,code", [(65499, 8), (65500, 4), (100277, 4)])
def test_dtype_follows_megatron_optimal_dtype(tmp_path, vocab, code):
    chunks = [[[0, vocab - 1, 7]], [[vocab - 2]]]
    docs = ref.synthetic_cache(str(tmp_path / "c"), chunks, vocab_size=vocab)
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m")]) == 0
    idx, got = ref.read_megatron(str(tmp_path / "m"))
    assert idx["code"] == code == DType.code_from_dtype(DType.optimal_dtype(vocab))
    assert got == docs


def test_dtype_override(tmp_path, capsys):
    docs = ref.synthetic_cache(str(tmp_path / "c"), [[[1, 999]]], vocab_size=1000)
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m"),
                 "--dtype", "int32"]) == 0
    assert ref.read_megatron(str(tmp_path / "m"))[0]["code"] == 4 and ref.read_megatron(str(tmp_path / "m"))[1] == docs
    ref.synthetic_cache(str(tmp_path / "big"), [[[1]]], vocab_size=70000)
    assert main(["export", str(tmp_path / "big"), "--format", "megatron", "--out", str(tmp_path / "n"),
                 "--dtype", "uint16"]) == 2
    assert "--dtype uint16: cannot hold the token ids" in capsys.readouterr().err


def test_megatron_core_reads_the_export_and_writes_the_same_bytes(tmp_path):
    docs = ref.synthetic_cache(str(tmp_path / "c"), _chunks(seed=5, n=12), vocab_size=1000,
                               chunks_per_shard=[7, 5])
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "ours")]) == 0
    ds = IndexedDataset(str(tmp_path / "ours"))
    assert len(ds) == len(docs) and ds.index.dtype == np.uint16
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    # Megatron's own writer, one sequence per document, gives the very same files.
    b = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=DType.optimal_dtype(1000))
    for d in docs:
        b.add_document(np.asarray(d, np.int64), [len(d)])
    b.finalize(str(tmp_path / "theirs.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()


def test_export_keeps_eos_as_stored(tmp_path):
    chunks = [[[5, 6, 0], [7, 0]], [[9, 9, 9, 0]]]
    docs = ref.synthetic_cache(str(tmp_path / "c"), chunks, vocab_size=50, append_eos=True, eos_id=0)
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m")]) == 0
    assert ref.read_megatron(str(tmp_path / "m"))[1] == docs


def _megatron_docs(rng, n, vocab, eos=None):
    out = []
    for i in range(n):
        k = 0 if i % 11 == 4 else int(rng.integers(1, 60))  # a few empty documents
        d = rng.integers(0, vocab, size=k).tolist()
        out.append(d + [eos] if eos is not None else d)
    return out + [[]]  # an empty document at the very end (offset = .bin size)


@pytest.mark.parametrize("tokenizer", ["tiktoken:cl100k_base", "tiny"])
@pytest.mark.parametrize("command", ["reader", "pipelines"])
def test_round_trip_megatron_cache_megatron_is_byte_identical(tmp_path, tokenizer, command, tiny_tokenizer):
    spec = tiny_tokenizer if tokenizer == "tiny" else tokenizer
    vocab = 402 if tokenizer == "tiny" else 100277
    docs = _megatron_docs(np.random.default_rng(1), 300, min(vocab, 400))
    b = IndexedDatasetBuilder(str(tmp_path / "orig.bin"), dtype=DType.optimal_dtype(vocab))
    for d in docs:
        b.add_document(np.asarray(d, np.int64), [len(d)])
    b.finalize(str(tmp_path / "orig.idx"))
    cache = str(tmp_path / "cache")
    opts = ["--chunk_tokens", "700", "--row_group_tokens", "150"]
    if command == "reader":  # the identity from a file
        ident = ref.identity_file(str(tmp_path / "tok.json"), spec)
        assert main(["import-megatron", str(tmp_path / "orig"), "--tokenizer_from", ident, "--out", cache, *opts]) == 0
    else:  # computed from the spec
        assert interop.main(["import-megatron", str(tmp_path / "orig"), "--tokenizer", spec, "--out", cache,
                             *opts]) == 0
    assert main(["validate", cache]) == 0
    ledger = load_ledger(cache)  # (with the chunk list a version 4 ledger keeps in its table and sidecars)
    assert ledger["totals"]["chunks"] > 5 and any(c["row_groups"] > 1 for c in ledger["chunks"])
    assert ref.cache_documents(cache) == docs
    assert main(["export", cache, "--format", "megatron", "--out", str(tmp_path / "back")]) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"orig{ext}").read_bytes() == (tmp_path / f"back{ext}").read_bytes()


def test_import_records_the_builders_tokenizer_identity(tmp_path, tiny_tokenizer, capsys):
    for spec in ("tiktoken:cl100k_base", tiny_tokenizer):
        prefix = str(tmp_path / "d")
        ref.write_megatron(prefix, [[[1, 2, 3]], [[4]]], code=8 if spec == tiny_tokenizer else 4)
        out = str(tmp_path / f"cache-{len(spec)}")
        assert interop.main(["import-megatron", prefix, "--tokenizer", spec, "--out", out]) == 0
        assert f"tokenizer {spec} (vocab_size {resolve(spec).vocab_size})" in capsys.readouterr().out
        ledger = json.loads(open(os.path.join(out, fmt.LEDGER_NAME)).read())
        assert ledger["tokenizer"] == resolve(spec).identity()


def test_import_chunks_follow_the_builders_byte_rule(tmp_path, tiny_tokenizer):
    docs = _megatron_docs(np.random.default_rng(2), 200, 300)
    ref.write_megatron(str(tmp_path / "a"), [[d] for d in docs], code=8)
    import_megatron([str(tmp_path / "a")], resolve(tiny_tokenizer).identity(), str(tmp_path / "c"),
                    chunk_tokens=500, row_group_tokens=100)
    ledger = load_ledger(str(tmp_path / "c"))
    import pyarrow.parquet as pq

    cb = ledger["config"]["chunk_bytes"]
    size = os.path.getsize(tmp_path / "a.bin")
    assert cb == 1000 and ledger["inputs"][0]["chunks"] == -(-size // cb) == ledger["totals"]["chunks"]
    assert ledger["config"]["source"] == {"format": "megatron", "dtype": "uint16", "unit": "document"}
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]]) * 2
    seen = []
    for c in ledger["chunks"]:
        lo, hi = c["byte_range"]
        assert (lo, hi) == (c["index_in_shard"] * cb, min(lo + cb, size))
        table = pq.read_table(tmp_path / "c" / c["path"])
        offs = table.column(fmt.OFFSET_COLUMN).to_pylist()
        lengths = table.column(fmt.LENGTH_COLUMN).to_pylist()
        side = json.loads((tmp_path / "c" / fmt.sidecar_path(0, c["index_in_shard"])).read_text())
        want = [sum(lengths[a:b]) for a, b in cachegen.row_groups(lengths, 100)]  # the builder's cut rule
        assert [e[3] for e in side["row_group_index"]] == want
        last = c["index_in_shard"] == ledger["inputs"][0]["chunks"] - 1
        assert all(lo <= o < hi or (last and o == size) for o in offs)
        seen += offs
    assert seen == starts.tolist()


def test_import_units_and_several_prefixes(tmp_path):
    split_docs = [[[1, 2], [3]], [[4, 5, 6]], [[7], [8], [9]]]  # made with --split-sentences
    ref.write_megatron(str(tmp_path / "b"), split_docs, code=4)
    ref.write_megatron(str(tmp_path / "a"), [[[10, 11]], [[12]]], code=4)
    joined = import_megatron([str(tmp_path / "b"), str(tmp_path / "a.bin")], CL100K,
                             str(tmp_path / "j"), chunk_tokens=2)
    assert [i["path"] for i in joined["inputs"]] == [str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]
    docs = ref.cache_documents(str(tmp_path / "j"))
    assert sorted(map(tuple, docs)) == sorted([(10, 11), (12,), (1, 2, 3), (4, 5, 6), (7, 8, 9)])
    import_megatron([str(tmp_path / "b")], CL100K, str(tmp_path / "s"), unit="sequence")
    assert ref.cache_documents(str(tmp_path / "s")) == [[1, 2], [3], [4, 5, 6], [7], [8], [9]]


def test_imported_cache_reads_in_eval_mode(tmp_path):
    docs = _megatron_docs(np.random.default_rng(4), 80, 1000)
    ref.write_megatron(str(tmp_path / "a"), [[d] for d in docs], code=4)
    import_megatron([str(tmp_path / "a")], CL100K, str(tmp_path / "c"), chunk_tokens=300)
    flat = [t for d in docs for t in d]
    with Reader(str(tmp_path / "c"), ReadOptions(seq_len=16, batch_size=4, eval_mode=True)) as r:
        got = []
        for _, b in r.iter_batches(start=0):
            got += b["targets"][b["valid"]].reshape(-1).tolist()
    assert got[:len(flat)] == flat and not any(got[len(flat):])


def test_append_eos_is_checked_and_recorded(tmp_path):
    ref.write_megatron(str(tmp_path / "e"), [[[5, 100257]], [[6, 7, 100257]]], code=4)
    led = import_megatron([str(tmp_path / "e")], CL100K, str(tmp_path / "c"), append_eos=True)
    assert led["config"]["append_eos"] is True
    ref.write_megatron(str(tmp_path / "n"), [[[5, 100257]], [[6, 7]]], code=4)
    with pytest.raises(importer.ImportFailed, match=r"n\.bin: document 1 does not end with the EOS id 100257"):
        import_megatron([str(tmp_path / "n")], CL100K, str(tmp_path / "d"), append_eos=True)


def test_rerun_after_interruption_gives_identical_bytes(tmp_path, monkeypatch):
    from build_helpers import tree_bytes

    docs = _megatron_docs(np.random.default_rng(6), 120, 1000)
    ref.write_megatron(str(tmp_path / "a"), [[d] for d in docs], code=4)
    args = ([str(tmp_path / "a")], CL100K)
    import_megatron(*args, str(tmp_path / "clean"), chunk_tokens=200)
    real, calls = importer.write_chunk, []

    def dying(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise OSError("disk went away")
        return real(*a, **k)

    monkeypatch.setattr(importer, "write_chunk", dying)
    with pytest.raises(OSError):
        import_megatron(*args, str(tmp_path / "crash"), chunk_tokens=200, threads=1)
    assert json.loads((tmp_path / "crash" / fmt.LEDGER_NAME).read_text())["finished"] is False
    assert main(["export", str(tmp_path / "crash"), "--format", "megatron", "--out", str(tmp_path / "x")]) == 2
    monkeypatch.setattr(importer, "write_chunk", real)
    import_megatron(*args, str(tmp_path / "crash"), chunk_tokens=200)
    assert tree_bytes(str(tmp_path / "crash")) == tree_bytes(str(tmp_path / "clean"))
    # an import an older chunkledger started (format version 2) finishes as version 2: its read order stays
    led = tmp_path / "crash" / fmt.LEDGER_NAME
    plan = dict(json.loads(led.read_text()), format_version=2, finished=False, chunks=[], totals={})
    led.write_text(fmt.dumps_ledger(plan))
    import_megatron(*args, str(tmp_path / "crash"), chunk_tokens=200)
    assert json.loads(led.read_text())["format_version"] == 2
    assert json.loads((tmp_path / "clean" / fmt.LEDGER_NAME).read_text())["format_version"] == 4
    with pytest.raises(importer.ImportFailed, match="already holds a different cache"):
        import_megatron(*args, str(tmp_path / "crash"), chunk_tokens=100)
