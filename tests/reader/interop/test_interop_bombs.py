"""Interop inputs whose metadata claims far more than their files hold (a zarr of 188 KB claiming 2**40
tokens, a sparse Megatron .idx of 8 KB on disk listing 2**27 sequences): each is refused at once, in
one line naming the file, before anything is allocated for the claim or written."""

import json
import os
import struct
import time

import numcodecs
import pytest
import zarr

from reader.cli.main import main

pytestmark = pytest.mark.timeout(120)
IDENTITY = {"spec": "tiktoken:cl100k_base", "kind": "tiktoken", "name": "cl100k_base", "vocab_size": 100277,
            "eos_id": 100257, "hash": "sha256:0"}
QUICK_S = 10  # the claims cost minutes (or GiB) before; an answer now takes well under a second


@pytest.fixture
def identity(tmp_path):
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(IDENTITY))
    return str(path)


def _run(capsys, *argv):
    t = time.monotonic()
    code = main(list(argv))
    return code, capsys.readouterr().err, time.monotonic() - t


def flat_tokens(path, n_tokens, n_starts, *, fill=True, value=0):
    """A flat-tokens dataset (seqax's layout and codecs) whose train arrays claim ``n_tokens`` tokens and
    ``n_starts`` sequence starts. ``fill``: nothing is written but the last start (every other chunk is
    missing and would read as zeros); else the tokens are written, all ``value`` (a start bit at 0)."""
    root = zarr.open_group(store=str(path), mode="w-", zarr_format=2)
    comp = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.BITSHUFFLE)
    for split, nt, ns in (("train", n_tokens, n_starts), ("validation", 0, 1)):
        g = root.create_group(split)
        tok = g.create_array("encoded_tokens", shape=(nt,), chunks=(1 << 22,), dtype="uint32", compressors=comp,
                             fill_value=0)
        starts = g.create_array("seq_starts", shape=(ns,), chunks=(1 << 20,), dtype="uint64", compressors=comp,
                                filters=[numcodecs.Delta(dtype="i8")], fill_value=0)
        starts[ns - 1] = nt
        if not fill and nt:
            data = [value << 1] * nt
            data[0] |= 1
            tok[:] = data
        g.attrs["max_token_id"] = value
    return str(path)


@pytest.mark.parametrize("n_tokens,n_starts,claims", [
    (1 << 40, 2, "claims 1,099,511,627,776 tokens and 2 sequence starts (4,398,046,511,120 bytes)"),
    (1 << 34, 2, "claims 17,179,869,184 tokens and 2 sequence starts"),
    (1000, 1 << 34, "claims 1,000 tokens and 17,179,869,184 sequence starts"),
])
def test_a_flat_tokens_zarr_claiming_more_than_it_holds_is_refused_at_once(tmp_path, capsys, identity, n_tokens,
                                                                           n_starts, claims):
    src = flat_tokens(tmp_path / "bomb.zarr", n_tokens, n_starts)
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    assert stored < 200_000  # (the claim is gigabytes to terabytes)
    out = tmp_path / "cache"
    code, err, took = _run(capsys, "import-flat-tokens", src, "--tokenizer_from", identity, "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {src}/train: {claims}"), err
    assert "more than 1000x" in err and "nothing was imported" in err
    assert not out.exists() and took < QUICK_S, took


def test_compressible_but_real_flat_tokens_data_still_imports(tmp_path, capsys, identity):
    """2 Mi copies of one token, one sequence: about 200x smaller in the store, every chunk present."""
    src = flat_tokens(tmp_path / "same.zarr", 1 << 21, 2, fill=False, value=7)
    out = tmp_path / "cache"
    code, err, _ = _run(capsys, "import-flat-tokens", src, "--tokenizer_from", identity, "--out", str(out),
                        "--chunk_tokens", str(1 << 20))
    assert code == 0, err
    assert json.loads((out / "ledger.json").read_text())["totals"]["tokens"] == 1 << 21


@pytest.mark.parametrize("key,value,said", [
    ("shape", [1 << 70], "unreadable array metadata"),
    ("shape", "x", "unreadable array metadata"),
    ("chunks", [0], "shape [10] / chunks [0] out of range"),
    ("chunks", [1 << 64], "shape [10] / chunks [18446744073709551616] out of range"),
])
def test_zarr_metadata_integers_out_of_range_are_one_line_errors(tmp_path, capsys, identity, key, value, said):
    src = flat_tokens(tmp_path / "d.zarr", 10, 2, fill=False, value=3)
    meta_path = os.path.join(src, "train", "encoded_tokens", ".zarray")
    meta = json.load(open(meta_path))
    meta[key] = value
    json.dump(meta, open(meta_path, "w"))
    out = tmp_path / "cache"
    code, err, _ = _run(capsys, "import-flat-tokens", src, "--tokenizer_from", identity, "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {src}/train/encoded_tokens: {said}"), err
    assert not out.exists()


def sparse_megatron(prefix, sequences, documents):
    """A .bin of no bytes and an .idx listing ``sequences`` empty sequences in ``documents`` documents (the
    last one holding them all), written as a sparse file: a few KB on disk whatever its size."""
    docs1 = documents + 1
    size = 34 + 12 * sequences + 8 * docs1
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([4]) + struct.pack("<QQ", sequences, docs1))
        f.truncate(size)  # lengths and pointers: zeros (a hole)
        f.seek(size - 8)
        f.write(struct.pack("<q", sequences))  # the document index ends at S
    open(prefix + ".bin", "wb").close()
    return prefix


@pytest.mark.parametrize("sequences,documents,said", [
    (1 << 27, 1, "lists 134217728 sequences, but {p}.bin holds only 0 int32 tokens"),
    (0, 1 << 27, "lists 134217728 documents, but {p}.bin holds only 0 int32 tokens"),
])
def test_a_sparse_megatron_index_claiming_more_than_the_bin_holds_is_refused_at_once(tmp_path, capsys, identity,
                                                                                    sequences, documents, said):
    prefix = sparse_megatron(str(tmp_path / "sparse"), sequences, documents)
    assert os.path.getsize(prefix + ".idx") > 1 << 30
    out = tmp_path / "cache"
    code, err, took = _run(capsys, "import-megatron", prefix, "--tokenizer_from", identity, "--out", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {prefix}.idx: " + said.format(p=prefix)) and "damaged" in err, err
    assert not out.exists() and took < QUICK_S, took


def test_an_index_with_a_few_empty_sequences_and_documents_still_imports(tmp_path, capsys, identity):
    """Empty documents and sequences are allowed (Megatron's builder writes them for empty texts)."""
    import interop_ref as ref

    docs = [[[1, 2]], [[]], [], [[3], [], [4, 5]], [[]]]
    ref.write_megatron(str(tmp_path / "m"), docs, code=4)
    out = tmp_path / "cache"
    code, err, _ = _run(capsys, "import-megatron", str(tmp_path / "m"), "--tokenizer_from", identity, "--out",
                        str(out))
    assert code == 0, err
    assert ref.cache_documents(str(out)) == [[1, 2], [], [], [3, 4, 5], []]


def test_a_tokenizer_identity_nested_too_deep_is_a_one_line_error(tmp_path, capsys):
    deep = tmp_path / "tok.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    prefix = sparse_megatron(str(tmp_path / "m"), 0, 0)
    out = str(tmp_path / "c")
    code, err, _ = _run(capsys, "import-megatron", prefix, "--tokenizer_from", str(deep), "--out", out)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {deep}: not valid JSON (nested too deep); give a tokenizer identity as "), err
