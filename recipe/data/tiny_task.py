"""The built-in tiny task: what the tiny Qwen3-MoE of ``configs/model/tiny_qwen3_moe.yaml`` learns by
RL in minutes on two CPU cores.

This module owns the task's character-level tokenizer and chat template, the task and its
verl-format parquet rows, the short supervised warm-up, the cached build of all of it
(``prepare_builtin``) and what ``builtin:tiny`` in a recipe stands for (``resolve_builtin``).

The task: ``after 3?`` is answered ``Answer: 4``. Answers use DAPO's format (``data_source``
``math_dapo``), so the real DAPO reward scores them: +1 right, -1 wrong. The warm-up teaches the
format but not the answer (see ``warm_up``), so the model starts at chance. Measured on a
plain-PyTorch copy of the RL loop with the tiny recipe's settings (16 prompts x 8 samples at
temperature 1, Adam lr 2e-3, one on-policy step per RL step), 5 seeds each: the score mean goes
from -0.86 at the first step to 0.89 over steps 36-40 (worst seed 0.71) for GRPO and for GSPO.
The successor won over copying the digit (as robust, but the warm-up's probe would then read the
answer itself) and over a+b and max-of-three (whose skewed answers RL learns before the mapping).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

from megatron_bridge.tiny_model import TINY, tiny_hf_model
from recipe.config import BUILTIN_TINY, RecipeConfig
from recipe.tracking.loggers import progress_bar

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

WARMUP_STEPS = 60
WARMUP_BATCH_SIZE = 32
WARMUP_LR = 3e-3

CACHE_VERSION = "tiny_task_v2"  # bump when the task, tokenizer or warm-up changes (v1: a copy task)
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
    digit: int  # the prompt's digit: what the warm-up's probe reads (see warm_up)


def make_question(rng: random.Random) -> Question:
    """The digit after d: ``after 3?`` is answered ``4`` (d from 0 to 8, so answers are one digit)."""
    digit = rng.randrange(9)
    return Question(prompt=f"after {digit}?", answer=str(digit + 1), digit=digit)


def response_text(answer: str) -> str:
    """A response in DAPO's format for ``answer``."""
    return f"{ANSWER_PREFIX}{answer}"


def task_rows(n: int, seed: int, split: str) -> list[dict]:
    """``n`` verl rows of the task; the same (seed, split) gives the same rows."""
    _check_int(n, "task_rows: n", 1)
    if not split:
        raise TinyTaskError("task_rows: split must be a non-empty name such as 'train' or 'test'")
    rng = random.Random(f"{CACHE_VERSION}/{split}/{seed}")  # a string seed: splits draw independently
    rows = []
    for index in range(n):
        question = make_question(rng)
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
    directory = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, temp)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


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
    answer_position: torch.Tensor  # [B] the position whose next token is the answer digit
    digit: torch.Tensor  # [B] the prompt's digit


def _warmup_batch(tokenizer: PreTrainedTokenizerFast, rng: random.Random, size: int) -> _WarmupBatch:
    """Task prompts with ``Answer: <random digit>`` responses."""
    sequences, labels, answer_positions, digits = [], [], [], []
    prefix_length = len(tokenizer.encode(ANSWER_PREFIX, add_special_tokens=False))
    for _ in range(size):
        question = make_question(rng)
        messages = [{"role": "user", "content": question.prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        response_ids = tokenizer.encode(response_text(str(rng.randrange(10))), add_special_tokens=False)
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
        answer_position=torch.tensor(answer_positions),
        digit=torch.tensor(digits),
    )


def _warmup_loss(model: Qwen3MoeForCausalLM, probe: torch.nn.Linear, batch: _WarmupBatch) -> torch.Tensor:
    """Next-token loss on the response plus the probe's loss on the prompt's digit."""
    hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    logits = model.lm_head(hidden[:, :-1]).float()
    lm_loss = F.cross_entropy(logits.transpose(1, 2), batch.labels[:, 1:], ignore_index=-100)
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
    batch_size: int = WARMUP_BATCH_SIZE,
    lr: float = WARMUP_LR,
) -> float:
    """Supervised Adam steps that teach the format but not the answer; returns the last loss.

    Responses are ``Answer: <random digit>``, so the model learns the format and answers at chance.
    Alone, that also teaches it to ignore the prompt: the digit's share of the hidden state that
    writes the answer fell from 18% to 2% in 60 steps, and GRPO then reached only -0.7 to -0.2
    after 40 steps. So a linear probe, thrown away afterwards, reads the prompt's digit from that
    hidden state: the digit stays in view there, and RL only has to learn which answer it calls for.

    Runs on one torch thread (see ``_one_thread``); leaves torch's global RNG and thread count as
    they were.
    """
    _check_int(steps, "warm_up: steps", 1)
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = torch.nn.Linear(model.config.hidden_size, 10)
    optimizer = torch.optim.Adam([*model.parameters(), *probe.parameters()], lr=lr)
    model.train()
    with _one_thread():
        for _ in progress_bar(range(steps), desc="tiny task warm-up", unit="step"):
            loss = _warmup_loss(model, probe, _warmup_batch(tokenizer, rng, batch_size))
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


