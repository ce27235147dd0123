"""The built-in tiny tasks: what the tiny Qwen3-MoE of ``configs/model/tiny_qwen3_moe.yaml`` learns
by RL in minutes on two CPU cores.

This module owns the tasks' character-level tokenizer and chat template, the tasks and their
verl-format parquet rows, the short supervised warm-up, the cached build of all of it
(``prepare_builtin``) and what ``builtin:<task>`` in a recipe stands for (``resolve_builtin``).
Answers use DAPO's format (``data_source`` ``math_dapo``), so the real DAPO reward scores them:
+1 right, -1 wrong.

``builtin:tiny``: ``after 3?`` is answered ``Answer: 4``. The warm-up teaches the format but not
the answer (see ``warm_up``), so the model starts at chance. Measured on a plain-PyTorch copy of
the RL loop with the tiny recipe's settings (16 prompts x 8 samples at temperature 1, Adam lr 2e-3,
one on-policy step per RL step), 5 seeds each: the score mean goes from -0.86 at the first step to
0.89 over steps 36-40 (worst seed 0.71) for GRPO and for GSPO. The successor won over copying the
digit (as robust, but the warm-up's probe would then read the answer itself) and over a+b and
max-of-three (whose skewed answers RL learns before the mapping).

``builtin:tiny_long``: the same successor for each of 5 to 8 digits, worked out one digit at a
time: ``after 3725?`` is answered ``3>4, 7>8, 2>3, 5>6. Answer: 4836``, 38 to 56 tokens. Each
token is an easy step, the answer is right only if every digit is. The warm-up trains on the right
responses for 100 steps, too few to learn them: at temperature 1, 24 to 67% of the answers come
out right (5 seeds), so RL has a signal from its first step (a warm-up to the format only would
leave an 8-digit answer right once in 10^8; digit chains warmed up that way barely moved in 40 RL
steps).
Measured with the CI test's loop (``tests/test_tiny_task.py``: the tiny recipe's settings, GRPO at
lr 1e-3, 30 steps) on the builds of seeds 0-4: the score mean went from -0.18, -0.07, -0.13,
-0.59, +0.04 over the first 5 steps to +0.29, +0.43, +0.16, -0.03, +0.60 over the last 5 (rises
0.29 to 0.56, mean 0.48), while with lr 0 the same prompts moved by -0.22, -0.04 and +0.02 (seeds
0-2). Mean response lengths stayed 43 to 52 tokens; a step took 1.0 to 2.2 s on one core. At lr
2e-3 one of 3 seeds broke the format (responses ran to the length limit, score -1 from step 10).

``builtin:tiny_long_tail``: ``tiny_long`` with 1 to 20 digits, drawn long-tailed (1 + floor(20 u^3):
half the prompts have 3 digits or fewer, one in seven 14 or more), 14 to 128 response tokens: a batch
ends when its longest response does, as in reasoning RL. Built for the asynchronous modes'
benchmark (docs/async.md), not tuned for learning.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from megatron_bridge.atomic import replacing
from megatron_bridge.tiny_model import TINY, tiny_hf_model
from recipe.config import RecipeConfig, builtin_task
from recipe.tracking.loggers import progress_bar

if TYPE_CHECKING:  # the modelling code takes seconds to import; a run whose build is cached never needs it
    from transformers import Qwen3MoeForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# ids 0, 1, 2 are the tiny model's pad / bos / eos
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS.values())
CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))  # newline and printable ASCII

# One line: a role token, the content, EOS after an assistant turn; unknown roles are an error
# rather than characters the model never saw.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('tiny task chat template: role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

DATA_SOURCE = "math_dapo"  # scored by DAPO's rule reward
ANSWER_PREFIX = "Answer: "  # what DAPO's reward looks for
ABILITY = "math"
TRAIN_ROWS, VAL_ROWS = 4096, 64

WARMUP_BATCH_SIZE = 32
WARMUP_LR = 3e-3

LONG_MIN_DIGITS, LONG_MAX_DIGITS = 5, 8  # the long task's responses: 38 to 56 characters
TAIL_MAX_DIGITS = 20  # the long-tail task's: 1 + floor(20 u^3) digits, 14 to 128 characters
MODEL_SUBDIR = "model"


class TinyTaskError(ValueError):
    """Bad input to the tiny task or an unusable cache; the message names it and the fix."""


def _check_int(value, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TinyTaskError(f"{name} must be an int >= {minimum}, got {value!r}")


# -- tokenizer ---------------------------------------------------------------------------------


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (newline and printable ASCII), the special tokens first, no BOS or EOS
    added on encode: the chat template writes the whole prompt."""
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # characters back to back, no separator
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=1024,  # the tiny model's max_position_embeddings
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# -- the task ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    prompt: str  # the user message
    answer: str  # the ground truth DAPO's reward compares with
    response: str  # a right response, in DAPO's format
    digit: int | None = None  # the prompt's digit, for a warm-up probe (see warm_up); None: no probe


