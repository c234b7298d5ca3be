"""Bad input to export / import-megatron / import-flat-tokens: a clear error naming the file, and nothing
partially written left looking complete."""

import json
import os
import struct

import numpy as np
import pytest
import zarr

import interop_ref as ref
from reader import Cache
from reader.format import spec as fmt
from reader.cli.main import main


def _run(capsys, *argv):
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture
def tiny(tmp_path_factory):
    """The identity file of a tokenizer of 400 ids."""
    from build_helpers import train_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    return ref.identity_file(str(d / "tiny.json"), train_tiny_tokenizer(str(d / "tokenizer.json")))


def _pair(tmp_path, docs=((1, 2, 3), (4, 5), (6,)), code=4):
    prefix = str(tmp_path / "data")
    ref.write_megatron(prefix, [[list(d)] for d in docs], code=code)
    return prefix


@pytest.fixture(scope="module")
def cl100k(tmp_path_factory):
    """cl100k_base's identity file, for --tokenizer_from."""
    return ref.identity_file(str(tmp_path_factory.mktemp("id") / "cl100k.json"), "tiktoken:cl100k_base")


def _import(capsys, prefix, out, tokenizer):
    return _run(capsys, "import-megatron", prefix, "--tokenizer_from", tokenizer, "--out", str(out))


def _nothing_complete(out):
    """No cache there, or one whose ledger says unfinished (readers and export refuse it)."""
    if not os.path.exists(os.path.join(out, fmt.LEDGER_NAME)):
        return True
    return not Cache(str(out)).complete


def test_truncated_bin(tmp_path, capsys, cl100k):
    prefix = _pair(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 4)
    rc, err = _import(capsys, prefix, tmp_path / "c", cl100k)
    assert rc == 2 and f"{prefix}.bin: 20 bytes" in err and "truncated" in err
    assert _nothing_complete(tmp_path / "c")


@pytest.mark.parametrize("offset,value,message", [
    (0, b"MMIDIDY", "not a Megatron index"),
    (9, struct.pack("<Q", 2), "index version 2"),
    (17, bytes([9]), "unknown dtype code 9"),
    (17, bytes([7]), "float32 is not an integer type"),
])
def test_bad_idx_header(tmp_path, capsys, offset, value, message, cl100k):
    prefix = _pair(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(value)
    rc, err = _import(capsys, prefix, tmp_path / "c", cl100k)
    assert rc == 2 and f"{prefix}.idx: " in err and message in err
    assert not os.path.exists(tmp_path / "c")


def test_truncated_idx_and_missing_files(tmp_path, capsys, cl100k):
    prefix = _pair(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".idx") - 8)
    rc, err = _import(capsys, prefix, tmp_path / "c", cl100k)
    assert rc == 2 and f"{prefix}.idx: " in err and "truncated or damaged" in err
    rc, err = _import(capsys, str(tmp_path / "nope"), tmp_path / "c", cl100k)
    assert rc == 2 and f"{tmp_path / 'nope'}.idx: no such file" in err


def test_uint16_data_claimed_for_a_100k_vocabulary(tmp_path, capsys, cl100k):
    prefix = _pair(tmp_path, code=8)
    rc, err = _import(capsys, prefix, tmp_path / "c", cl100k)
    assert rc == 2 and f"{prefix}.idx: dtype uint16 holds ids up to 65535" in err and "100277" in err
    assert not os.path.exists(tmp_path / "c")


def test_token_ids_outside_the_vocabulary(tmp_path, capsys, tiny):
    prefix = _pair(tmp_path, docs=((1, 2), (3, 399), (5, 400, 6)), code=4)
    rc, err = _import(capsys, prefix, tmp_path / "c", tokenizer=tiny)
    assert rc == 2 and f"{prefix}.bin: document 2 holds token id 400, outside the vocabulary [0, 400)" in err
    assert _nothing_complete(tmp_path / "c")
    rc, err = _run(capsys, "export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m"))
    assert rc == 2 and "has not finished" in err


def test_export_of_a_damaged_chunk_leaves_no_output(tmp_path, capsys):
    ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2]], [[3]], [[4, 5]]], vocab_size=10)
    led = json.loads((tmp_path / "c" / fmt.LEDGER_NAME).read_text())
    victim = tmp_path / "c" / led["chunks"][1]["path"]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    for fmt_name, out in (("megatron", tmp_path / "out" / "m"), ("flat-tokens", tmp_path / "out" / "d.zarr")):
        rc, err = _run(capsys, "export", str(tmp_path / "c"), "--format", fmt_name, "--out", str(out))
        assert rc == 1 and f"{victim}: checksum mismatch" in err  # 1: the cache is damaged
    assert os.listdir(tmp_path / "out") == []  # neither final nor temporary files


