"""The transformers rollout engine (recipe.rollout.hf_engine) on the tiny Qwen3-MoE: weight loading
from a Hub-format stream, sampling and its log-probs against plain forward passes, sleep / wake."""

import glob

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.tiny_model import save_tiny_checkpoint, tiny_hf_model
from recipe.rollout.base import Generation, SamplingParams, WeightLoadError
from recipe.rollout.hf_engine import HFEngine
from tests.numerics import log_prob_tolerance

PROMPTS = [[5, 17, 300, 41], [9, 88, 7, 130, 250, 3, 61, 11, 400], [77]]  # different lengths: left padding
TINY = load_model_spec("tiny_qwen3_moe")


def close(log_probs, expected: torch.Tensor, seq_len: int) -> None:
    """Log-probs of one model from two passes (batched and cached or not): equal up to the
    rounding of the forward pass (tests.numerics)."""
    torch.testing.assert_close(torch.as_tensor(log_probs), expected, rtol=0,
                               atol=log_prob_tolerance(TINY, expected, seq_len))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Hub-format checkpoints (per-expert tensors) of the tiny model with seeds 0 and 1."""
    return {seed: save_tiny_checkpoint(tmp_path_factory.mktemp(f"seed{seed}"), seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def hub_tensors(checkpoints):
    """seed -> {Hub name: tensor}, as the trainer's export streams them."""
    out = {}
    for seed, directory in checkpoints.items():
        tensors = {}
        for path in sorted(glob.glob(f"{directory}/*.safetensors")):
            tensors.update(load_file(path))
        out[seed] = tensors
    return out


@pytest.fixture(scope="module")
def reference():
    """transformers' model with the weights of checkpoint 0."""
    return tiny_hf_model(0)


@pytest.fixture
def engine(checkpoints):
    return HFEngine(checkpoints[0], load_from_checkpoint=True)


