"""The MATH reward: the last ``\\boxed{...}`` (or ``\\fbox{...}``) of the response against the ground truth.

Same semantics as verl's ``verl/utils/reward_score/math.py`` (Hendrycks' MATH normalisation from
lm-evaluation-harness): both answers are lightly normalised (spaces, ``\\left``/``\\right``,
``dfrac``, degrees, percent, a trailing ``\\text{ unit}``, ``\\frac12``, ``a/b``, ``x = ``) and
compared as strings; 1.0 when equal, 0.0 otherwise or when the response has no box.
"""

from __future__ import annotations

import re

_BOX_OPENERS = ("\\boxed{", "\\fbox{")

# The edits of Hendrycks' strip_string, in its order: (old, new) substring replacements.
_PLAIN_EDITS = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)
_UNIT_START = "\\text{ "  # in MATH, "\text{ " only ever starts a unit on the right
_PERCENT = "\\%"
_SQRT_SHORTHAND = re.compile(r"\\sqrt([^{])")  # \sqrt3 -> \sqrt{3}
_FRAC_SHORTHAND = re.compile(r"\\frac([^{])([^{]?)")  # \frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}
# "a/b" of two integers written canonically (no sign on 0, no leading zeros) -> \frac{a}{b}
_INTEGER_RATIO = re.compile(r"(0|-?[1-9][0-9]*)/(0|-?[1-9][0-9]*)")


def last_boxed(text: str) -> str | None:
    """What the last ``\\boxed{...}`` or ``\\fbox{...}`` holds (braces may nest), or None when
    there is none or its braces never close."""
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    content_start = text.index("{", start) + 1
    depth = 1
    for position in range(content_start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:position]
    return None


def _frac_braces(match: re.Match) -> str:
    numerator, denominator = match.groups()
    return f"\\frac{{{numerator}}}" + (f"{{{denominator}}}" if denominator else "")


def normalize_math_answer(answer: str) -> str:
    """Hendrycks' strip_string: the canonical spelling two equal MATH answers share."""
    for old, new in _PLAIN_EDITS:
        answer = answer.replace(old, new)
    answer = answer.split(_UNIT_START)[0].replace(_PERCENT, "")
    answer = answer.replace(" .", " 0.").replace("{.", "{0.")
    if answer.startswith("."):
        answer = "0" + answer
    sides = answer.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"; longer left sides are kept
        answer = sides[1]
    answer = _SQRT_SHORTHAND.sub(r"\\sqrt{\1}", answer).replace(" ", "")
    answer = _FRAC_SHORTHAND.sub(_frac_braces, answer)
    if answer == "0.5":
        return "\\frac{1}{2}"
    ratio = _INTEGER_RATIO.fullmatch(answer)
    return f"\\frac{{{ratio[1]}}}{{{ratio[2]}}}" if ratio else answer


def is_equiv(answer: str, ground_truth: str) -> bool:
    return normalize_math_answer(answer) == normalize_math_answer(ground_truth)


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last box holds the ground truth (after normalisation), else 0.0."""
    boxed = last_boxed(solution_str)
    return 1.0 if boxed is not None and is_equiv(boxed, ground_truth) else 0.0