def response_text(answer: str) -> str:
    """A response in DAPO's format for ``answer``."""
    return f"{ANSWER_PREFIX}{answer}"


def make_question(rng: random.Random) -> Question:
    """The digit after d: ``after 3?`` is answered ``4`` (d from 0 to 8, so answers are one digit)."""
    digit = rng.randrange(9)
    answer = str(digit + 1)
    return Question(prompt=f"after {digit}?", answer=answer, response=response_text(answer), digit=digit)


def make_long_question(rng: random.Random) -> Question:
    """The digit after each of 5 to 8 digits, worked out digit by digit: ``after 3725?`` is answered
    ``3>4, 7>8, 2>3, 5>6. Answer: 4836`` (digits from 0 to 8, as in ``make_question``)."""
    return _worked_question(rng, rng.randint(LONG_MIN_DIGITS, LONG_MAX_DIGITS))


def make_long_tail_question(rng: random.Random) -> Question:
    """``make_long_question`` with 1 + floor(20 u^3) digits (u uniform in [0, 1)): most responses
    short, a few long, the response lengths of the dynamic-batch benchmark's ``R u^3``."""
    return _worked_question(rng, 1 + int(TAIL_MAX_DIGITS * rng.random() ** 3))


def _worked_question(rng: random.Random, length: int) -> Question:
    digits = [rng.randrange(9) for _ in range(length)]
    work = ", ".join(f"{d}>{d + 1}" for d in digits)
    answer = "".join(str(d + 1) for d in digits)
    prompt = "after " + "".join(map(str, digits)) + "?"
    return Question(prompt=prompt, answer=answer, response=f"{work}. {response_text(answer)}")


def _random_answer(question: Question, rng: random.Random) -> str:
    """The format with a random digit: what the one-digit task's warm-up teaches."""
    return response_text(str(rng.randrange(10)))


def _right_response(question: Question, rng: random.Random) -> str:
    """The whole worked response: the long task's warm-up teaches the procedure, partly."""
    return question.response


@dataclass(frozen=True)
class Task:
    """A built-in task: what ``builtin:<name>`` in a recipe stands for."""

    name: str
    make_question: Callable[[random.Random], Question]
    warmup_response: Callable[[Question, random.Random], str]  # what the warm-up trains on
    warmup_steps: int
    probe: bool  # whether the warm-up keeps the prompt's digit readable with a probe (see warm_up)
    cache_version: str  # bump when the task, tokenizer or warm-up changes


