"""The reward errors: one base class the trainer catches and prints, without a traceback."""

from megatron_bridge.errors import UserError


class RewardError(UserError, ValueError):
    """A sample cannot be scored; the message names the sample or setting and the fix."""


class RewardConfigError(RewardError):
    """The reward settings are wrong (unknown data_source, bad custom reward function, bad overlong buffer)."""


class RewardFunctionError(RewardError):
    """A reward function raised or returned something that is not a finite score for one sample."""
