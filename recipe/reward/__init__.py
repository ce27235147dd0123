"""Rewards: built-in scorers (DAPO math ``math_dapo``, ``gsm8k``, boxed MATH ``boxed``) picked by
``data_source`` (``dispatch``), a user's reward function loaded from a file (``user``), DAPO's
overlong penalty (``overlong``), and the batch API the trainer calls on the driver (``batch``).

    reward_fn = make_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)  # at start
    out = compute_rewards(inputs, reward_fn, max_response_length, OverlongConfig(...))            # every step

Every error is a ``RewardError`` (a ValueError, in ``errors``) whose message names the sample or
setting and the fix.
"""

from .batch import RewardFn, RewardInput, RewardOutput, compute_rewards, make_reward_fn, score_responses
from .dispatch import answer_extractor, default_compute_score
from .errors import RewardConfigError, RewardError, RewardFunctionError
from .overlong import OverlongConfig, overlong_penalty
from .user import load_reward_function

__all__ = [
    "OverlongConfig",
    "RewardConfigError",
    "RewardError",
    "RewardFn",
    "RewardFunctionError",
    "RewardInput",
    "RewardOutput",
    "answer_extractor",
    "compute_rewards",
    "default_compute_score",
    "load_reward_function",
    "make_reward_fn",
    "overlong_penalty",
    "score_responses",
]
