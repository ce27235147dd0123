"""Rewards: the built-in scorers on realistic responses, dispatch, user functions, the batch API."""

import math
import textwrap

import pytest

from recipe.reward import (
    OverlongConfig,
    RewardConfigError,
    RewardError,
    RewardFunctionError,
    RewardInput,
    compute_rewards,
    default_compute_score,
    load_reward_function,
    make_reward_fn,
    overlong_penalty,
)
from recipe.reward import boxed, gsm8k, math_dapo

DAPO_RIGHT = (
    "Let the roots be r and s. By Vieta, r + s = 7 and rs = 12, so r^2 + s^2 = 49 - 24 = 25.\n"
    "Answer: $25$"
)


# ---- DAPO math -------------------------------------------------------------------------------


def test_dapo_correct_answer_scores_plus_one():
    assert math_dapo.compute_score(DAPO_RIGHT, "25") == {"score": 1.0, "acc": True, "pred": "25"}


def test_dapo_wrong_answer_scores_minus_one():
    result = math_dapo.compute_score(DAPO_RIGHT.replace("$25$", "$24$"), "25")
    assert result == {"score": -1.0, "acc": False, "pred": "24"}


def test_dapo_no_answer_line_is_invalid():
    result = math_dapo.compute_score("So r^2 + s^2 = 25, which is the result.", "25")
    assert result == {"score": -1.0, "acc": False, "pred": math_dapo.NO_ANSWER}


def test_dapo_takes_the_last_answer_line_case_insensitively():
    response = "Answer: 10\nWait, I made an error in the sum.\nANSWER : 12\n"
    assert math_dapo.compute_score(response, "12")["acc"] is True
    assert math_dapo.compute_score(response, "10")["pred"] == "12"


def test_dapo_only_reads_the_last_300_characters():
    early_answer = "Answer: 7\n" + "x" * 300
    assert math_dapo.compute_score(early_answer, "7")["pred"] == math_dapo.NO_ANSWER
    assert math_dapo.compute_score("y" * 1000 + "\nAnswer: 7", "7")["score"] == 1.0


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("$\\frac{3}{4}$", "\\frac{3}{4}"),
        ("\\frac34", "\\frac{3}{4}"),
        ("x = 1,000", "1000"),
        ("12 \\text{ inches}", "12"),
        ("90^\\circ", "90"),
        ("\\boxed{\\sqrt2}", "\\sqrt{2}"),
        ("\\$5.50", "5.50"),
        ("\\text{(B)}", "(B)"),
    ],
)
def test_dapo_normalize_final_answer(raw, normalised):
    assert math_dapo.normalize_final_answer(raw) == normalised


def test_dapo_ground_truth_is_normalised_too():
    assert math_dapo.compute_score("Answer: 1000", "1,000")["score"] == 1.0
    assert math_dapo.compute_score("Answer: \\frac{1}{2}", "\\frac12")["score"] == 1.0


# ---- GSM8K -----------------------------------------------------------------------------------

GSM8K_RESPONSE = "Natalia sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 clips altogether.\n#### 72"


def test_gsm8k_strict_correct_and_wrong():
    assert gsm8k.compute_score(GSM8K_RESPONSE, "72") == 1.0
    assert gsm8k.compute_score(GSM8K_RESPONSE, "73") == 0.0


def test_gsm8k_strict_needs_the_marker():
    no_marker = GSM8K_RESPONSE.replace("#### 72", "The answer is 72.")
    assert gsm8k.extract_solution(no_marker) is None
    assert gsm8k.compute_score(no_marker, "72") == 0.0


def test_gsm8k_removes_thousands_separators_and_takes_the_last_marker():
    assert gsm8k.extract_solution("#### 5\nrevised: #### 1,234,567") == "1234567"
    assert gsm8k.compute_score("The total is $1,250.\n#### 1,250", "1250") == 1.0


def test_gsm8k_flexible_takes_the_last_number():
    response = "She pays 3 * 4 = 12 dollars, then 12 + 1,000 = 1,012. So she spends 1,012."
    assert gsm8k.extract_solution(response, "flexible") == "1012"
    assert gsm8k.compute_score(response, "1012", method="flexible") == 1.0
    assert gsm8k.extract_solution("no digits here...", "flexible") is None


def test_gsm8k_format_score_only_for_a_wrong_answer():
    assert gsm8k.compute_score(GSM8K_RESPONSE, "70", format_score=0.1) == 0.1
    assert gsm8k.compute_score("I don't know", "70", format_score=0.1) == 0.0


def test_gsm8k_unknown_method():
    with pytest.raises(ValueError, match="'loose'.*strict, flexible"):
        gsm8k.extract_solution(GSM8K_RESPONSE, "loose")


# ---- boxed MATH ------------------------------------------------------------------------------


def test_last_boxed_with_nested_braces():
    response = "First try \\boxed{3}. Actually the answer is $\\boxed{\\frac{1}{\\sqrt{2}}}$."
    assert boxed.last_boxed(response) == "\\frac{1}{\\sqrt{2}}"


