"""DAPO's math reward: the last ``Answer:`` line of the response, normalised as Minerva does.

Same semantics as verl's ``verl/utils/reward_score/math_dapo.py`` (the default, non-strict-box
path), so scores carry over: only the last 300 characters are searched, the answer and the
ground truth go through the same normalisation, and the reward is +1.0 / -1.0.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300  # the answer line is at the end; the longest MATH-500 answer has 159 characters
NO_ANSWER = "[INVALID]"  # the prediction reported when the response has no Answer: line

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalisation tables (Lewkowycz et al. 2022, appendix D). They are plain substring
# edits, applied in this order; keeping them identical keeps the scores identical to verl's.
_REPLACEMENTS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DELETIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# (pattern, replacement) pairs run after the tables: keep the first $...$, unwrap text-like
# macros, and spell out shorthand such as \frac12 -> \frac{1}{2} and \sqrt2 -> \sqrt{2}.
_REWRITES = tuple(
    (re.compile(pattern), replacement)
    for pattern, replacement in (
        (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),
        (r"(\\text\{)(.*?)(\})", r"\2"),
        (r"(\\textbf\{)(.*?)(\})", r"\2"),
        (r"(\\overline\{)(.*?)(\})", r"\2"),
        (r"(\\boxed\{)(.*)(\})", r"\2"),
        (r"(frac)([^{])(.)", r"frac{\2}{\3}"),
        (r"(sqrt)([^{])", r"sqrt{\2}"),
    )
)


def normalize_final_answer(answer: str) -> str:
    """The right-hand side of the last ``=``, stripped of units, dollar signs and TeX wrappers."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for unwanted in _DELETIONS:
        answer = answer.replace(unwanted, "")
    for pattern, replacement in _REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # 1,000 -> 1000, only for plain integers
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(solution_str: str) -> str | None:
    """The normalised answer of the response's last ``Answer:`` line, or None when it has none."""
    answers = _ANSWER_LINE.findall(solution_str[-TAIL_CHARS:])
    return normalize_final_answer(answers[-1]) if answers else None


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """``{"score": +1.0 or -1.0, "acc": bool, "pred": normalised answer or NO_ANSWER}``."""
    pred = extract_answer(solution_str)
    if pred is None:
        return {"score": -1.0, "acc": False, "pred": NO_ANSWER}
    correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
