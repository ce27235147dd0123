"""The prompt dataset: verl-format parquet rows, validated and tokenised once at load, and the
seeded, resumable batch order the trainer draws them in.

A row (as verl's ``examples/data_preprocess`` scripts write it):

    data_source   str                                 which reward function scores it
    prompt        list of {"role": str, "content": str}  the chat, rendered with the model's template
    ability       str, optional                       (not used here)
    reward_model  {"ground_truth": ..., "style": ...} the reference answer the reward compares with
    extra_info    dict, optional                      passed through to the reward

Every row is checked before training starts, so a bad file fails in seconds with the file, the
row and the field, not hours later in the middle of a step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from numbers import Real

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from jinja2 import TemplateError

from megatron_bridge.errors import UserError
from recipe.tracking.loggers import progress_bar

TRUNCATIONS = ("error", "left", "right")
_PROGRESS_MIN_ROWS = 1000  # below this, tokenising is quick enough to not need a progress bar


class DataError(UserError, ValueError):
    """Bad prompt data or data settings; the message names the input (file, row, field) and the fix."""


@dataclass(frozen=True)
class PromptSample:
    file: str  # parquet file the row came from
    row: int  # 0-based row within that file
    data_source: str
    messages: list[dict]
    prompt_ids: list[int]  # the chat template's rendering with the generation prompt, maybe truncated
    ground_truth: str  # "" when the dataset was loaded with require_ground_truth=False and has none
    extra_info: dict


def _row_error(file: str, row: int, field: str, problem: str, fix: str) -> DataError:
    return DataError(f"{file}: row {row}: field '{field}' {problem}; {fix}")


def _read_table(file: str, required: list[str], optional: list[str]) -> list[dict]:
    """The file's rows as dicts of the ``required`` columns and those ``optional`` ones it has."""
    if not os.path.isfile(file):
        raise DataError(f"{file}: prompt file not found (check the data.train_files / data.val_files paths)")
    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{file}: not a readable parquet file ({err}); write it with pyarrow or datasets.to_parquet") from err
    present = set(parquet.schema_arrow.names)
    missing = [c for c in required if c not in present]
    if missing:
        raise DataError(
            f"{file}: missing column(s) {missing} (it has {sorted(present)}); "
            "write rows in verl's format (data_source, prompt, reward_model, extra_info)"
        )
    return parquet.read(columns=required + [c for c in optional if c in present]).to_pylist()


def _messages(file: str, row: int, prompt_key: str, value) -> list[dict]:
    fix = 'write it as a list of {"role": str, "content": str} chat messages'
    if not isinstance(value, list) or not value:
        raise _row_error(file, row, prompt_key, f"is {value!r}, not a non-empty list of messages", fix)
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _row_error(file, row, f"{prompt_key}[{i}]", f"is {message!r}, not a message dict", fix)
        # A parquet struct has every key any message in the column has: drop the ones this message lacks.
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                problem = f"is {message.get(key)!r}, not a string" if key in message else "is missing"
                raise _row_error(file, row, f"{prompt_key}[{i}].{key}", problem, fix)
        messages.append(message)
    return messages


def _ground_truth(file: str, row: int, reward_model, required: bool) -> str:
    field = "reward_model.ground_truth"
    if reward_model is not None and not isinstance(reward_model, dict):
        raise _row_error(file, row, "reward_model", f"is {reward_model!r}, not a struct", 'write {"ground_truth": ..., "style": ...}')
    value = None if reward_model is None else reward_model.get("ground_truth")
    if isinstance(value, Real) and not isinstance(value, bool):
        value = str(value)
    if value is None or value == "":
        if required:
            raise _row_error(
                file, row, field, "is missing or empty",
                "every row needs the reference answer its reward compares with "
                "(or set require_ground_truth=false for rewards that need none)",
            )
        return ""
    if not isinstance(value, str):
        problem = f"is {value!r} ({type(value).__name__}), not a string or number"
        raise _row_error(file, row, field, problem, "write the answer as a string")
    return value


def _read_rows(file: str, prompt_key: str, require_ground_truth: bool) -> list[PromptSample]:
    """Every row of ``file``, validated; ``prompt_ids`` are left empty for the tokenising pass."""
    required = ["data_source", prompt_key] + (["reward_model"] if require_ground_truth else [])
    optional = [c for c in ("reward_model", "extra_info") if c not in required]
    records = _read_table(file, required, optional)
    rows = []
    for i, record in enumerate(records):
        data_source = record["data_source"]
        if not isinstance(data_source, str):
            fix = "name the dataset the row comes from (it picks the reward)"
            raise _row_error(file, i, "data_source", f"is {data_source!r}, not a string", fix)
        extra_info = record.get("extra_info") or {}
        if not isinstance(extra_info, dict):
            raise _row_error(file, i, "extra_info", f"is {extra_info!r}, not a struct", "write a dict or leave it null")
        rows.append(
            PromptSample(
                file=file,
                row=i,
                data_source=data_source,
                messages=_messages(file, i, prompt_key, record[prompt_key]),
                prompt_ids=[],
                ground_truth=_ground_truth(file, i, record.get("reward_model"), require_ground_truth),
                extra_info=extra_info,
            )
        )
    return rows


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def _prompt_ids(tokenizer, row: PromptSample) -> list[int]:
    try:
        encoded = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    except TemplateError as err:
        raise DataError(
            f"{row.file}: row {row.row}: the chat template of {_tokenizer_name(tokenizer)} rejects the messages ({err}); "
            "fix the row's messages (roles, order) to what the model's template accepts"
        ) from err
    # transformers 5 returns a BatchEncoding, earlier versions a plain list of ids.
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return [int(t) for t in ids]


