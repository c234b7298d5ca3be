"""Test-side launcher: run the builder and SIGKILL it during its N-th atomic write.

    python tests/support/kill_at.py N:before_rename [python -m pipelines.build_cache options]
    python tests/support/kill_at.py N:after_rename  [...]
    python tests/support/kill_at.py N:pause         [...]
    python tests/support/kill_at.py N:STAGE --module pipelines.dedup.job [its options]   (another command's main)

Every atomic write of the builder ends in one rename of its temporary file (``.tmp-*``) onto the final
name: ``reader.storage.files.publish``, the last step of every atomic write in the project, called with
the builder's Beam storage (``pipelines.inputs.filesystem.BEAM``; the local memo caches of tokenizer checks
use another and are not counted). :func:`kill_at_write` wraps it in this process (the launcher, and the
workers of an in-process runner such as FnApiRunner) and kills the process at the N-th such rename
(1-based): just before it (the temporary file is left behind) or just after
it (a complete file without its successors). ``pause`` instead prints :data:`PAUSED` on stdout just before
the N-th rename and stops there, for a test that kills the process (or its group) itself. The product code
has no hook for this.
"""

from __future__ import annotations

import os
import posixpath
import signal
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ("before_rename", "after_rename", "pause")
PAUSED = "kill_at: paused before a rename"


def kill_at_write(point: str) -> None:
    """Arm the kill point ``"N:before_rename"``, ``"N:after_rename"`` or ``"N:pause"`` for the rest of this process."""
    n_text, _, stage = point.partition(":")
    n = int(n_text)
    if n < 1 or stage not in STAGES:
        raise ValueError(f"kill point {point!r}: expected N:{'|'.join(STAGES)} with N >= 1")
    from pipelines.filesystem import BEAM
    from reader.storage import files

    real_publish = files.publish
    writes = 0
    lock = threading.Lock()  # an in-process runner publishes from several threads

    def publish(fs, tmp, path):
        nonlocal writes
        if fs is not BEAM:
            return real_publish(fs, tmp, path)
        assert posixpath.basename(tmp).startswith(files.TMP_PREFIX), tmp
        with lock:
            writes += 1
            hit = writes == n
        if hit and stage == "before_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and stage == "pause":
            print(PAUSED, flush=True)
            threading.Event().wait()  # until killed
        real_publish(fs, tmp, path)
        if hit and stage == "after_rename":
            os.kill(os.getpid(), signal.SIGKILL)

    files.publish = publish


if __name__ == "__main__":
    sys.path.insert(0, REPO)  # this checkout's pipelines/, as `python -m` from the repository root finds it
    kill_at_write(sys.argv[1])
    if sys.argv[2:3] == ["--module"]:
        import importlib

        importlib.import_module(sys.argv[3]).main(sys.argv[4:])
    else:
        from pipelines.build_cache import main

        main(sys.argv[2:])
