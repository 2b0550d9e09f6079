"""The one error type users see: a clear, one-line message naming the setting and the fix."""


class MeshtronError(Exception):
    """A user-facing error. ``str(err)`` is a single line that names the setting and the fix.

    ``uniform`` is True when every rank is known to raise the same error (for example a
    config check run identically everywhere); then only rank 0 prints it.
    """

    def __init__(self, message: str, *, uniform: bool = True):
        super().__init__(" ".join(message.split()))
        self.uniform = uniform


class ConfigError(MeshtronError):
    """A bad setting in the config file, the CLI overrides or the environment."""
