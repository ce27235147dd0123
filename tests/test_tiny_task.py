"""The built-in tiny task: tokenizer, rows, parquet, warm-up, the cached build, and that RL lifts it."""

import os
import random
import statistics
import re

import jinja2
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from loss import PolicyLossSettings
from loss.policy import compute_policy_loss
from megatron_bridge.plan.model_spec import load_hf_config
from megatron_bridge.weights.hf_checkpoint import HFCheckpoint
from recipe.config import BUILTIN_TASKS, builtin_task, load_config
from recipe.data import tiny_task
from recipe.driver.advantage import grpo_advantages, token_advantages
from recipe.reward.math_dapo import compute_score
from recipe.rollout.base import SamplingParams
from recipe.rollout.hf_engine import HFEngine


TINY_CACHE = tiny_task.TASKS["tiny"].cache_version  # the one-digit task's cache entries start with it


def dapo_score(response: str, ground_truth: str) -> float:
    return compute_score(response, ground_truth)["score"]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model runs fastest on one torch thread (see tiny_task._one_thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_specials_match_the_tiny_model_and_text_round_trips(tmp_path):
    tokenizer = tiny_task.build_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>", "<|system|>"]) == [5, 6, 4]
    assert len(tokenizer) == 7 + 96 <= 512

    text = "after 3?\n Answer: 4 ~{}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tokenizer.decode(ids) == text
    # a response as the engine returns it: EOS last; the reward sees the text without it
    response = tokenizer.encode("Answer: 4", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(response, skip_special_tokens=True) == "Answer: 4"
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(text, add_special_tokens=False) == ids
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.apply_chat_template(user("after 3?"), add_generation_prompt=True, tokenize=False) == (
        "<|user|>after 3?<|assistant|>"
    )


def test_chat_template_renders_roles_and_refuses_unknown_ones():
    tokenizer = tiny_task.build_tokenizer()
    prompt = tokenizer.apply_chat_template(user("after 3?"), add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>after 3?<|assistant|>"
    assert tokenizer.encode(prompt, add_special_tokens=False) == [5, *tokenizer.encode("after 3?"), 6]
    conversation = [
        {"role": "system", "content": "be brief"},
        *user("after 3?"),
        {"role": "assistant", "content": "Answer: 4"},
    ]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == (
        "<|system|>be brief<|user|>after 3?<|assistant|>Answer: 4<eos>"
    )
    with pytest.raises(jinja2.TemplateError, match="role must be system, user or assistant, got tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


# -- rows and parquet --------------------------------------------------------------------------


def test_task_rows_are_verl_rows_with_correct_ground_truths():
    tokenizer = tiny_task.build_tokenizer()
    rows = tiny_task.task_rows(200, seed=3, split="train")
    assert [row["extra_info"] for row in rows] == [{"split": "train", "index": i} for i in range(200)]
    digits = set()
    for row in rows:
        assert row["data_source"] == "math_dapo" and row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule"
        [message] = row["prompt"]
        assert message["role"] == "user"
        digit = int(re.fullmatch(r"after (\d)\?", message["content"])[1])
        assert row["reward_model"]["ground_truth"] == str(digit + 1)
        digits.add(digit)
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) <= 16
    assert digits == set(range(9))
    # DAPO's reward scores the format the warm-up teaches
    assert dapo_score(tiny_task.response_text("4"), "4") == 1.0
    assert dapo_score(tiny_task.response_text("5"), "4") == -1.0

    assert tiny_task.task_rows(200, seed=3, split="train") == rows
    assert tiny_task.task_rows(200, seed=4, split="train") != rows
    assert [r["prompt"] for r in tiny_task.task_rows(200, seed=3, split="test")] != [r["prompt"] for r in rows]


@pytest.mark.parametrize("n, split", [(0, "train"), (2.0, "train"), (True, "train"), (3, "")])
def test_task_rows_refuse_bad_arguments(n, split):
    with pytest.raises(tiny_task.TinyTaskError, match="task_rows"):
        tiny_task.task_rows(n, seed=0, split=split)


def test_write_parquet_round_trips_and_replaces_atomically(tmp_path, monkeypatch):
    path = tmp_path / "train.parquet"
    rows = tiny_task.task_rows(10, seed=0, split="train")
    tiny_task.write_parquet(rows, path)
    assert pq.read_table(path).to_pylist() == rows
    assert os.listdir(tmp_path) == ["train.parquet"]

    def fail_midway(table, where):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(tiny_task.pq, "write_table", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        tiny_task.write_parquet(tiny_task.task_rows(3, seed=1, split="train"), path)
    assert pq.read_table(path).to_pylist() == rows  # the old file, whole
    assert os.listdir(tmp_path) == ["train.parquet"]  # no temp file left

    with pytest.raises(tiny_task.TinyTaskError, match="no rows"):
        tiny_task.write_parquet([], tmp_path / "empty.parquet")


# -- warm-up and the cached build ---------------------------------------------------------------


def test_warm_up_is_deterministic_and_leaves_the_global_rng_alone():
    tokenizer = tiny_task.build_tokenizer()
    rng_state, threads = torch.random.get_rng_state(), torch.get_num_threads()
    first, second, other = (tiny_task.build_model(seed) for seed in (0, 0, 1))
    losses = [
        tiny_task.warm_up(model, tokenizer, steps=3, seed=seed) for model, seed in ((first, 0), (second, 0), (other, 1))
    ]
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    assert torch.get_num_threads() == threads
    assert losses[0] == losses[1] != losses[2]
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_prepare_builtin_builds_once_and_the_engine_loads_it(tmp_path, capsys):
    task = tiny_task.prepare_builtin(tmp_path, seed=0, warmup_steps=2)
    assert "tiny task: built" in capsys.readouterr().out
    assert os.path.basename(os.path.dirname(task.model_dir)) == f"{TINY_CACHE}_seed0_warmup2"
    assert sorted(os.listdir(tmp_path)) == [f"{TINY_CACHE}_seed0_warmup2"]  # no temp directory left
    weights = os.path.join(task.model_dir, "model.safetensors")
    built_at = os.stat(weights).st_mtime_ns

    again = tiny_task.prepare_builtin(tmp_path, seed=0, warmup_steps=2)
    assert again == task and capsys.readouterr().out == ""
    assert os.stat(weights).st_mtime_ns == built_at

    assert pq.read_table(task.train_file).num_rows == tiny_task.TRAIN_ROWS
    assert pq.read_table(task.val_file).to_pylist() == tiny_task.task_rows(tiny_task.VAL_ROWS, 0, "test")
    with HFCheckpoint(task.model_dir) as checkpoint:  # Hub names, as the Megatron loader reads them
        assert checkpoint.shape("model.layers.3.mlp.experts.7.down_proj.weight") == (64, 32)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    engine = HFEngine(task.model_dir, load_from_checkpoint=True)
    prompt = tokenizer.apply_chat_template(user("after 3?"), add_generation_prompt=True)["input_ids"]
    generation = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert 1 <= len(generation.token_ids[0]) <= 12


def test_prepare_builtin_builds_other_tiny_shapes_apart(tmp_path):
    task = tiny_task.prepare_builtin(tmp_path, seed=0, warmup_steps=1, model="tiny_qwen3_moe_32e")
    assert task.model_dir.endswith(f"{TINY_CACHE}_seed0_warmup1_tiny_qwen3_moe_32e/model")
    with HFCheckpoint(task.model_dir) as checkpoint:
        assert checkpoint.shape("model.layers.0.mlp.experts.31.down_proj.weight") == (64, 8)
        assert checkpoint.shape("model.layers.0.mlp.gate.weight") == (32, 64)
    with pytest.raises(tiny_task.TinyTaskError, match="tiny models only .* not 'qwen3_30b_a3b'"):
        tiny_task.prepare_builtin(tmp_path, seed=0, model="qwen3_30b_a3b")


def test_the_deep_shape_is_deeper_and_routes_like_qwen3_30b():
    """tiny_qwen3_moe_deep: twice the layers of the tiny model and Qwen3-30B-A3B's ratio of experts
    to routed experts (128 / 8), with the expert width of tiny_qwen3_moe_32e."""
    deep, tiny, wide, big = (load_hf_config(n) for n in ("tiny_qwen3_moe_deep", tiny_task.TINY,
                                                          "tiny_qwen3_moe_32e", "qwen3_30b_a3b"))
    assert deep["num_hidden_layers"] == 2 * tiny["num_hidden_layers"] == 8
    assert deep["num_experts"] / deep["num_experts_per_tok"] == big["num_experts"] / big["num_experts_per_tok"] == 16
    assert deep["moe_intermediate_size"] == wide["moe_intermediate_size"]


def test_prepare_builtin_refuses_an_incomplete_cache(tmp_path):
    (tmp_path / f"{TINY_CACHE}_seed0_warmup1").mkdir()
    with pytest.raises(tiny_task.TinyTaskError, match="incomplete .* delete it and run again"):
        tiny_task.prepare_builtin(tmp_path, seed=0, warmup_steps=1)
    with pytest.raises(tiny_task.TinyTaskError, match="warmup_steps must be an int >= 1, got 0"):
        tiny_task.prepare_builtin(tmp_path, seed=0, warmup_steps=0)
    with pytest.raises(tiny_task.TinyTaskError, match="seed must be an int >= 0, got -1"):
        tiny_task.prepare_builtin(tmp_path, seed=-1)


@pytest.fixture(scope="module", params=[tiny_task.TINY, "tiny_qwen3_moe_deep"])
def warmed_up(request, tmp_path_factory):
    """The full built-in task and its tokenizer, on the tiny model and on the deeper, wider one of
    the stability presets (8 layers, 64 experts top-4)."""
    task = tiny_task.prepare_builtin(tmp_path_factory.mktemp("cache"), seed=0, model=request.param)
    return task, AutoTokenizer.from_pretrained(task.model_dir)


def prompt_ids(tokenizer, rows) -> list[list[int]]:
    return [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"] for row in rows]


def test_warmed_up_model_answers_in_format_at_chance(warmed_up):
    task, tokenizer = warmed_up
    rows = pq.read_table(task.val_file).to_pylist()
    engine = HFEngine(task.model_dir, load_from_checkpoint=True)
    generation = engine.generate(prompt_ids(tokenizer, rows), SamplingParams(temperature=0, max_tokens=12))
    texts = tokenizer.batch_decode(generation.token_ids, skip_special_tokens=True)
    in_format = sum(bool(re.fullmatch(r"Answer: \d", text)) for text in texts) / len(texts)
    correct = sum(dapo_score(t, r["reward_model"]["ground_truth"]) > 0 for t, r in zip(texts, rows)) / len(texts)
    assert in_format >= 0.9
    assert correct <= 0.35  # chance is 1/10 a prompt; greedy decoding is right or wrong for all of a digit's prompts

    # sampled at temperature 1, as RL starts: near chance, so the score mean starts near -0.8
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=0)
    generation = engine.generate(prompt_ids(tokenizer, rows) * 2, sampling)
    texts = tokenizer.batch_decode(generation.token_ids, skip_special_tokens=True)
    scores = [dapo_score(t, r["reward_model"]["ground_truth"]) for t, r in zip(texts, rows * 2)]
    assert sum(scores) / len(scores) < -0.6


def grpo_run(task, tokenizer, *, steps: int, lr: float, max_tokens: int) -> tuple[list[float], list[float]]:
    """A plain on-policy GRPO loop with the tiny recipe's settings (16 prompts x 8 samples at
    temperature 1, one Adam step per RL step) on a built task; each step's score mean and mean
    response length (tokens, EOS included)."""
    rows = pq.read_table(task.train_file).to_pylist()
    engine = HFEngine(task.model_dir, load_from_checkpoint=True)
    model = engine.model.requires_grad_(True)  # sample from and train the same weights: on-policy
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rng, samples = random.Random(0), 8
    means, lengths = [], []
    for step in range(steps):
        batch = rng.sample(rows, 16)
        prompts = [p for p in prompt_ids(tokenizer, batch) for _ in range(samples)]
        sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=step)
        responses = engine.generate(prompts, sampling).token_ids
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        truths = [row["reward_model"]["ground_truth"] for row in batch for _ in range(samples)]
        scores = torch.tensor([dapo_score(t, g) for t, g in zip(texts, truths)])
        means.append(scores.mean().item())
        lengths.append(sum(map(len, responses)) / len(responses))
        advantages = grpo_advantages(scores, torch.arange(len(batch)).repeat_interleave(samples))

        # prompt + response, right-padded; the mask marks the response tokens, as targets of the previous position
        width = max(len(p) + len(r) for p, r in zip(prompts, responses))
        ids = torch.tensor([p + r + [0] * (width - len(p) - len(r)) for p, r in zip(prompts, responses)])
        mask = torch.tensor([[0.0] * len(p) + [1.0] * len(r) + [0.0] * (width - len(p) - len(r))
                             for p, r in zip(prompts, responses)])[:, 1:]
        logits = model(input_ids=ids).logits[:, :-1].float()
        log_prob = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        loss, _ = compute_policy_loss(
            "vanilla", log_prob.detach(), log_prob, token_advantages(advantages, mask), mask,
            PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28),
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return means, lengths


def test_grpo_lifts_the_score(warmed_up):
    """16 RL steps at lr 2e-3 on the warmed-up model. Six sampling seeds rose by 0.75 to 1.3 from the
    first 4 steps' mean to the last 4's; the deeper model's seed 0 by 0.96 (-0.70 to 0.26)."""
    task, tokenizer = warmed_up
    means, _ = grpo_run(task, tokenizer, steps=16, lr=2e-3, max_tokens=12)
    first, last = sum(means[:4]) / 4, sum(means[-4:]) / 4
    assert first < -0.3 and last > first + 0.5, means


# -- the long task -------------------------------------------------------------------------------


def test_builtin_names_are_the_tasks():
    assert set(tiny_task.TASKS) == set(BUILTIN_TASKS)
    assert builtin_task("builtin:tiny_long") == "tiny_long" and builtin_task("builtin:tiny") == "tiny"
    assert builtin_task("builtin:other") is None and builtin_task("data/builtin:tiny") is None
    with pytest.raises(tiny_task.TinyTaskError, match="no built-in task 'other'; there are tiny, tiny_long, tiny_long_tail"):
        tiny_task.task_rows(1, seed=0, split="train", task="other")


def worked_rows(task: str, n: int, seed: int) -> tuple[list[int], list[int]]:
    """``n`` train rows of a worked-out task, each checked against the question its generator draws
    (prompt, ground truth, a right response DAPO scores +1): their digit counts and response tokens."""
    tokenizer = tiny_task.build_tokenizer()
    spec = tiny_task.TASKS[task]
    rng = random.Random(f"{spec.cache_version}/train/{seed}")  # as task_rows draws them
    digits, lengths = [], []
    for row in tiny_task.task_rows(n, seed=seed, split="train", task=task):
        [message] = row["prompt"]
        number = re.fullmatch(r"after (\d+)\?", message["content"])[1]
        assert set(number) <= set("012345678")
        assert row["reward_model"]["ground_truth"] == "".join(str(int(d) + 1) for d in number)
        question = spec.make_question(rng)
        assert question.prompt == message["content"] and dapo_score(question.response, question.answer) == 1.0
        digits.append(len(number))
        lengths.append(len(tokenizer.encode(question.response, add_special_tokens=False)))
    return digits, lengths


def test_long_task_rows_are_worked_out_digit_by_digit():
    digits, lengths = worked_rows("tiny_long", 200, seed=3)
    assert 5 <= min(digits) and max(digits) <= 8
    assert min(lengths) == 38 and max(lengths) == 56  # tens of tokens, one per character
    assert tiny_task.make_long_question(random.Random(1)) == tiny_task.Question(
        "after 141777?", answer="252888", response="1>2, 4>5, 1>2, 7>8, 7>8, 7>8. Answer: 252888"
    )


def test_long_tail_task_rows_are_mostly_short_and_a_few_long():
    """1 + floor(20 u^3) digits: P(n <= 3) = (3/20)^(1/3) = 0.531, P(n >= 14) = 1 - (13/20)^(1/3) = 0.134."""
    digits, lengths = worked_rows("tiny_long_tail", tiny_task.TRAIN_ROWS, seed=0)
    assert min(digits) == 1 and max(digits) == 20 and statistics.median(digits) <= 3
    assert sum(n <= 3 for n in digits) / len(digits) == pytest.approx(0.531, abs=0.03)
    assert sum(n >= 14 for n in digits) / len(digits) == pytest.approx(0.134, abs=0.02)
    assert min(lengths) == 14 and max(lengths) == 128  # 6 tokens a digit and 8


@pytest.fixture(scope="module")
def warmed_up_long(tmp_path_factory):
    task = tiny_task.prepare_builtin(tmp_path_factory.mktemp("cache"), seed=0, task="tiny_long")
    return task, AutoTokenizer.from_pretrained(task.model_dir)


def test_grpo_lifts_the_long_task(warmed_up_long):
    """30 RL steps at lr 1e-3 on the long task. The builds of seeds 0-4 rose by 0.29 to 0.56 from the
    first 5 steps' mean to the last 5's (seed 0: 0.47, from -0.18 to 0.29; 0.45 with
    ATEN_CPU_CAPABILITY=default); with lr 0, on the same prompts, seeds 0-2 moved by -0.22, -0.04
    and +0.02."""
    task, tokenizer = warmed_up_long
    means, lengths = grpo_run(task, tokenizer, steps=30, lr=1e-3, max_tokens=64)
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert last > first + 0.2, means
    assert min(lengths) > 35, lengths  # responses stay worked out, tens of tokens


def test_the_long_preset_runs_the_long_task(warmed_up_long, monkeypatch):
    task, _ = warmed_up_long
    monkeypatch.setenv("MOE_RL_CACHE", os.path.dirname(os.path.dirname(task.model_dir)))  # the fixture's build
    cfg = load_config("tiny_long")
    assert tiny_task.resolve_builtin(cfg) == (task.model_dir, [task.train_file], [task.val_file])
    # data alone from the built-in task, the model from elsewhere
    cfg = load_config("tiny_long", ["actor_rollout_ref.model.path=some/checkpoint"])
    assert tiny_task.resolve_builtin(cfg)[0] == "some/checkpoint"


def long_answers(task, tokenizer, temperature: float) -> tuple[float, float]:
    """The shares of worked-out responses in the format and of right answers, over the validation
    prompts twice."""
    rows = pq.read_table(task.val_file).to_pylist() * 2
    engine = HFEngine(task.model_dir, load_from_checkpoint=True)
    sampling = SamplingParams(temperature=temperature, max_tokens=64, seed=0)
    responses = engine.generate(prompt_ids(tokenizer, rows), sampling).token_ids
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    in_format = sum(bool(re.fullmatch(r"(\d>\d, )*\d>\d\. Answer: \d+", text)) for text in texts) / len(texts)
    correct = sum(dapo_score(t, r["reward_model"]["ground_truth"]) > 0 for t, r in zip(texts, rows)) / len(texts)
    return in_format, correct


def test_long_warm_up_leaves_the_procedure_half_learned(warmed_up_long):
    """Right often enough for RL to have a signal, far from always. The builds of seeds 0-4: greedy
    in format 0.98 to 1.0 and right 0.64 to 0.97; sampled at temperature 1 (as RL starts) in format
    0.63 to 0.75 and right 0.24 to 0.67 (seed 0: 0.45; 0.46 with ATEN_CPU_CAPABILITY=default)."""
    task, tokenizer = warmed_up_long
    in_format, correct = long_answers(task, tokenizer, temperature=0.0)
    assert in_format >= 0.9 and correct >= 0.5
    in_format, correct = long_answers(task, tokenizer, temperature=1.0)
    assert in_format >= 0.5 and 0.25 <= correct <= 0.7