def _build(directory: str, seed: int, warmup_steps: int, model_name: str) -> float:
    """Write the task into the empty ``directory``; returns the final warm-up loss."""
    paths = _task_paths(directory)
    tokenizer = build_tokenizer()
    model = build_model(seed, model_name)
    loss = warm_up(model, tokenizer, steps=warmup_steps, seed=seed)
    model.eval().save_pretrained(paths.model_dir)
    tokenizer.save_pretrained(paths.model_dir)
    write_parquet(task_rows(TRAIN_ROWS, seed, "train"), paths.train_file)
    write_parquet(task_rows(VAL_ROWS, seed, "test"), paths.val_file)
    return loss


def prepare_builtin(cache_dir: str | os.PathLike, seed: int = 0, *, warmup_steps: int = WARMUP_STEPS,
                    model: str = TINY) -> BuiltinTask:
    """The warmed-up model, tokenizer and train/val parquet files under ``cache_dir``, built once.

    The build goes to a temporary directory renamed into place at the end, so a killed build never
    leaves a half-written cache. ``warmup_steps`` other than the default (tests) and ``model``
    other than the tiny one (a ``configs/model/tiny_*`` shape, e.g. more experts) get their own entries.
    """
    _check_int(seed, "prepare_builtin: seed", 0)
    _check_int(warmup_steps, "prepare_builtin: warmup_steps", 1)
    if not model.startswith(TINY):
        raise TinyTaskError(f"builtin:tiny builds tiny models only (configs/model/{TINY}*.yaml), not {model!r}; "
                            "set actor_rollout_ref.model.config to one of them or model.path to a checkpoint")
    name = (f"{CACHE_VERSION}_seed{seed}" + ("" if warmup_steps == WARMUP_STEPS else f"_warmup{warmup_steps}")
            + ("" if model == TINY else f"_{model}"))
    directory = os.path.join(os.path.abspath(cache_dir), name)
    task = _task_paths(directory)
    if os.path.exists(directory):
        if not _is_complete(task):
            raise TinyTaskError(
                f"tiny task cache {directory!r} is incomplete (not written by prepare_builtin); delete it and run again"
            )
        return task
    os.makedirs(cache_dir, exist_ok=True)
    temp = tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        start = time.perf_counter()
        loss = _build(temp, seed, warmup_steps, model)
        seconds = time.perf_counter() - start
    except BaseException:
        shutil.rmtree(temp)
        raise
    try:
        os.rename(temp, directory)
    except OSError:
        shutil.rmtree(temp)
        if not _is_complete(task):
            raise
        return task  # another process finished the same build first
    print(
        f"tiny task: built {directory} (warm-up {warmup_steps} steps in {seconds:.1f}s, final loss {loss:.3f}; "
        f"{TRAIN_ROWS} train / {VAL_ROWS} val rows)"
    )
    return task


def cache_dir() -> str:
    return os.environ.get("MOE_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "moe_rl"))


def resolve_builtin(cfg: RecipeConfig) -> tuple[str, list[str], list[str]]:
    """The model dir and data files, with ``builtin:tiny`` replaced by the built-in task's."""
    model, train, val = cfg.actor_rollout_ref.model.path, list(cfg.data.train_files), list(cfg.data.val_files)
    if BUILTIN_TINY in (model, *train, *val):
        shape = (cfg.actor_rollout_ref.model.config or TINY) if model == BUILTIN_TINY else TINY
        task = prepare_builtin(cache_dir(), seed=0, model=shape)
        model = task.model_dir if model == BUILTIN_TINY else model
        train = [task.train_file if f == BUILTIN_TINY else f for f in train]
        val = [task.val_file if f == BUILTIN_TINY else f for f in val]
    return model, train, val
