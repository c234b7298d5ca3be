"""The parts of a Beam export to Megatron (the workers' side): one part's ``.bin`` bytes and lengths.

A part's chunks are read exactly as ``python -m reader export`` reads them (``reader.interop.export.iter_blocks``:
each chunk file checked against the ledger's size and sha256, its ``num_tokens`` column and its counts;
then ``check_token_range``), and its tokens converted by ``reader.interop.megatron.bin_bytes``. It is written into
the parts directory beside the output (``.tmp-NAME.parts/``, see :func:`parts_dir`) as three files, each
under a temporary name and renamed::

    part-000007.bin    the part's bytes of PREFIX.bin
    part-000007.len    its documents' token counts (int32, little-endian)
    part-000007.json   written last: the plan's fingerprint, the part's chunks and counts, and the size
                       and sha256 of the two files above

A rerun keeps a part whose record names the same plan and part and whose files have the recorded sizes
and sha256; anything else is written again, so a crashed export resumes to the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from typing import Any

import numpy as np

from reader.format import spec as fmt
from reader.storage import files
from reader.storage.files import TMP_PREFIX, remove_quietly
from reader.storage.cache import Cache
from reader.interop.export import check_token_range, iter_blocks
from reader.interop.megatron import bin_bytes

from pipelines.export.layout import ExportPlan, PartSpec, fingerprint

PLAN_NAME = "plan.json"
FAILED_NAME = "_FAILED.json"
READ_BLOCK = 8 << 20


def parts_dir(out: str) -> str:
    """The parts directory of the output prefix ``out`` (a path, without protocol): beside it, hidden,
    with the temporary prefix every atomic write uses, and the same for every run (so a rerun finds it)."""
    parent, base = posixpath.split(out.rstrip("/"))
    return posixpath.join(parent, f"{TMP_PREFIX}{base}.parts")


def part_path(directory: str, index: int, ext: str) -> str:
    """``DIR/part-000007.bin`` / ``.len`` / ``.json``."""
    return f"{directory}/part-{index:06d}.{ext}"


@dataclasses.dataclass(frozen=True)
class PartResult:
    """What a worker did with one part: ``kept`` (an earlier run's part verified) or written."""

    index: int
    docs: int
    tokens: int
    nbytes: int
    kept: bool


def read_json(fs, path: str) -> dict | None:
    """A JSON object file, or None if it is missing or unreadable (half-written by hand, damaged)."""
    try:
        value = json.loads(files.storage(fs).read(path, limit=files.MAX_SMALL_FILE_BYTES))
    except (FileNotFoundError, ValueError, files.UnsafeFile):
        return None
    return value if isinstance(value, dict) else None


def _sha256_of(fs, path: str) -> str:
    h = hashlib.sha256()
    with files.storage(fs).open(path) as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def _record(plan: ExportPlan, spec: PartSpec) -> dict[str, Any]:
    return {"fingerprint": plan.fingerprint, "index": spec.index, "chunks": [spec.chunk_lo, spec.chunk_hi],
            "docs": spec.docs, "tokens": spec.tokens, "bin_bytes": spec.nbytes, "len_bytes": 4 * spec.docs}


def verified(fs, directory: str, plan: ExportPlan, spec: PartSpec) -> bool:
    """True when the part's files in ``directory`` are this plan's part, complete and intact."""
    rec = read_json(fs, part_path(directory, spec.index, "json"))
    if rec is None or {k: rec.get(k) for k in _record(plan, spec)} != _record(plan, spec):
        return False
    for ext, size in (("bin", spec.nbytes), ("len", 4 * spec.docs)):
        p = part_path(directory, spec.index, ext)
        try:
            if fs.size(p) != size or _sha256_of(fs, p) != rec.get(f"{ext}_sha256"):
                return False
        except FileNotFoundError:
            return False
    return True


class PartWriter:
    """Writes the parts of one plan on a worker (one cache opened per worker process).

    Args:
      plan: the export plan.
      directory: the parts directory (path on ``fs``).
      fs: the output's fsspec filesystem.
      threads: chunk files fetched and decoded ahead, in parallel.
    """

    def __init__(self, plan: ExportPlan, directory: str, fs, threads: int = 2):
        self.plan, self.directory, self.fs, self.threads = plan, directory, fs, threads
        self.cache = Cache(plan.cache)
        table = self.cache.table
        if not self.cache.complete or fingerprint(table.checksums, plan.dtype, plan.part_bytes) != plan.fingerprint:
            raise fmt.FormatError(f"{self.cache.display(fmt.LEDGER_NAME)}: changed since this export was planned "
                                  "(the cache was rebuilt meanwhile?); rerun the export command")

    def write(self, spec: PartSpec) -> PartResult:
        """Write part ``spec`` (or keep it if an earlier run wrote it completely). Raises the reader's errors
        (``ChunkError``, ``ExportError``) naming the chunk file for damaged input."""
        fs, d = self.fs, self.directory
        if verified(fs, d, self.plan, spec):
            return PartResult(spec.index, spec.docs, spec.tokens, spec.nbytes, kept=True)
        record = _record(self.plan, spec)
        remove_quietly(fs, part_path(d, spec.index, "json"))  # the record goes last: never beside new files
        dt = np.dtype(self.plan.dtype)
        bin_path, len_path = part_path(d, spec.index, "bin"), part_path(d, spec.index, "len")
        h = hashlib.sha256()
        lengths, docs, tokens = [], 0, 0

        def fill(f):
            nonlocal docs, tokens
            for block in iter_blocks(self.cache, prefetch=self.threads, chunks=spec.chunks):
                check_token_range(block, self.plan.vocab_size, self.cache)
                data = bin_bytes(block.values, dt)
                f.write(data)
                h.update(data)
                lengths.append(block.lengths.astype("<i4"))
                docs += len(block.lengths)
                tokens += block.values.size
            if (docs, tokens) != (spec.docs, spec.tokens):
                raise fmt.FormatError(f"{self.cache.display(fmt.LEDGER_NAME)}: chunks {spec.chunk_lo}..{spec.chunk_hi - 1} "
                                      f"hold {docs} documents / {tokens} tokens, the ledger {spec.docs} / {spec.tokens}")

        files.write(fs, bin_path, fill)
        len_bytes = np.concatenate(lengths).tobytes() if lengths else b""
        files.write(fs, len_path, len_bytes)
        record.update(bin_sha256=h.hexdigest(), len_sha256=hashlib.sha256(len_bytes).hexdigest())
        files.write(fs, part_path(d, spec.index, "json"), fmt.dumps(record).encode())
        return PartResult(spec.index, docs, tokens, spec.nbytes, kept=False)
