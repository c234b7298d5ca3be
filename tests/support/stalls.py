"""A storage read that never returns, for the reader liveness tests.

The storage port refuses a FIFO where a chunk belongs (it would block), so a hung read is made where one
happens: every read of a chunk file under the cache blocks, in this process and in any reader worker
started meanwhile, on a file lock this process holds (what a storage read that never returns looks like
from above). The workers get the same hook from a ``sitecustomize`` module on their ``PYTHONPATH``.
Afterwards the lock is let go, so blocked reads go on, and the hooks are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile

HOOK = '''
import fcntl, functools
from reader.storage import files

def _hang(read):
    @functools.wraps(read)
    def hung(path, *args, **kwargs):
        if str(path).startswith({root!r}) and str(path).endswith(".parquet"):
            with open({lock!r}, "rb") as held:
                fcntl.flock(held, fcntl.LOCK_SH)  # blocks while the test holds it
        return read(path, *args, **kwargs)
    hung.unhung = read
    return hung

files.read_local, files.open_local = _hang(files.read_local), _hang(files.open_local)
'''


@contextlib.contextmanager
def hanging_chunks(cache: str, root: str):
    """A copy of ``cache`` at ``root`` whose chunk files' reads block until the context ends."""
    from reader.storage import files

    shutil.copytree(cache, root)
    root = os.path.abspath(root)
    hooks = tempfile.mkdtemp(prefix="cl-stalls-hook-")
    lock = os.path.join(hooks, "lock")
    code = HOOK.format(root=root, lock=lock)
    with open(os.path.join(hooks, "sitecustomize.py"), "w") as f:
        f.write(code)
    held = open(lock, "wb")
    fcntl.flock(held, fcntl.LOCK_EX)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([hooks] + ([before] if before else []))
    exec(compile(code, "stalls-hook", "exec"), {})
    try:
        yield root
    finally:
        files.read_local, files.open_local = files.read_local.unhung, files.open_local.unhung
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
        held.close()  # the blocked reads go on
        shutil.rmtree(hooks, ignore_errors=True)
