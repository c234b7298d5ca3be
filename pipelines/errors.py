"""The builder's error: raised by the launcher and by workers alike."""


class BuildError(RuntimeError):
    """A build cannot start or finish; the message names the file or option and the fix."""
