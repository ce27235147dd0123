"""Errors the user can act on: each names the input and the fix (CLIs print them without a traceback)."""


class ConfigError(ValueError):
    """A config file, a layout or a command-line value is unusable."""
