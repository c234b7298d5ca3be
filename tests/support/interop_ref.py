"""Independent references for the interop tests, written from the formats' documentation (Megatron-Core's
indexed_dataset docstrings and the seqax flat-tokens spec), not from reader/interop/megatron.py or
reader/interop/flat_tokens.py: plain ``struct`` parsing and Python lists, so a shared bug cannot hide.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Sequence

import numpy as np

import cachegen
from reader.format import spec as fmt

MAGIC = b"MMIDIDX\x00\x00"
# The Megatron DType enum: code -> (struct letter, itemsize)
CODES = {1: ("B", 1), 2: ("b", 1), 3: ("h", 2), 4: ("i", 4), 5: ("q", 8), 6: ("d", 8), 7: ("f", 4), 8: ("H", 2)}


def read_idx(path: str) -> dict:
    """Parse a .idx: header fields, sequence lengths/pointers, document index (as Python lists)."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:9] == MAGIC, "magic"
    (version,) = struct.unpack("<Q", raw[9:17])
    code = raw[17]
    seqs, docs1 = struct.unpack("<QQ", raw[18:34])
    o = 34
    lengths = list(struct.unpack(f"<{seqs}i", raw[o:o + 4 * seqs]))
    o += 4 * seqs
    pointers = list(struct.unpack(f"<{seqs}q", raw[o:o + 8 * seqs]))
    o += 8 * seqs
    doc_index = list(struct.unpack(f"<{docs1}q", raw[o:o + 8 * docs1]))
    o += 8 * docs1
    assert o == len(raw), f"{len(raw) - o} trailing bytes"
    return {"version": version, "code": code, "sequences": seqs, "doc_index_len": docs1, "lengths": lengths,
            "pointers": pointers, "doc_index": doc_index}


def read_megatron(prefix: str) -> tuple[dict, list[list[int]]]:
    """``(index fields, documents)``: each document's sequences joined, straight from the two files."""
    idx = read_idx(prefix + ".idx")
    letter, size = CODES[idx["code"]]
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = []
    for ptr, n in zip(idx["pointers"], idx["lengths"]):
        seqs.append(list(struct.unpack(f"<{n}{letter}", data[ptr:ptr + n * size])))
    d = idx["doc_index"]
    docs = [[t for s in seqs[d[i]:d[i + 1]] for t in s] for i in range(len(d) - 1)]
    return idx, docs


def write_megatron(prefix: str, documents: Sequence[Sequence[Sequence[int]]], code: int) -> None:
    """Write a .bin/.idx pair: each document a list of sequences (one sequence per document in the usual case)."""
    letter, size = CODES[code]
    lengths, pointers, doc_index, pos = [], [], [0], 0
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(struct.pack(f"<{len(seq)}{letter}", *seq))
                lengths.append(len(seq))
                pointers.append(pos)
                pos += len(seq) * size
            doc_index.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<Q", 1) + bytes([code]) + struct.pack("<QQ", len(lengths), len(doc_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))


def cache_documents(root: str) -> list[list[int]]:
    """Every document of a cache in global order (pyarrow, straight from the Parquet files)."""
    import pyarrow.parquet as pq

    from reader.storage.cache import Cache

    out = []
    for rel in Cache(root).table.paths:  # (a version 4 cache's chunks are in its table)
        out += pq.read_table(os.path.join(root, rel), columns=[fmt.TOKEN_COLUMN]).column(0).to_pylist()
    return out


def synthetic_cache(root: str, chunks, *, vocab_size: int, append_eos: bool = False, eos_id: int | None = None,
                    chunks_per_shard=None, row_group_tokens: int = 10) -> list[list[int]]:
    """A finished cache (tests/support/cachegen.py) with the given tokenizer vocabulary and ``config.append_eos``;
    returns its documents in global order."""
    tok = {"spec": "synthetic", "kind": "synthetic", "name": "synthetic", "vocab_size": vocab_size,
           "eos_id": eos_id, "hash": "sha256:synthetic"}
    cachegen.write_synthetic_cache(root, chunks, chunks_per_shard=chunks_per_shard, tokenizer=tok,
                                   row_group_tokens=row_group_tokens)
    path = os.path.join(root, fmt.LEDGER_NAME)
    with open(path) as f:
        ledger = json.load(f)
    ledger["config"]["append_eos"] = append_eos
    with open(path, "w") as f:
        f.write(fmt.dumps_ledger(ledger))
    return [list(map(int, d)) for c in chunks for d in c]


def check_flat_tokens_array(group, docs: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Check one flat-tokens array (zarr group) against the flat-tokens format's invariants; return its sequences.

    encoded_tokens uint32 1-d; seq_starts uint64 1-d, starting at 0, non-decreasing, ending at the token
    count; the start bit set exactly at the first token of every non-empty sequence; max_token_id an
    integer >= every decoded id.
    """
    enc, starts = group["encoded_tokens"], group["seq_starts"]
    assert enc.ndim == 1 and np.dtype(enc.dtype) == np.uint32
    assert starts.ndim == 1 and np.dtype(starts.dtype) == np.uint64
    e = [int(x) for x in enc[:]]
    s = [int(x) for x in starts[:]]
    assert s[0] == 0 and s[-1] == len(e)
    assert all(a <= b for a, b in zip(s, s[1:]))
    firsts = {a for a, b in zip(s, s[1:]) if b > a}
    assert {i for i, x in enumerate(e) if x & 1} == firsts
    max_id = group.attrs["max_token_id"]
    assert isinstance(max_id, int)
    ids = [x >> 1 for x in e]
    assert all(t <= max_id for t in ids)
    seqs = [ids[a:b] for a, b in zip(s, s[1:])]
    if docs is not None:
        assert seqs == [list(d) for d in docs]
        assert max_id == max((t for d in docs for t in d), default=0)
    return seqs


def identity_file(path: str, spec: str) -> str:
    """A tokenizer identity file for ``spec`` (for ``--tokenizer_from``), as ``python -m pipelines.interop
    tokenizer-identity SPEC --out PATH`` writes it; returns ``path``."""
    from pipelines.interop import main

    assert main(["tokenizer-identity", spec, "--out", path]) == 0
    return path
