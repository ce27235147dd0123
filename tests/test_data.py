"""recipe.data: verl-format parquet prompts (validation, chat template, overlong prompts) and the
resumable batch sampler, with a real char-level fast tokenizer and parquet files on disk."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from recipe.data.dataset import BatchSampler, DataError, PromptDataset, val_batches

TEMPLATE = "{% for m in messages %}<|{{m.role}}|>{{m.content}}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 <>|?+="


def make_tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["[UNK]"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def row(content="what is 1+1?", ground_truth="2", data_source="toy", extra_info=None) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def write(path, rows, schema=None) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


@pytest.fixture
def tokenizer():
    return make_tokenizer()


def load(files, tokenizer, **kwargs) -> PromptDataset:
    return PromptDataset(files, tokenizer, max_prompt_length=kwargs.pop("max_prompt_length", 64), **kwargs)


def test_good_rows_render_the_chat_template(tmp_path, tokenizer):
    rows = [
        row(extra_info={"index": 7, "split": "train"}),
        {**row("hi", ground_truth="x"), "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ]
    file = write(tmp_path / "train.parquet", rows)
    data = load([file], tokenizer)
    assert len(data) == 2 and data.filtered == 0
    first, second = data[0], data[1]
    assert (first.file, first.row, first.data_source, first.ground_truth) == (file, 0, "toy", "2")
    assert first.prompt_ids == encode("<|user|>what is 1+1?<|assistant|>")
    assert first.messages == [{"role": "user", "content": "what is 1+1?"}]
    assert first.extra_info == {"index": 7, "split": "train"}
    assert second.prompt_ids == encode("<|system|>be brief<|user|>hi<|assistant|>")
    assert second.extra_info == {}  # null extra_info


def test_files_are_concatenated_in_order(tmp_path, tokenizer):
    a = write(tmp_path / "a.parquet", [row("a0"), row("a1")])
    b = write(tmp_path / "b.parquet", [row("b0")])
    data = load([a, b], tokenizer)
    assert [(s.file, s.row, s.messages[0]["content"]) for s in data] == [(a, 0, "a0"), (a, 1, "a1"), (b, 0, "b0")]


def test_numeric_ground_truth_becomes_a_string(tmp_path, tokenizer):
    assert load([write(tmp_path / "n.parquet", [row(ground_truth=72)])], tokenizer)[0].ground_truth == "72"
    assert load([write(tmp_path / "f.parquet", [row(ground_truth=0.5)])], tokenizer)[0].ground_truth == "0.5"


def test_missing_ground_truth_allowed_when_not_required(tmp_path, tokenizer):
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": "hi"}]}]
    data = load([write(tmp_path / "t.parquet", rows)], tokenizer, require_ground_truth=False)
    assert data[0].ground_truth == ""


def test_missing_and_unreadable_files(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"nope\.parquet: prompt file not found"):
        load([str(tmp_path / "nope.parquet")], tokenizer)
    text = tmp_path / "rows.parquet"
    text.write_text("not parquet")
    with pytest.raises(DataError, match=r"rows\.parquet: not a readable parquet file"):
        load([str(text)], tokenizer)


def test_missing_column(tmp_path, tokenizer):
    file = write(tmp_path / "t.parquet", [{"data_source": "toy", "question": "hi", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DataError, match=r"t\.parquet: missing column\(s\) \['prompt'\]"):
        load([file], tokenizer)
    # A custom prompt_key is the column looked up.
    with pytest.raises(DataError, match=r"missing column\(s\) \['messages'\]"):
        load([write(tmp_path / "u.parquet", [row()])], tokenizer, prompt_key="messages")


@pytest.mark.parametrize(
    "bad, field, problem",
    [
        ({"prompt": []}, "prompt", "not a non-empty list of messages"),
        ({"prompt": None}, "prompt", "not a non-empty list of messages"),
        ({"prompt": [{"role": "user"}]}, r"prompt\[0\]\.content", "is missing"),
        ({"prompt": [{"role": "user", "content": "a"}, {"content": "b"}]}, r"prompt\[1\]\.role", "is missing"),
        ({"data_source": None}, "data_source", "not a string"),
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "reward_model.ground_truth", "missing or empty"),
        ({"reward_model": {"style": "rule", "ground_truth": ""}}, "reward_model.ground_truth", "missing or empty"),
        ({"reward_model": None}, "reward_model.ground_truth", "missing or empty"),
    ],
)
def test_malformed_row_names_file_row_and_field(tmp_path, tokenizer, bad, field, problem):
    good = write(tmp_path / "good.parquet", [row()])
    bad_file = write(tmp_path / "bad.parquet", [row(), row(), {**row(), **bad}])
    with pytest.raises(DataError, match=rf"bad\.parquet: row 2: field '{field}' .*{problem}"):
        load([good, bad_file], tokenizer)


@pytest.mark.parametrize(
    "bad, field, problem",
    [
        ({"prompt": "what is 1+1?"}, "prompt", "not a non-empty list of messages"),
        ({"reward_model": {"ground_truth": ["2", "two"]}}, "reward_model.ground_truth", r"\(list\), not a string or number"),
        ({"reward_model": "2"}, "reward_model", "not a struct"),
        ({"extra_info": "split=train"}, "extra_info", "not a struct"),
        ({"data_source": 3}, "data_source", "not a string"),
    ],
)
def test_column_of_the_wrong_type(tmp_path, tokenizer, bad, field, problem):
    # A parquet column has one type, so here every row is bad and the first one is reported.
    file = write(tmp_path / "bad.parquet", [{**row(), **bad}] * 2)
    with pytest.raises(DataError, match=rf"bad\.parquet: row 0: field '{field}' .*{problem}"):
        load([file], tokenizer)


def test_messages_with_a_struct_field_only_some_have(tmp_path, tokenizer):
    """Parquet gives every message the union of keys: the absent ones come back None and are dropped."""
    rows = [{**row(), "prompt": [{"role": "user", "content": "hi", "name": "bob"}]}, row("yo")]
    data = load([write(tmp_path / "t.parquet", rows)], tokenizer)
    assert data[1].messages == [{"role": "user", "content": "yo"}]
    assert data[0].messages == [{"role": "user", "content": "hi", "name": "bob"}]


def test_tokenizer_without_chat_template(tmp_path):
    file = write(tmp_path / "t.parquet", [row()])
    with pytest.raises(DataError, match="has no chat template; the model dir needs one"):
        load([file], make_tokenizer(chat_template=None))


def test_template_that_rejects_a_row(tmp_path):
    strict = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{m.content}}{% endfor %}"
    rows = [row(), {**row(), "prompt": [{"role": "tool", "content": "x"}]}]
    with pytest.raises(DataError, match=r"t\.parquet: row 1: the chat template .* rejects the messages \(no tools\)"):
        load([write(tmp_path / "t.parquet", rows)], make_tokenizer(strict))


def test_empty_dataset(tmp_path, tokenizer):
    schema = pa.Table.from_pylist([row()]).schema
    with pytest.raises(DataError, match="have no rows"):
        load([write(tmp_path / "t.parquet", [], schema=schema)], tokenizer)
    with pytest.raises(DataError, match="non-empty list"):
        load([], tokenizer)


def test_overlong_prompts(tmp_path, tokenizer):
    # "<|user|>" + content + "<|assistant|>" is 21 characters (tokens) plus the content.
    file = write(tmp_path / "t.parquet", [row("ab"), row("abcdefgh"), row("xyz")])
    full = encode("<|user|>abcdefgh<|assistant|>")
    assert len(full) == 29

    with pytest.raises(DataError, match=r"t\.parquet: row 1: the prompt is 29 tokens, longer than max_prompt_length=24.*"
                                        r"filter_overlong_prompts=true.*truncation=left\|right"):
        load([file], tokenizer, max_prompt_length=24)

    left = load([file], tokenizer, max_prompt_length=24, truncation="left")
    right = load([file], tokenizer, max_prompt_length=24, truncation="right")
    assert left[1].prompt_ids == full[-24:] and right[1].prompt_ids == full[:24]
    assert left[0].prompt_ids == right[0].prompt_ids == encode("<|user|>ab<|assistant|>")  # short ones untouched

    kept = load([file], tokenizer, max_prompt_length=24, filter_overlong_prompts=True)
    assert kept.filtered == 1 and [(s.row, s.messages[0]["content"]) for s in kept] == [(0, "ab"), (2, "xyz")]

    with pytest.raises(DataError, match="all 3 prompts are longer than max_prompt_length=20"):
        load([file], tokenizer, max_prompt_length=20, filter_overlong_prompts=True)


def test_unknown_truncation(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"truncation='middle' is not one of \['error', 'left', 'right'\]"):
        load([write(tmp_path / "t.parquet", [row()])], tokenizer, truncation="middle")


def take(sampler: BatchSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_is_a_function_of_seed_and_epoch():
    a, b = BatchSampler(10, 3, shuffle=True, seed=5), BatchSampler(10, 3, shuffle=True, seed=5)
    assert take(a, 7) == take(b, 7)
    assert take(BatchSampler(10, 3, shuffle=True, seed=6), 3) != take(BatchSampler(10, 3, shuffle=True, seed=5), 3)


def test_sampler_epoch_rollover_drops_the_short_remainder():
    sampler = BatchSampler(10, 3, shuffle=True, seed=0)
    assert sampler.batches_per_epoch == 3
    epoch0 = take(sampler, 3)
    assert sampler.epoch == 1 and sampler.state_dict() == {"epoch": 1, "position": 0}
    seen = [i for batch in epoch0 for i in batch]
    assert len(set(seen)) == 9 and set(seen) <= set(range(10))  # 9 distinct rows, one left out
    epoch1 = take(sampler, 3)
    assert epoch1 != epoch0  # a new permutation
    assert len({i for batch in epoch1 for i in batch}) == 9


def test_sampler_keeps_the_short_batch_without_drop_last():
    sampler = BatchSampler(5, 2, shuffle=False, seed=0, drop_last=False)
    assert sampler.batches_per_epoch == 3
    assert take(sampler, 4) == [[0, 1], [2, 3], [4], [0, 1]]
    assert sampler.epoch == 1


def test_sampler_without_shuffle_is_in_order_every_epoch():
    sampler = BatchSampler(6, 2, shuffle=False, seed=3)
    assert take(sampler, 6) == [[0, 1], [2, 3], [4, 5]] * 2
    assert sampler.epoch == 2


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5])
def test_sampler_resumes_where_it_stopped(k):
    uninterrupted = BatchSampler(7, 3, shuffle=True, seed=11)
    take(uninterrupted, k)
    state = uninterrupted.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = BatchSampler(7, 3, shuffle=True, seed=11)
    resumed.load_state_dict(dict(state))
    assert resumed.epoch == uninterrupted.epoch
    assert take(resumed, 5) == take(uninterrupted, 5)


@pytest.mark.parametrize("drop_last", [True, False])
def test_sampler_state_after_any_earlier_batch(drop_last):
    """What a run that drew batches ahead checkpoints: the state before the first batch it has not
    trained on. Resumed from it, the sampler draws those batches again, across epochs too."""
    sampler = BatchSampler(7, 3, shuffle=True, seed=2, drop_last=drop_last)
    per_epoch = sampler.batches_per_epoch
    states, batches = [], []
    for _ in range(3 * per_epoch + 1):
        states.append(sampler.state_dict())
        batches.append(sampler.next_batch())
    assert sampler.drawn == len(batches)
    for drawn in range(len(batches)):
        assert sampler.state_at(drawn) == states[drawn]
        resumed = BatchSampler(7, 3, shuffle=True, seed=2, drop_last=drop_last)
        resumed.load_state_dict(sampler.state_at(drawn))
        assert resumed.drawn == drawn and take(resumed, len(batches) - drawn) == batches[drawn:]


def test_sampler_bad_settings_and_state():
    with pytest.raises(ValueError, match="batch_size=8 is larger than the dataset's 5 prompts"):
        BatchSampler(5, 8, shuffle=True, seed=0)
    sampler = BatchSampler(10, 3, shuffle=True, seed=0)
    with pytest.raises(DataError, match="is not {'epoch': int, 'position': int}"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="does not fit 10 prompts in batches of 3"):
        sampler.load_state_dict({"epoch": 0, "position": 9})  # past the last full batch
    with pytest.raises(DataError, match="does not fit"):
        sampler.load_state_dict({"epoch": 0, "position": 4})  # saved with another batch size
    assert sampler.state_dict() == {"epoch": 0, "position": 0}  # unchanged by the refused states


def test_val_batches():
    assert val_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert val_batches(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert val_batches(4, None) == [[0, 1, 2, 3]]
    assert val_batches(2, 10) == [[0, 1]]
    with pytest.raises(DataError, match="batch_size=0"):
        val_batches(4, 0)
