"""Scoring a rollout batch on the driver: the reward function per sample, checked, plus the
overlong penalty (verl's DAPO reward manager, without the tokenizer: responses arrive as text)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .dispatch import default_compute_score
from .errors import RewardConfigError, RewardError, RewardFunctionError
from .overlong import OverlongConfig, overlong_penalty
from .user import load_reward_function

RewardFn = Callable[..., "float | dict"]  # fn(data_source=, solution_str=, ground_truth=, extra_info=)

_RESPONSE_PREFIX_CHARS = 200  # how much of a response an error message quotes


@dataclass(frozen=True)
class RewardInput:
    data_source: str
    response_text: str
    ground_truth: str
    extra_info: dict
    response_length: int  # tokens
    index: int  # the sample's row in the batch, for error messages


@dataclass
class RewardOutput:
    scores: list[float]  # final reward per sample (incl. overlong penalty)
    acc: list[float]  # 1.0/0.0 correctness where the scorer reports it, else score > 0
    overlong_penalty: list[float]  # 0.0 when disabled
    # Other keys of dict results ("pred", ...), one value per sample; None where a sample lacks the key.
    extra: dict[str, list] = field(default_factory=dict)


@dataclass(frozen=True)
class _Scored:
    score: float
    acc: float
    extra: dict


def make_reward_fn(custom_path: str | None, custom_name: str = "compute_score") -> RewardFn:
    """The user's function when ``custom_path`` is set (imported now), else the built-in rewards."""
    if custom_path is None:
        return default_compute_score
    return load_reward_function(custom_path, custom_name)


def describe_function(fn: Callable) -> str:
    """The function's name and where it is defined, for error messages."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code else name


def _sample_error(fn: Callable, item: RewardInput, problem: str) -> RewardFunctionError:
    return RewardFunctionError(
        f"reward function {describe_function(fn)} on row {item.index} (data_source {item.data_source!r}, "
        f"ground truth {item.ground_truth!r}, response starting {item.response_text[:_RESPONSE_PREFIX_CHARS]!r}): {problem}"
    )


def _finite_number(value) -> float | None:
    """``value`` as a finite float; None for NaN/inf and non-numbers (strings, None, containers)."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _check_result(result, fn: Callable, item: RewardInput) -> _Scored:
    fix = "return a finite float, or a dict with a finite 'score'"
    fields = dict(result) if isinstance(result, dict) else {"score": result}
    if "score" not in fields:
        raise _sample_error(fn, item, f"returned a dict without 'score' (keys: {sorted(fields)}); {fix}")
    score = _finite_number(fields.pop("score"))
    if score is None:
        raise _sample_error(fn, item, f"returned {result!r}: the score is not a finite number; {fix}")
    if "acc" not in fields:
        return _Scored(score, float(score > 0), fields)
    acc = _finite_number(fields.pop("acc"))
    if acc is None:
        raise _sample_error(fn, item, f"returned {result!r}: acc is not a bool or number; give acc as True/False (or 1/0)")
    return _Scored(score, float(acc > 0), fields)


def _score_sample(fn: RewardFn, item: RewardInput, require_ground_truth: bool) -> _Scored:
    if require_ground_truth and not item.ground_truth:
        raise RewardError(
            f"row {item.index} (data_source {item.data_source!r}) has no ground truth; "
            "give every row reward_model.ground_truth"
        )
    try:
        result = fn(
            data_source=item.data_source,
            solution_str=item.response_text,
            ground_truth=item.ground_truth,
            extra_info=item.extra_info,
        )
    except RewardConfigError:
        raise  # a setting (e.g. an unknown data_source), not this sample: its message names the fix
    except Exception as err:
        raise _sample_error(fn, item, f"raised {type(err).__name__}: {err}") from err
    return _check_result(result, fn, item)


def _by_key(extras: list[dict]) -> dict[str, list]:
    keys = dict.fromkeys(key for extra in extras for key in extra)  # first-seen order
    return {key: [extra.get(key) for extra in extras] for key in keys}


def score_responses(samples: Sequence, response_ids: Sequence[Sequence[int]], tokenizer, reward_fn: RewardFn,
                    max_response_length: int, overlong: OverlongConfig) -> RewardOutput:
    """``compute_rewards`` of generated token ids, decoded without special tokens; ``samples[i]``
    (a ``recipe.data.dataset.PromptSample``) is the prompt row of response ``i``."""
    inputs = [
        RewardInput(data_source=s.data_source, response_text=tokenizer.decode(ids, skip_special_tokens=True),
                    ground_truth=s.ground_truth, extra_info=s.extra_info, response_length=len(ids), index=i)
        for i, (s, ids) in enumerate(zip(samples, response_ids, strict=True))
    ]
    return compute_rewards(inputs, reward_fn, max_response_length, overlong)


def compute_rewards(
    inputs: list[RewardInput],
    reward_fn: RewardFn,
    max_response_length: int,
    overlong: OverlongConfig,
    require_ground_truth: bool = True,
) -> RewardOutput:
    """Score every sample; the reward is the function's score plus the overlong penalty (if enabled).

    ``require_ground_truth=False`` lets rows without one through, for reward functions that need
    none (the data loader's setting of the same name); the built-in rewards still refuse them.
    """
    scored = [_score_sample(reward_fn, item, require_ground_truth) for item in inputs]
    penalties = [
        overlong_penalty(item.response_length, max_response_length, overlong.len, overlong.penalty_factor)
        if overlong.enable
        else 0.0
        for item in inputs
    ]
    return RewardOutput(
        scores=[sample.score + penalty for sample, penalty in zip(scored, penalties)],
        acc=[sample.acc for sample in scored],
        overlong_penalty=penalties,
        extra=_by_key([sample.extra for sample in scored]),
    )