@pytest.mark.parametrize("bad", [10, 12, -1])
def test_export_of_tokens_outside_the_vocabulary(tmp_path, capsys, bad):
    ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2]], [[3, bad]]], vocab_size=10)
    for name, out in (("megatron", "o/m"), ("flat-tokens", "o/d.zarr")):
        rc, err = _run(capsys, "export", str(tmp_path / "c"), "--format", name, "--out", str(tmp_path / out))
        assert rc == 2 and f"token id {bad} is outside the tokenizer's vocabulary [0, 10)" in err
    assert os.listdir(tmp_path / "o") == []


def test_megatron_export_renames_the_idx_last(tmp_path, monkeypatch):
    import reader.interop.megatron as megatron

    ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2]]], vocab_size=10)
    real, seen = megatron.rename, []

    def recording(fs, src, dst):
        seen.append((dst, os.path.exists(tmp_path / "m.bin"), os.path.exists(tmp_path / "m.idx")))
        real(fs, src, dst)

    monkeypatch.setattr(megatron, "rename", recording)
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m")]) == 0
    assert seen == [(str(tmp_path / "m.bin"), False, False), (str(tmp_path / "m.idx"), True, False)]


def test_export_refuses_existing_output_unless_overwrite(tmp_path, capsys):
    ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2]]], vocab_size=10)
    (tmp_path / "m.idx").write_bytes(b"old")
    rc, err = _run(capsys, "export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m"))
    assert rc == 2 and f"{tmp_path / 'm.idx'} exists; pass --overwrite" in err
    assert main(["export", str(tmp_path / "c"), "--format", "megatron", "--out", str(tmp_path / "m"),
                 "--overwrite"]) == 0
    assert ref.read_megatron(str(tmp_path / "m"))[1] == [[1, 2]]


def _flat(tmp_path, name="d.zarr"):
    ref.synthetic_cache(str(tmp_path / "c"), [[[1, 2, 3], [4]], [[5, 6]]], vocab_size=100)
    assert main(["export", str(tmp_path / "c"), "--format", "flat-tokens", "--out", str(tmp_path / name)]) == 0
    return tmp_path / name


def test_zarr_group_missing_an_array(tmp_path, capsys, cl100k):
    d = _flat(tmp_path)
    import shutil

    shutil.rmtree(d / "train" / "seq_starts")
    rc, err = _run(capsys, "import-flat-tokens", str(d), "--tokenizer_from", cl100k, "--out",
                   str(tmp_path / "imp"))
    assert rc == 2 and f"{d}/train/seq_starts: missing array" in err
    assert not os.path.exists(tmp_path / "imp")


@pytest.mark.parametrize("damage,message", [
    ("start_bit", "encoded_tokens: token 1 has its start bit set"),
    ("seq_end", "seq_starts: ends at 5, encoded_tokens holds 6 tokens"),
    ("max_id", "max_token_id 100300 does not fit the tokenizer's vocabulary of 100277 ids"),
    ("dtype", "train/encoded_tokens: 1-d int64, the format needs a 1-d uint32 array"),
])
def test_damaged_flat_tokens(tmp_path, capsys, damage, message, cl100k):
    d = _flat(tmp_path)
    g = zarr.open_group(str(d), mode="r+")["train"]
    if damage == "start_bit":
        g["encoded_tokens"][1] = int(g["encoded_tokens"][1]) | 1
    elif damage == "seq_end":
        g["seq_starts"][-1] = 5
    elif damage == "max_id":
        g.attrs["max_token_id"] = 100300
    else:
        vals = g["encoded_tokens"][:]
        del g["encoded_tokens"]
        g.create_array("encoded_tokens", shape=vals.shape, dtype="int64")[:] = vals.astype(np.int64)
    rc, err = _run(capsys, "import-flat-tokens", str(d), "--tokenizer_from", cl100k, "--out",
                   str(tmp_path / "imp"))
    assert rc == 2 and message in err and str(d) in err
    assert _nothing_complete(tmp_path / "imp")