class PromptDataset:
    """The rows of ``files`` (concatenated in order) as ``PromptSample``s, tokenised at load.

    Prompts longer than ``max_prompt_length`` tokens are dropped (``filter_overlong_prompts``,
    counted in ``filtered``) or, otherwise, handled by ``truncation``: "error" refuses them,
    "left" keeps their last tokens, "right" their first.
    """

    def __init__(
        self,
        files: list[str],
        tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong_prompts: bool = False,
        require_ground_truth: bool = True,
    ):
        if truncation not in TRUNCATIONS:
            raise DataError(f"truncation={truncation!r} is not one of {list(TRUNCATIONS)}")
        if max_prompt_length < 1:
            raise DataError(f"max_prompt_length={max_prompt_length} must be >= 1")
        if isinstance(files, (str, os.PathLike)) or not files:
            raise DataError(f"files={files!r}: give a non-empty list of parquet files")
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"tokenizer {_tokenizer_name(tokenizer)} has no chat template; the model dir needs one "
                "(chat_template in tokenizer_config.json or a chat_template.jinja file)"
            )
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        rows = [row for file in files for row in _read_rows(str(file), prompt_key, require_ground_truth)]
        if not rows:
            raise DataError(f"the prompt files {[str(f) for f in files]} have no rows; add prompts")
        self.filtered = 0
        self._samples: list[PromptSample] = []
        progress = progress_bar(rows, desc="tokenising prompts", unit="prompt", disable=len(rows) < _PROGRESS_MIN_ROWS)
        for row in progress:
            ids = _prompt_ids(tokenizer, row)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.filtered += 1
                    continue
                ids = self._truncate(row, ids)
            self._samples.append(replace(row, prompt_ids=ids))
        if not self._samples:
            raise DataError(
                f"all {len(rows)} prompts are longer than max_prompt_length={max_prompt_length} tokens and were "
                "filtered out; raise max_prompt_length"
            )

    def _truncate(self, row: PromptSample, ids: list[int]) -> list[int]:
        limit = self.max_prompt_length
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        raise DataError(
            f"{row.file}: row {row.row}: the prompt is {len(ids)} tokens, longer than max_prompt_length={limit}; "
            "set filter_overlong_prompts=true to drop such prompts or truncation=left|right to cut them"
        )

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self._samples[i]


class BatchSampler:
    """Seeded shuffling by epoch with a resumable position.

    The order of epoch ``e`` depends only on (seed, e), so ``{"epoch", "position"}`` is all a
    checkpoint needs to continue in a fresh process exactly where training stopped. ``epoch`` is
    the epoch the next batch comes from: it advances as soon as the current one is used up.
    """

    def __init__(self, size: int, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True):
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be >= 1")
        if batch_size > size:
            raise DataError(f"batch_size={batch_size} is larger than the dataset's {size} prompts; lower the batch size or add prompts")
        self.size = size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def _epoch_end(self) -> int:
        """Where the last batch of an epoch ends (with drop_last, the short remainder is skipped)."""
        return self.size - self.size % self.batch_size if self.drop_last else self.size

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        batch = self._order[self._position : self._position + self.batch_size]
        self._position += len(batch)
        if self._position >= self._epoch_end:
            self.epoch += 1
            self._position = 0
            self._order = self._epoch_order(self.epoch)
        return batch

    @property
    def drawn(self) -> int:
        """Batches drawn since the start of epoch 0: the position as one number."""
        return self.epoch * self.batches_per_epoch + self._position // self.batch_size

    def state_at(self, drawn: int) -> dict:
        """The state after ``drawn`` batches (``state_dict`` at that point): where a run that drew
        batches ahead resumes, before the first batch it has not trained on."""
        epoch, batch = divmod(drawn, self.batches_per_epoch)
        return {"epoch": epoch, "position": batch * self.batch_size}

    def state_dict(self) -> dict:
        return self.state_at(self.drawn)

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"epoch", "position"} or not all(type(v) is int for v in state.values()):
            raise DataError(f"sampler state {state!r} is not {{'epoch': int, 'position': int}}; pass what state_dict() returned")
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position < self._epoch_end or position % self.batch_size:
            raise DataError(
                f"sampler state {state!r} does not fit {self.size} prompts in batches of {self.batch_size}; "
                "resume with the dataset and batch size the checkpoint was trained with"
            )
        self.epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)


def val_batches(size: int, batch_size: int | None) -> list[list[int]]:
    """All ``size`` rows in order, in batches of ``batch_size`` (the last may be short; None: one batch)."""
    if size < 1:
        raise DataError(f"the validation set has {size} prompts; add prompts")
    if batch_size is None:
        return [list(range(size))]
    if batch_size < 1:
        raise DataError(f"validation batch_size={batch_size} must be >= 1 (or None for one batch)")
    return [list(range(start, min(start + batch_size, size))) for start in range(0, size, batch_size)]
