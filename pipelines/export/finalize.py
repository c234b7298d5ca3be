"""The end of a Beam export to Megatron: the parts joined into ``PREFIX.bin``, ``PREFIX.idx`` written, in
the order that keeps an ``.idx`` with its final name always beside a complete ``.bin``.

1. ``PREFIX.idx`` is written into the parts directory by ``reader.interop.megatron.write_index`` (the CLI's
   writer) from the parts' length files, in part order.
2. The parts' ``.bin`` files are joined in part order:

   - local files: into the parts directory with ``os.copy_file_range`` (the kernel copies; plain reads
     and writes where it cannot), then renamed onto ``PREFIX.bin``;
   - ``gs://``: by Cloud Storage *compose* (gcsfs ``merge``), server-side, at most 32 sources per call
     (a tree of intermediate objects in the parts directory for more); the last compose creates
     ``PREFIX.bin`` itself, and a composed object appears whole, so it is the rename;
   - any other fsspec store: streamed through this process into the parts directory, then renamed.

3. An old ``PREFIX.idx`` is removed before the new ``.bin`` gets its name; the new ``.idx`` is renamed
   after it; the parts directory is removed last. A crash anywhere leaves either no final ``.idx`` or
   both final files complete, and the parts directory (with the plan) for the rerun.
"""

from __future__ import annotations

import errno
import os
from typing import Callable, Iterator, Sequence

import numpy as np

from reader.format import spec as fmt
from reader.interop.export import rename
from reader.storage.files import remove_quietly
from reader.interop.megatron import write_index
from reader.storage import files
from reader.storage.files import is_gcs, is_local

from pipelines.export.parts import READ_BLOCK, PartResult, part_path
from pipelines.export.layout import ExportPlan

COMPOSE_LIMIT = 32  # Cloud Storage: source objects per compose request
OUT_BIN, OUT_IDX = "out.bin", "out.idx"  # the outputs' names inside the parts directory


def join_method(fs) -> str:
    """How :func:`finalize` joins the parts on ``fs``: ``copy_file_range``, ``compose`` or ``streamed``."""
    if is_local(fs):
        return "copy_file_range"
    if is_gcs(fs) and hasattr(fs, "merge"):
        return "compose"
    return "streamed"


def part_lengths(fs, directory: str, plan: ExportPlan) -> Callable[[], Iterator[np.ndarray]]:
    """The documents' lengths from the parts' ``.len`` files in order, block by block (for ``write_index``)."""

    def lengths() -> Iterator[np.ndarray]:
        for spec in plan.parts:
            with files.storage(fs).open(part_path(directory, spec.index, "len")) as f:
                rest = b""
                while raw := f.read(READ_BLOCK):
                    raw, cut = rest + raw, (len(rest) + len(raw)) // 4 * 4
                    rest = raw[cut:]
                    yield np.frombuffer(raw[:cut], "<i4")
            if rest:
                raise fmt.FormatError(f"{part_path(directory, spec.index, 'len')}: not a whole number of int32 "
                                      "lengths (damaged part; rerun the export command)")

    return lengths


def _copy_local(src: str, dst_fd: int, size: int) -> None:
    with files.open_local(src) as f:
        fd, left = f.fileno(), size
        try:
            while left:
                n = os.copy_file_range(fd, dst_fd, left)
                if n == 0:
                    break
                left -= n
        except OSError as e:  # another file system, or a kernel without it: read and write
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                raise
            while left and (block := os.read(fd, min(left, READ_BLOCK))):
                os.write(dst_fd, block)
                left -= len(block)
    if left:
        raise fmt.FormatError(f"{src}: {size - left} bytes, the plan says {size} (a part changed after it was "
                              "written; rerun the export command)")


def concat_local(sources: Sequence[str], sizes: Sequence[int], dst: str) -> None:
    """``sources`` (of ``sizes`` bytes) joined into the local file ``dst``."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)  # never through a symlink
    try:
        for src, size in zip(sources, sizes):
            _copy_local(src, fd, size)
    finally:
        os.close(fd)


def compose(fs, sources: Sequence[str], dst: str, scratch: str) -> None:
    """``sources`` joined into ``dst`` by Cloud Storage compose (``fs.merge``), 32 at a time, through
    intermediate objects ``scratch/compose-L-NNNNNN`` when there are more."""
    if not sources:
        fs.pipe_file(dst, b"")
        return
    level, todo = 0, list(sources)
    while len(todo) > COMPOSE_LIMIT:
        nxt = []
        for i in range(0, len(todo), COMPOSE_LIMIT):
            target = f"{scratch}/compose-{level}-{i // COMPOSE_LIMIT:06d}"
            fs.merge(target, todo[i:i + COMPOSE_LIMIT])
            nxt.append(target)
        todo, level = nxt, level + 1
    fs.merge(dst, todo)


def concat_streamed(fs, sources: Sequence[str], dst: str) -> None:
    """``sources`` joined into ``dst`` by reading and writing through this process (any fsspec store)."""
    with fs.open(dst, "wb") as fo:
        for src in sources:
            with fs.open(src, "rb") as fi:
                while block := fi.read(READ_BLOCK):
                    fo.write(block)


def _check_size(fs, path: str, want: int, what: str) -> None:
    fs.invalidate_cache(path)  # gcsfs may answer from its listing cache
    got = fs.size(path)
    if got != want:
        raise fmt.FormatError(f"{path}: {got} bytes after joining the parts, the plan says {want} ({what}); "
                              "rerun the export command")


def finalize(fs, plan: ExportPlan, directory: str, out: str, results: Sequence[PartResult]) -> str:
    """Join the parts into ``out.bin`` and write ``out.idx``; remove the parts directory. Returns how the
    ``.bin`` was joined (``copy_file_range``, ``compose`` or ``streamed``).

    Args:
      fs: the output's filesystem.
      plan: the export plan.
      directory: the parts directory (every part written and verified).
      out: the output prefix (a path on ``fs``).
      results: every part's result, in any order.
    """
    done = sorted(r.index for r in results)
    if done != [s.index for s in plan.parts]:
        missing = sorted({s.index for s in plan.parts} - set(done))[:5]
        raise fmt.FormatError(f"{directory}: parts {missing} were not written; rerun the export command")
    sources = [part_path(directory, s.index, "bin") for s in plan.parts]
    for src, spec in zip(sources, plan.parts):
        _check_size(fs, src, spec.nbytes, f"part {spec.index}")
    idx_tmp, bin_tmp = f"{directory}/{OUT_IDX}", f"{directory}/{OUT_BIN}"
    bin_path, idx_path = out + ".bin", out + ".idx"
    with fs.open(idx_tmp, "wb") as f:
        write_index(f, np.dtype(plan.dtype), plan.docs, part_lengths(fs, directory, plan))
    _check_size(fs, idx_tmp, plan.idx_bytes, ".idx")
    remove_quietly(fs, idx_path)  # never leave an old .idx beside a new .bin
    how = join_method(fs)
    if how == "compose":
        compose(fs, sources, bin_path, directory)
    else:
        if how == "copy_file_range":
            concat_local(sources, [s.nbytes for s in plan.parts], bin_tmp)
        else:
            concat_streamed(fs, sources, bin_tmp)
        _check_size(fs, bin_tmp, plan.bin_bytes, ".bin")
        rename(fs, bin_tmp, bin_path)
    _check_size(fs, bin_path, plan.bin_bytes, ".bin")
    rename(fs, idx_tmp, idx_path)
    remove_quietly(fs, directory)
    return how
