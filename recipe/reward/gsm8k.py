"""GSM8K's reward: the number after ``####`` (strict) or the last number (flexible).

Same semantics as verl's ``verl/utils/reward_score/gsm8k.py``: only the last 300 characters are
searched, the answer must equal the ground truth string exactly, a wrong answer scores
``format_score`` (0.0 by default) and a missing one 0.0. The flexible method differs from verl's:
it drops thousands separators as the strict one does and the sentence's full stop ("is 1,000."
-> "1000"; verl's "1,000." never matched), and skips matches without a digit ("...", ",").
"""

from __future__ import annotations

import re

TAIL_CHARS = 300  # the final answer is at the end; long responses make the regex slow
METHODS = ("strict", "flexible")

_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_DIGIT = re.compile(r"[0-9]")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The response's final answer without commas, or None when it has none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k extraction method {method!r} is unknown; use one of {', '.join(METHODS)}")
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        found = [answer.replace(",", "") for answer in _STRICT_ANSWER.findall(tail)]
    else:
        found = [number.replace(",", "").rstrip(".") for number in _NUMBER.findall(tail) if _DIGIT.search(number)]
    return found[-1] if found else None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one, 0.0 for none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
