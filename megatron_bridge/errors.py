"""Errors the user can act on: each names the input and the fix. ``UserError`` is their one base
class: the commands print one as a line, without a traceback (``recipe.main.run_reporting``)."""


class UserError(Exception):
    """An input, a file or the cluster is not as the run needs it; the message names it and the fix."""


class ConfigError(UserError, ValueError):
    """A config file, a layout or a command-line value is unusable."""
