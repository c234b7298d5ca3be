"""The builder's errors: raised by the launcher and by workers alike.

Exit codes of the command line (``build_cache.main``): a :class:`BuildError` exits with 2 (the build was
refused or its input is bad: fix something first), an :class:`EnvironmentFault` with 1 (the machine, disk
or network failed: rerunning the same command resumes).
"""


def one_line(text: str) -> str:
    """``text`` on one line (pyarrow's and the decompressors' messages hold newlines)."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


class BuildError(RuntimeError):
    """A build cannot start or finish; the message names the file or option and the fix."""

    exit_code = 2


class EnvironmentFault(BuildError):
    """The environment failed (disk full, permissions, network, a worker killed); a rerun resumes."""

    exit_code = 1


class DamagedInput(BuildError):
    """A compressed input file ends early or is corrupt (found while decompressing it).

    Args:
      path: the input file.
      offset: uncompressed bytes decoded before the damage.
      reason: what the decompressor reported.
    """

    def __init__(self, path: str, offset: int, reason: str):
        reason = one_line(reason)
        self.path, self.offset, self.reason = path, offset, reason
        super().__init__(
            f"input file {path} is damaged: {reason} after {offset} uncompressed bytes. Nothing built from it "
            "is kept as complete. Replace the file with an intact copy (or leave it out of --input) and rerun "
            "the same command.")

    def __reduce__(self):  # picklable with its arguments (workers send exceptions to the launcher)
        return (DamagedInput, (self.path, self.offset, self.reason))


class DamagedFile(DamagedInput):
    """A Parquet or Arrow input whose structure or data is damaged (found while planning or reading it).

    Args:
      path: the input file.
      where: where the damage is (``"at byte 1234"``, ``"row group 3, column 'text'"``).
      reason: what was found.
    """

    def __init__(self, path: str, where: str, reason: str):
        reason = one_line(reason)
        self.path, self.where, self.reason, self.offset = path, where, reason, None
        BuildError.__init__(
            self, f"input file {path} is damaged: {reason} ({where}). Nothing built from it is kept as complete. "
                  "Replace the file with an intact copy (or leave it out of --input) and rerun the same command.")

    def __reduce__(self):
        return (DamagedFile, (self.path, self.where, self.reason))
