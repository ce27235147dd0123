"""The built-in rewards, picked by the sample's ``data_source`` as verl's ``default_compute_score``."""

from __future__ import annotations

from collections.abc import Callable

from . import boxed, gsm8k, math_dapo
from .errors import RewardConfigError, RewardError

Scorer = Callable[[str, str], "float | dict"]  # (response, ground truth) -> score or {"score": ..., ...}
Extractor = Callable[[str], "str | None"]  # response -> its final answer as the scorer compares it, or None

DAPO_SOURCES = ("math_dapo",)
DAPO_PREFIXES = ("aime",)  # aime_2024, aime25, ... (DAPO's evaluation sets)
GSM8K_SOURCES = ("openai/gsm8k",)
BOXED_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


def builtin_scorer(data_source: str) -> Scorer:
    if data_source in DAPO_SOURCES or data_source.startswith(DAPO_PREFIXES):
        return math_dapo.compute_score
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score
    if data_source in BOXED_MATH_SOURCES:
        return boxed.compute_score
    known = [*DAPO_SOURCES, *(f"{prefix}*" for prefix in DAPO_PREFIXES), *GSM8K_SOURCES, *BOXED_MATH_SOURCES]
    raise RewardConfigError(
        f"no built-in reward for data_source {data_source!r} (built-in: {', '.join(known)}); "
        "write a reward function fn(data_source, solution_str, ground_truth, extra_info) and set "
        "custom_reward_function.path=/path/to/reward.py custom_reward_function.name=<function name>"
    )


def _boxed_answer(solution_str: str) -> str | None:
    answer = boxed.last_boxed(solution_str)
    return None if answer is None else boxed.normalize_math_answer(answer)


# what each built-in scorer reads from a response, in the form it compares with the ground truth
_EXTRACTORS: dict[Scorer, Extractor] = {
    math_dapo.compute_score: math_dapo.extract_answer,
    gsm8k.compute_score: gsm8k.extract_solution,
    boxed.compute_score: _boxed_answer,
}


def answer_extractor(data_source: str) -> Extractor | None:
    """The final-answer extraction of the built-in reward for ``data_source`` (two responses with the
    same answer get the same score: majority votes count these); None when no built-in reward
    scores ``data_source``."""
    try:
        return _EXTRACTORS[builtin_scorer(data_source)]
    except RewardConfigError:
        return None


def default_compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
    """The built-in reward for ``data_source``: a float, or a dict with "score" (DAPO adds "acc", "pred")."""
    scorer = builtin_scorer(data_source)
    if not ground_truth:
        raise RewardError(f"the built-in reward for data_source {data_source!r} needs a ground truth; the sample has none")
    return scorer(solution_str, ground_truth)