def reused_buffer_stream(tensors: dict[str, torch.Tensor]):
    """Yield each tensor as a view into one buffer that is overwritten with NaN once the consumer
    asks for the next item, as a bucketed producer would reuse its buffer."""
    buffer = torch.empty(max(t.numel() for t in tensors.values()))
    for name, tensor in tensors.items():
        view = buffer[: tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        yield name, view
        buffer.fill_(float("nan"))


def snapshot(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.model.state_dict().items()}


def assert_bit_identical(before: dict[str, torch.Tensor], engine: HFEngine):
    after = engine.model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def full_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` from one forward pass over both, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / temperature
    return scaled.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation from a full forward pass per step, no cache, no padding."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


# -- load_weights -------------------------------------------------------------------------------


def test_load_weights_from_hub_stream_gives_the_streamed_model(engine, hub_tensors, reference):
    x = torch.tensor([PROMPTS[1], PROMPTS[1][::-1]])
    with torch.no_grad():
        expected = {0: reference(x).logits, 1: tiny_hf_model(1)(x).logits}
        assert torch.equal(engine.model(x).logits, expected[0])
        for seed in (1, 0, 1):  # the later loads stage into the tensors the earlier ones replaced
            stats = engine.load_weights(reused_buffer_stream(hub_tensors[seed]))
            assert torch.equal(engine.model(x).logits, expected[seed])
    tensors = hub_tensors[1]
    assert stats.tensors == len(tensors) == 135  # 4 layers x (8 experts x 3 + 9) + 3
    assert stats.bytes == sum(t.numel() * t.element_size() for t in tensors.values()) == 1_452_800


def test_load_weights_casts_to_the_engine_dtype(engine, hub_tensors):
    halved = {name: t.to(torch.bfloat16) for name, t in hub_tensors[1].items()}
    stats = engine.load_weights(halved.items())
    assert stats.bytes == 1_452_800 // 2
    expected = tiny_hf_model(1).to(torch.bfloat16).float().state_dict()
    assert_bit_identical(expected, engine)
    assert all(t.dtype == torch.float32 for t in engine.model.state_dict().values())


GATE_0_3 = "model.layers.0.mlp.experts.3.gate_proj.weight"
NORM_2 = "model.layers.2.post_attention_layernorm.weight"
ROUTER_4 = "model.layers.4.mlp.gate.weight"


@pytest.mark.parametrize(
    "corrupt, named",
    [
        (lambda items: [(n, t) for n, t in items if n != GATE_0_3], GATE_0_3),
        (lambda items: items + [(ROUTER_4, items[0][1])], ROUTER_4),  # the model has layers 0-3
        (lambda items: [(n, t[:-1] if n == NORM_2 else t) for n, t in items], NORM_2),
        (lambda items: [(n, t.T if n == GATE_0_3 else t) for n, t in items], GATE_0_3),  # [H, I], not [I, H]
        (lambda items: items[:50] + [items[20]] + items[50:], None),  # the duplicate's name is checked below
    ],
    ids=["missing", "extra", "short", "transposed", "duplicate"],
)
def test_bad_stream_raises_and_leaves_the_weights_intact(engine, hub_tensors, corrupt, named):
    engine.load_weights(hub_tensors[1].items())  # so the bad load stages into the spare tensors too
    items = list(hub_tensors[0].items())
    named = named or items[20][0]
    before = snapshot(engine)
    with pytest.raises(WeightLoadError, match=named.replace(".", r"\.")):
        engine.load_weights(corrupt(items))
    assert_bit_identical(before, engine)


def test_missing_names_are_listed_and_counted(engine, hub_tensors):
    items = [(n, t) for n, t in hub_tensors[1].items() if ".layers.3." not in n]
    # layer 3's 8 x 3 expert tensors and 9 others; the first five named in model order, then "..."
    listed = r"lacks 33 tensor\(s\): model\.layers\.3\.self_attn\.q_proj\.weight(, [^ ,]+){4}, \.\.\. \("
    with pytest.raises(WeightLoadError, match=listed):
        engine.load_weights(items)


# -- generate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 50, 0.9)])
@pytest.mark.numerics
def test_log_probs_equal_a_full_forward_pass(engine, reference, temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12, seed=3)
    out = engine.generate(PROMPTS, params)
    for prompt, response, log_probs in zip(PROMPTS, out.token_ids, out.log_probs):
        assert len(response) == len(log_probs) > 0
        expected = full_log_probs(reference, prompt, response, temperature)
        close(log_probs, expected, len(prompt) + len(response))


def test_greedy_is_the_argmax_continuation_and_batching_does_not_change_it(engine, reference):
    params = SamplingParams(temperature=0, max_tokens=10)
    batched = engine.generate(PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        expected = greedy_reference(reference, prompt, 10)
        assert batched.token_ids[i] == expected
        alone = engine.generate([prompt], params)
        assert alone.token_ids[0] == expected
        log_probs = torch.tensor(batched.log_probs[i])
        close(alone.log_probs[0], log_probs, len(prompt) + len(expected))
        # temperature 0 reports log-probs at temperature 1
        close(log_probs, full_log_probs(reference, prompt, expected, 1.0), len(prompt) + len(expected))


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6)], ids=["top_k=1", "top_p=1e-6"])
def test_sampling_filters_down_to_one_token_are_greedy(engine, filters):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=10, seed=5, **filters))
    assert sampled.token_ids == greedy.token_ids
    assert sampled.log_probs == greedy.log_probs  # both at temperature 1


def test_seed_fixes_the_sample_and_leaves_the_global_rng_alone(engine):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    rng = torch.get_rng_state()
    first = engine.generate(PROMPTS, params)
    assert torch.equal(torch.get_rng_state(), rng)
    assert engine.generate(PROMPTS, params) == first
    other = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=24, seed=12))
    assert all(a != b for a, b in zip(first.token_ids, other.token_ids))
    assert first.finish_reasons == ["length"] * 3 and [len(t) for t in first.token_ids] == [24] * 3


def test_request_ids_make_each_sample_independent_of_the_batch(engine):
    """What the trainer relies on for DP invariance: request r's sample depends on (seed, r) only."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    together = engine.generate(PROMPTS, params, request_ids=[10, 11, 12])
    apart = [engine.generate([p], params, request_ids=[10 + i]) for i, p in enumerate(PROMPTS)]
    assert together.token_ids == [a.token_ids[0] for a in apart]
    for prompt, got, alone in zip(PROMPTS, together.log_probs, apart):
        close(got, torch.tensor(alone.log_probs[0]), len(prompt) + len(got))
    shifted = engine.generate(PROMPTS, params, request_ids=[11, 12, 13])
    assert shifted.token_ids != together.token_ids
    with pytest.raises(ValueError, match="2 request ids for 3 prompts"):
        engine.generate(PROMPTS, params, request_ids=[1, 2])


@pytest.mark.numerics
def test_joined_calls_give_each_part_back_as_its_last_response_ends(engine):
    """Two calls joined into one (parts of 2 and 1 rows, as two batches of one step: one seed,
    request ids running on): each part's responses are those of its call alone (tokens exactly,
    log-probs up to rounding), given back at the token its last response ends, while the other
    part decodes on; the whole call returns both, in order."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    given, forwards = [], []
    hook = engine.model.register_forward_hook(lambda *_: forwards.append(1))
    whole = engine.generate(PROMPTS, params, request_ids=[0, 1, 2], max_tokens=[3, 4, 12], parts=[2, 1],
                            on_part=lambda i, out: given.append((i, len(forwards), out)))
    hook.remove()
    alone = [engine.generate(PROMPTS[:2], params, request_ids=[0, 1], max_tokens=[3, 4]),
             engine.generate(PROMPTS[2:], params, request_ids=[2])]
    assert [i for i, _, _ in given] == [0, 1]
    for (_, at, part), call, prompts in zip(given, alone, (PROMPTS[:2], PROMPTS[2:])):
        assert part.token_ids == call.token_ids and part.finish_reasons == call.finish_reasons
        assert at == max(len(t) for t in call.token_ids)  # the forward pass that made its last token
        for prompt, got, expected in zip(prompts, part.log_probs, call.log_probs):
            close(got, torch.tensor(expected), len(prompt) + len(got))
    assert given[0][1] < given[1][1]
    assert whole.token_ids == given[0][2].token_ids + given[1][2].token_ids
    with pytest.raises(ValueError, match=r"parts \[2, 2\] do not split 3 prompts"):
        engine.generate(PROMPTS, params, parts=[2, 2])


def test_stop_token_ends_the_response_with_it(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10)).token_ids[0]
    stop = greedy[5]
    end = greedy.index(stop) + 1  # the first time greedy emits it
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop,)))
    assert out.token_ids[0] == greedy[:end] and out.finish_reasons[0] == "stop"
    for i in (1, 2):  # the others stop at their own first `stop`, if any
        full = engine.generate([PROMPTS[i]], SamplingParams(temperature=0, max_tokens=10)).token_ids[0]
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert out.token_ids[i] == expected
        assert out.finish_reasons[i] == ("stop" if stop in full else "length")
        assert len(out.log_probs[i]) == len(expected)


def test_model_eos_ids_stop_too(checkpoints, hub_tensors):
    greedy = HFEngine(checkpoints[0], load_from_checkpoint=True).generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10)
    )
    eos = greedy.token_ids[0][3]
    config = AutoConfig.from_pretrained(checkpoints[0])
    config.eos_token_id = [config.vocab_size - 1, eos]  # a list, as some Hub configs have
    engine = HFEngine(config)
    engine.load_weights(hub_tensors[0].items())
    out = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10))
    end = greedy.token_ids[0].index(eos) + 1
    assert out.token_ids[0] == greedy.token_ids[0][:end] and out.finish_reasons == ["stop"]


def test_max_tokens_gives_length(engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7))
    assert [len(t) for t in out.token_ids] == [7, 7, 7] and [len(lp) for lp in out.log_probs] == [7, 7, 7]
    assert out.finish_reasons == ["length"] * 3


# -- sleep, wake, bad input ---------------------------------------------------------------------


def test_sleep_refuses_generate_but_takes_weights(engine, hub_tensors):
    params = SamplingParams(temperature=0, max_tokens=6)
    seed0 = engine.generate(PROMPTS, params)
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"asleep; call wake_up\(\) first"):
        engine.generate(PROMPTS, params)
    engine.load_weights(hub_tensors[1].items())
    engine.wake_up()
    seed1 = engine.generate(PROMPTS, params)
    assert seed1.token_ids == [greedy_reference(tiny_hf_model(1), p, 6) for p in PROMPTS] != seed0.token_ids


def test_bad_prompts_raise(engine):
    params = SamplingParams(max_tokens=8)
    assert engine.generate([], params) == Generation(token_ids=[], log_probs=[], finish_reasons=[])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], params)
    with pytest.raises(ValueError, match=r"prompt 1 has token id 512 outside the vocabulary \[0, 512\)"):
        engine.generate([[1, 2], [3, 512]], params)
    with pytest.raises(ValueError, match="prompt 0 has token id -1"):
        engine.generate([[-1]], params)
    too_long = r"prompt 0: 1020 tokens \+ max_tokens 8 exceed the model's max_position_embeddings 1024"
    with pytest.raises(ValueError, match=too_long):
        engine.generate([[1] * 1020], params)
    engine.generate([[1] * 1016], params)  # exactly fits


def test_inverse_cdf_draws_each_token_at_its_probability():
    """The accelerator's sampler: 40,000 rows of one distribution from one generator; each token's
    share within 4 standard deviations of its probability, a token of probability 0 never drawn."""
    from recipe.rollout.hf_engine import _inverse_cdf

    p = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    rows = 40_000
    tokens = _inverse_cdf(p.expand(rows, -1), [torch.Generator().manual_seed(3)])
    share = torch.bincount(tokens, minlength=5) / rows
    assert share[1] == 0
    assert torch.all((share - p).abs() <= 4 * (p * (1 - p) / rows).sqrt() + 1e-9), share


def test_inverse_cdf_gives_each_request_its_own_sample_whatever_the_batch():
    """A row's token follows from its own generator and its own probabilities: the same request
    seeded alike draws the same token alone or beside others, in any order; top-k's cut holds."""
    from recipe.rollout.hf_engine import _sample

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_k=5, seed=1)

    def draw(rows):
        return _sample(logits[rows], params, [torch.Generator().manual_seed(100 + r) for r in rows],
                       by_inverse_cdf=True)[0].tolist()

    batch = draw([0, 1, 2, 3, 4, 5])
    assert [draw([r])[0] for r in range(6)] == batch
    assert draw([5, 3, 1]) == [batch[5], batch[3], batch[1]]
    top5 = logits.topk(5, dim=-1).indices
    assert all(token in top5[r].tolist() for r, token in enumerate(batch))