def test_last_boxed_fbox_and_missing_or_unclosed():
    assert boxed.last_boxed("so \\fbox{x^{2}+1} it is") == "x^{2}+1"
    assert boxed.last_boxed("the answer is 4") is None
    assert boxed.last_boxed("\\boxed{\\frac{1}{2}") is None


@pytest.mark.parametrize(
    "answer, ground_truth",
    [
        ("\\dfrac{1}{2}", "\\frac12"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("x = 5", "5"),
        ("10 \\text{ cm}", "10"),
        ("\\left( 3, 4 \\right)", "(3,4)"),
        ("45^\\circ", "45"),
        ("50\\%", "50"),
        (".75", "0.75"),
        ("2\\sqrt3", "2\\sqrt{3}"),
    ],
)
def test_boxed_equivalent_spellings(answer, ground_truth):
    assert boxed.compute_score(f"The result is \\boxed{{{answer}}}.", ground_truth) == 1.0


def test_boxed_wrong_and_unboxed_score_zero():
    assert boxed.compute_score("so \\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == 0.0
    assert boxed.compute_score("so the answer is 1/2", "\\frac{1}{2}") == 0.0
    assert boxed.compute_score("\\boxed{2/4}", "\\frac{1}{2}") == 0.0  # no arithmetic, only spelling


# ---- overlong penalty ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length, penalty",
    [(100, 0.0), (3072, 0.0), (3073, -1 / 1024 * 0.5), (3584, -0.25), (4096, -0.5), (4608, -0.75)],
)
def test_overlong_penalty_ramps_over_the_buffer(length, penalty):
    # buffer [3072, 4096]: 0 before and at its start, -factor at the limit, linear past it
    assert overlong_penalty(length, 4096, 1024, 0.5) == pytest.approx(penalty, abs=1e-12)


def test_overlong_buffer_longer_than_the_limit():
    with pytest.raises(RewardConfigError, match="overlong_buffer.len is 5000.*4096"):
        overlong_penalty(10, 4096, 5000, 1.0)


def test_overlong_config_checks_only_when_enabled():
    OverlongConfig(enable=False, len=0)
    with pytest.raises(RewardConfigError, match="overlong_buffer.len is 0"):
        OverlongConfig(enable=True, len=0)
    with pytest.raises(RewardConfigError, match="penalty_factor is -1"):
        OverlongConfig(enable=True, len=16, penalty_factor=-1.0)


# ---- dispatch --------------------------------------------------------------------------------


def test_dispatch_by_data_source():
    assert default_compute_score("math_dapo", DAPO_RIGHT, "25")["score"] == 1.0
    assert default_compute_score("aime_2024", DAPO_RIGHT, "24")["score"] == -1.0
    assert default_compute_score("openai/gsm8k", GSM8K_RESPONSE, "72") == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, "\\boxed{\\dfrac{1}{2}}", "\\frac12", {}) == 1.0


def test_dispatch_unknown_data_source_names_it_and_the_fix():
    with pytest.raises(RewardConfigError) as info:
        default_compute_score("my_company/puzzles", "Answer: 3", "3")
    message = str(info.value)
    assert "'my_company/puzzles'" in message
    assert "openai/gsm8k" in message and "aime*" in message and "HuggingFaceH4/MATH-500" in message
    assert "custom_reward_function.path=" in message and "custom_reward_function.name=" in message


def test_make_reward_fn_defaults_to_the_built_ins():
    assert make_reward_fn(None) is default_compute_score


# ---- user reward functions -------------------------------------------------------------------

