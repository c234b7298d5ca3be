"""Test-side launcher: run the builder and SIGKILL it during its N-th atomic write.

    python tests/support/kill_at.py N:before_rename [python -m pipelines.build_cache options]
    python tests/support/kill_at.py N:after_rename  [...]

Every atomic write of the builder ends in one rename of its temporary file (``.tmp-*``) onto the final
name. :func:`kill_at_write` wraps Beam's ``FileSystems.rename`` in this process (the launcher, and the
workers of an in-process runner such as FnApiRunner) and kills the process at the N-th such rename
(1-based): just before it (the temporary file is left behind) or just after it (a complete file
without its successors). The product code has no hook for this.
"""

from __future__ import annotations

import os
import posixpath
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ("before_rename", "after_rename")


def kill_at_write(point: str) -> None:
    """Arm the kill point ``"N:before_rename"`` or ``"N:after_rename"`` for the rest of this process."""
    n_text, _, stage = point.partition(":")
    n = int(n_text)
    if n < 1 or stage not in STAGES:
        raise ValueError(f"kill point {point!r}: expected N:{'|'.join(STAGES)} with N >= 1")
    from apache_beam.io.filesystems import FileSystems

    from pipelines.inputs.fsutil import TMP_PREFIX

    real_rename = FileSystems.rename
    writes = 0

    def rename(source_file_names, destination_file_names):
        nonlocal writes
        atomic = any(posixpath.basename(s).startswith(TMP_PREFIX) for s in source_file_names)
        if atomic:
            writes += 1
            if writes == n and stage == "before_rename":
                os.kill(os.getpid(), signal.SIGKILL)
        real_rename(source_file_names, destination_file_names)
        if atomic and writes == n and stage == "after_rename":
            os.kill(os.getpid(), signal.SIGKILL)

    FileSystems.rename = staticmethod(rename)


if __name__ == "__main__":
    sys.path.insert(0, REPO)  # this checkout's pipelines/, as `python -m` from the repository root finds it
    kill_at_write(sys.argv[1])
    from pipelines.build_cache import main

    main(sys.argv[2:])