TASKS = {
    task.name: task
    for task in (
        # tiny_task_v1 was a copy task
        Task("tiny", make_question, _random_answer, warmup_steps=60, probe=True, cache_version="tiny_task_v2"),
        Task("tiny_long", make_long_question, _right_response, warmup_steps=100, probe=False,
             cache_version="tiny_long_v1"),
        Task("tiny_long_tail", make_long_tail_question, _right_response, warmup_steps=100, probe=False,
             cache_version="tiny_long_tail_v1"),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise TinyTaskError(f"no built-in task {name!r}; there are {', '.join(TASKS)}")
    return TASKS[name]


def task_rows(n: int, seed: int, split: str, task: str = "tiny") -> list[dict]:
    """``n`` verl rows of the built-in ``task``; the same (task, seed, split) gives the same rows."""
    _check_int(n, "task_rows: n", 1)
    if not split:
        raise TinyTaskError("task_rows: split must be a non-empty name such as 'train' or 'test'")
    spec = get_task(task)
    rng = random.Random(f"{spec.cache_version}/{split}/{seed}")  # a string seed: splits draw independently
    rows = []
    for index in range(n):
        question = spec.make_question(rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question.prompt}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": question.answer},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def write_parquet(rows: list[dict], path: str | os.PathLike) -> None:
    """Write ``rows`` to ``path`` atomically: a reader sees the old file or the whole new one."""
    if not rows:
        raise TinyTaskError(f"write_parquet {os.fspath(path)!r}: no rows to write")
    table = pa.Table.from_pylist(rows)
    with replacing(path) as temp:
        pq.write_table(table, temp)


# -- warm-up -----------------------------------------------------------------------------------


def build_model(seed: int, model: str = TINY) -> Qwen3MoeForCausalLM:
    """The untrained tiny model (``configs/model/<model>.yaml``) with unit-variance weights
    (``megatron_bridge.tiny_model``); leaves torch's global RNG as it was. From transformers'
    default init (std 0.02) the same warm-up leaves RL lower and slower: GRPO's score mean over
    steps 36-40 was -0.34 instead of +0.84 (3 seeds)."""
    with torch.random.fork_rng(devices=[]):
        return tiny_hf_model(seed, model).train()


@dataclass
class _WarmupBatch:
    input_ids: torch.Tensor  # [B, T] right-padded prompt + response
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T] the response's tokens (EOS included), -100 elsewhere
    answer_position: torch.Tensor | None  # [B] the position whose next token is the answer digit (probe only)
    digit: torch.Tensor | None  # [B] the prompt's digit (probe only)


def _warmup_batch(task: Task, tokenizer: PreTrainedTokenizerFast, rng: random.Random, size: int) -> _WarmupBatch:
    """Task prompts with the task's warm-up responses."""
    sequences, labels, answer_positions, digits = [], [], [], []
    prefix_length = len(tokenizer.encode(ANSWER_PREFIX, add_special_tokens=False))
    for _ in range(size):
        question = task.make_question(rng)
        messages = [{"role": "user", "content": question.prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        response_ids = tokenizer.encode(task.warmup_response(question, rng), add_special_tokens=False)
        response_ids.append(tokenizer.eos_token_id)
        sequences.append(prompt_ids + response_ids)
        labels.append([-100] * len(prompt_ids) + response_ids)
        answer_positions.append(len(prompt_ids) + prefix_length - 1)
        digits.append(question.digit)
    width = max(map(len, sequences))
    lengths = torch.tensor([len(s) for s in sequences])
    return _WarmupBatch(
        input_ids=torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in sequences]),
        attention_mask=(torch.arange(width)[None, :] < lengths[:, None]).long(),
        labels=torch.tensor([s + [-100] * (width - len(s)) for s in labels]),
        answer_position=torch.tensor(answer_positions) if task.probe else None,
        digit=torch.tensor(digits) if task.probe else None,
    )


def _warmup_loss(model: Qwen3MoeForCausalLM, probe: torch.nn.Linear | None, batch: _WarmupBatch) -> torch.Tensor:
    """Next-token loss on the response, plus the probe's loss on the prompt's digit if there is a probe."""
    hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    logits = model.lm_head(hidden[:, :-1]).float()
    lm_loss = F.cross_entropy(logits.transpose(1, 2), batch.labels[:, 1:], ignore_index=-100)
    if probe is None:
        return lm_loss
    at_answer = hidden[torch.arange(len(hidden)), batch.answer_position]
    return lm_loss + F.cross_entropy(probe(at_answer).float(), batch.digit)


@contextmanager
def _one_thread():
    """Run torch on one thread, then restore the count. The model is too small for intra-op threads
    to pay: two threads on two cores are 2x slower than one, and 10x or more on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def warm_up(
    model: Qwen3MoeForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    *,
    steps: int,
    seed: int,
    task: str = "tiny",
    batch_size: int = WARMUP_BATCH_SIZE,
    lr: float = WARMUP_LR,
) -> float:
    """Supervised Adam steps on the built-in ``task``'s warm-up responses; returns the last loss.

    ``tiny`` is taught the format but not the answer: responses are ``Answer: <random digit>``, so
    the model answers at chance. Alone, that also teaches it to ignore the prompt: the digit's share
    of the hidden state that writes the answer fell from 18% to 2% in 60 steps, and GRPO then
    reached only -0.7 to -0.2 after 40 steps. So a linear probe, thrown away afterwards, reads the
    prompt's digit from that hidden state: the digit stays in view there, and RL only has to learn
    which answer it calls for.

    ``tiny_long`` is taught the right worked responses, but too few steps to learn them: sampled at
    temperature 1, about half of its answers are right after the warm-up, so RL has a signal from
    its first step (at chance a 5 to 8 digit answer would never be right).

    Runs on one torch thread (see ``_one_thread``); leaves torch's global RNG and thread count as
    they were.
    """
    _check_int(steps, "warm_up: steps", 1)
    spec = get_task(task)
    rng = random.Random(seed)
    probe = None
    if spec.probe:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            probe = torch.nn.Linear(model.config.hidden_size, 10)
    optimizer = torch.optim.Adam([*model.parameters(), *(probe.parameters() if probe else ())], lr=lr)
    model.train()
    with _one_thread():
        for _ in progress_bar(range(steps), desc=f"{task} task warm-up", unit="step"):
            loss = _warmup_loss(model, probe, _warmup_batch(spec, tokenizer, rng, batch_size))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return loss.item()


# -- the cached build --------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltinTask:
    model_dir: str  # HF checkpoint (Hub tensor names) and the tokenizer
    train_file: str
    val_file: str


def _task_paths(directory: str) -> BuiltinTask:
    return BuiltinTask(
        model_dir=os.path.join(directory, MODEL_SUBDIR),
        train_file=os.path.join(directory, "train.parquet"),
        val_file=os.path.join(directory, "val.parquet"),
    )


def _is_complete(task: BuiltinTask) -> bool:
    model_files = ("config.json", "model.safetensors", "tokenizer.json")
    return all(os.path.isfile(os.path.join(task.model_dir, f)) for f in model_files) and all(
        os.path.isfile(f) for f in (task.train_file, task.val_file)
    )


def _build(directory: str, seed: int, task: str, warmup_steps: int, model_name: str) -> float:
    """Write the built-in ``task`` into the empty ``directory``; returns the final warm-up loss."""
    paths = _task_paths(directory)
    tokenizer = build_tokenizer()
    model = build_model(seed, model_name)
    loss = warm_up(model, tokenizer, steps=warmup_steps, seed=seed, task=task)
    model.eval().save_pretrained(paths.model_dir)
    tokenizer.save_pretrained(paths.model_dir)
    write_parquet(task_rows(TRAIN_ROWS, seed, "train", task), paths.train_file)
    write_parquet(task_rows(VAL_ROWS, seed, "test", task), paths.val_file)
    return loss


def prepare_builtin(cache_dir: str | os.PathLike, seed: int = 0, *, task: str = "tiny",
                    warmup_steps: int | None = None, model: str = TINY) -> BuiltinTask:
    """The built-in ``task``'s warmed-up model, tokenizer and train/val parquet files under
    ``cache_dir``, built once.

    The build goes to a temporary directory renamed into place at the end, so a killed build never
    leaves a half-written cache. ``warmup_steps`` other than the task's (None; tests) and ``model``
    other than the tiny one (a ``configs/model/tiny_*`` shape, e.g. more experts) get their own entries.
    """
    spec = get_task(task)
    warmup_steps = spec.warmup_steps if warmup_steps is None else warmup_steps
    _check_int(seed, "prepare_builtin: seed", 0)
    _check_int(warmup_steps, "prepare_builtin: warmup_steps", 1)
    if not model.startswith(TINY):
        raise TinyTaskError(f"builtin:{task} builds tiny models only (configs/model/{TINY}*.yaml), not {model!r}; "
                            "set actor_rollout_ref.model.config to one of them or model.path to a checkpoint")
    name = (f"{spec.cache_version}_seed{seed}"
            + ("" if warmup_steps == spec.warmup_steps else f"_warmup{warmup_steps}")
            + ("" if model == TINY else f"_{model}"))
    directory = os.path.join(os.path.abspath(cache_dir), name)
    built = _task_paths(directory)
    if os.path.exists(directory):
        if not _is_complete(built):
            raise TinyTaskError(
                f"tiny task cache {directory!r} is incomplete (not written by prepare_builtin); delete it and run again"
            )
        return built
    os.makedirs(cache_dir, exist_ok=True)
    temp = tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        start = time.perf_counter()
        loss = _build(temp, seed, task, warmup_steps, model)
        seconds = time.perf_counter() - start
    except BaseException:
        shutil.rmtree(temp)
        raise
    try:
        os.rename(temp, directory)
    except OSError:
        shutil.rmtree(temp)
        if not _is_complete(built):
            raise
        return built  # another process finished the same build first
    print(
        f"tiny task: built {directory} (warm-up {warmup_steps} steps in {seconds:.1f}s, final loss {loss:.3f}; "
        f"{TRAIN_ROWS} train / {VAL_ROWS} val rows)"
    )
    return built


def cache_dir() -> str:
    return os.environ.get("MOE_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moe_rl"))


def resolve_builtin(cfg: RecipeConfig) -> tuple[str, list[str], list[str]]:
    """The model dir and data files, each ``builtin:<task>`` replaced by that built-in task's. The
    model's shape (``model.config``) applies when the model is built in; data alone comes with the
    tiny shape's build."""
    model = cfg.actor_rollout_ref.model
    shape = (model.config or TINY) if builtin_task(model.path) else TINY

    def resolved(path: str, pick: Callable[[BuiltinTask], str]) -> str:
        task = builtin_task(path)
        return pick(prepare_builtin(cache_dir(), seed=0, task=task, model=shape)) if task else path

    return (resolved(model.path, lambda built: built.model_dir),
            [resolved(f, lambda built: built.train_file) for f in cfg.data.train_files],
            [resolved(f, lambda built: built.val_file) for f in cfg.data.val_files])