USER_FILE = """
from dataclasses import dataclass

@dataclass
class Verdict:
    score: float

def length_bonus(data_source, solution_str, ground_truth, extra_info=None):
    bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
    return {"score": Verdict(float(solution_str.strip() == ground_truth)).score + bonus, "chars": len(solution_str)}

def wrong_arguments(response, answer):
    return 0.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return str(path)


def test_user_function_is_loaded_and_called_with_verl_keywords(user_file):
    fn = make_reward_fn(user_file, "length_bonus")
    assert fn(data_source="x", solution_str=" 7 ", ground_truth="7", extra_info={"bonus": 0.5}) == {"score": 1.5, "chars": 3}


def test_user_file_missing(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(RewardConfigError, match=f"path={missing} custom_reward_function.name=fn: no such file"):
        load_reward_function(missing, "fn")


def test_user_function_missing_lists_the_functions(user_file):
    with pytest.raises(RewardConfigError, match=r"no 'compute_score' \(its functions: length_bonus, wrong_arguments\)"):
        load_reward_function(user_file)


def test_user_name_not_callable(user_file):
    with pytest.raises(RewardConfigError, match="'NOT_A_FUNCTION' is a int, not a function"):
        load_reward_function(user_file, "NOT_A_FUNCTION")


def test_user_function_with_wrong_parameters(user_file):
    with pytest.raises(RewardConfigError, match=r"wrong_arguments\(response, answer\) cannot be called"):
        load_reward_function(user_file, "wrong_arguments")


def test_user_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardConfigError, match="importing the file failed: ModuleNotFoundError") as info:
        load_reward_function(str(path), "fn")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


# ---- the batch API ---------------------------------------------------------------------------


def _input(index, response, ground_truth="25", data_source="math_dapo", length=10, extra_info=None):
    return RewardInput(data_source, response, ground_truth, extra_info or {}, length, index)


def test_compute_rewards_adds_the_overlong_penalty_and_reports_acc():
    inputs = [
        _input(0, DAPO_RIGHT, length=100),
        _input(1, DAPO_RIGHT, length=3584),
        _input(2, "Answer: 3", length=4096),
        _input(3, GSM8K_RESPONSE, "72", "openai/gsm8k", length=50),
    ]
    out = compute_rewards(inputs, default_compute_score, 4096, OverlongConfig(enable=True, len=1024, penalty_factor=1.0))
    assert out.overlong_penalty == [0.0, -0.5, -1.0, 0.0]
    assert out.scores == [1.0, 0.5, -2.0, 1.0]
    assert out.acc == [1.0, 1.0, 0.0, 1.0]  # from the scorer's "acc", not from the penalised score
    assert out.extra == {"pred": ["25", "25", "3", None]}


def test_compute_rewards_without_overlong_and_acc_from_score():
    inputs = [_input(0, "#### 72", "72", "openai/gsm8k", 4096), _input(1, "#### 7", "72", "openai/gsm8k", 4096)]
    out = compute_rewards(inputs, default_compute_score, 4096, OverlongConfig())
    assert (out.scores, out.acc, out.overlong_penalty, out.extra) == ([1.0, 0.0], [1.0, 0.0], [0.0, 0.0], {})


def test_a_raising_reward_function_is_reported_with_the_sample():
    def flaky_reward(data_source, solution_str, ground_truth, extra_info):
        if data_source == "puzzles":
            raise KeyError("difficulty")
        return 1.0

    response = "Step 1: consider the parity of n. " * 20
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards([_input(0, DAPO_RIGHT), _input(17, response, "42", "puzzles")], flaky_reward, 4096, OverlongConfig())
    message = str(info.value)
    assert "row 17" in message and "'puzzles'" in message and "'42'" in message
    assert "flaky_reward" in message and "test_reward.py" in message
    assert response[:200] in message and response[:201] not in message
    assert "KeyError" in message and "difficulty" in message
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, RewardError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("bad", [float("nan"), math.inf, "1.0", None, {"acc": True}, {"score": [1.0]}])
def test_a_non_numeric_or_non_finite_score_is_an_error(bad):
    with pytest.raises(RewardFunctionError, match=r"row 3 .*(not a finite number|without 'score')"):
        compute_rewards([_input(3, "Answer: 1")], lambda **kw: bad, 4096, OverlongConfig())


def test_a_bad_acc_is_an_error():
    with pytest.raises(RewardFunctionError, match="acc is not a bool"):
        compute_rewards([_input(0, "Answer: 1")], lambda **kw: {"score": 1.0, "acc": "yes"}, 4096, OverlongConfig())


@pytest.mark.parametrize("ground_truth", [None, ""])
def test_missing_ground_truth_names_the_row(ground_truth):
    with pytest.raises(RewardError, match="row 5 .*no ground truth"):
        compute_rewards([_input(5, DAPO_RIGHT, ground_truth)], default_compute_score, 4096, OverlongConfig())


def test_without_required_ground_truth_only_the_built_ins_refuse_it():
    inputs = [_input(0, "abc", "", "puzzles")]
    out = compute_rewards(inputs, lambda **kw: len(kw["solution_str"]), 4096, OverlongConfig(), require_ground_truth=False)
    assert out.scores == [3.0]
    with pytest.raises(RewardFunctionError, match="row 0 .*needs a ground truth"):
        compute_rewards([_input(0, DAPO_RIGHT, "")], default_compute_score, 4096, OverlongConfig(), require_ground_truth=False)


def test_an_unknown_data_source_in_a_batch_is_a_config_error():
    with pytest.raises(RewardConfigError, match="'puzzles'"):
        compute_rewards([_input(0, DAPO_RIGHT, data_source="puzzles")], default_compute_score, 4096, OverlongConfig())


def test_user_function_through_the_batch_api(user_file):
    fn = make_reward_fn(user_file, "length_bonus")
    out = compute_rewards([_input(0, "7", "7"), _input(1, "8", "7", extra_info={"bonus": 0.25})], fn, 4096, OverlongConfig())
    assert out.scores == [1.0, 0.25]
    assert out.acc == [1.0, 1.0]  # no "acc" reported: score > 0
    assert out.extra == {"chars": [1, 1]}


def test_user_file_that_is_not_python(tmp_path):
    path = tmp_path / "reward.txt"
    path.write_text("def compute_score(**kw): return 1.0\n")
    with pytest.raises(RewardConfigError, match="not a Python source file"):
        make_reward_fn(str(path))
