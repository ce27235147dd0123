"""DAPO's overlong reward shaping: a penalty that grows linearly over the last ``len`` tokens
before the response limit (verl's ``reward_manager/dapo.py``, ``overlong_buffer``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import RewardConfigError


@dataclass(frozen=True)
class OverlongConfig:
    enable: bool = False
    len: int = 0  # buffer tokens at the end of max_response_length where the penalty ramps up
    penalty_factor: float = 1.0  # the penalty at max_response_length

    def __post_init__(self):
        if not self.enable:
            return
        if self.len < 1:
            raise RewardConfigError(
                f"reward_model.overlong_buffer.len is {self.len}; with overlong_buffer.enable it must be >= 1 tokens"
            )
        if not (math.isfinite(self.penalty_factor) and self.penalty_factor >= 0):
            raise RewardConfigError(
                f"reward_model.overlong_buffer.penalty_factor is {self.penalty_factor}; it must be a finite number >= 0 "
                "(a negative factor would reward overlong responses)"
            )


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """0 up to ``max_response_length - buffer_len`` tokens, then -penalty_factor per buffer_len
    tokens beyond it: -penalty_factor at ``max_response_length``."""
    if not 1 <= buffer_len <= max_response_length:
        raise RewardConfigError(
            f"reward_model.overlong_buffer.len is {buffer_len} but must be between 1 and max_response_length "
            f"({max_response_length}); shorten the buffer or raise the response length"
        )
    excess = response_length - (max_response_length - buffer_len)
    return -excess / buffer_len * penalty_factor if excess > 0 else 0.0
