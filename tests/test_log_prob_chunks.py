"""Chunked vocab-parallel log-probs and entropy (``loss.vocab_parallel``) and the hook's token axis.

- the chunking rule; the peak-memory counter the memory tests use (bench/log_prob_memory.py);
- the extra peak memory of forward+backward, measured: under a quarter of the bf16 logits at every
  length, for the function and for the loss hook, while one unchunked pass holds ~3x;
- the gradient written into logits the function owns, never into a leaf;
- packed micro-batches (rows back to back, ``sequence_starts``) give the padded ones' numbers;
- malformed positions are refused;
- the fused kernels (verl's ``use_fused_kernels``, torch.compile) equal the eager chunks, on one
  rank and on TP 2 (and, on a GPU, hold no float32 chunk);
- on TP 1 and 2 gloo ranks: every chunking, with and without reusing the logits, equals
  megatron's ``vocab_parallel_cross_entropy`` (the log-prob path this replaced) and full-vocabulary
  float64 (which the replaced entropy matched, tests/test_loss_megatron_hook.py) within rounding,
  values and gradients;
- a megatron train step whose loss writes the gradient into the model's output makes the same
  update, bit for bit, as one that does not.
"""

from functools import partial

import pytest
import torch

from bench.log_prob_memory import LiveBytes
from loss import entropy_from_logits
from loss.megatron_hook import ActorLossConfig, MiniBatchNorm, log_prob_func, policy_loss_func, response_log_probs
from loss.vocab_parallel import DEFAULT_CHUNK_SIZE, chunk_rows, vocab_parallel_log_probs_and_entropy
from tests.distributed import run_ranks
from tests.numerics import rounding

TEMPERATURE = 0.7


@pytest.fixture
def one_rank(monkeypatch):
    """megatron's TP group replaced by one rank (nothing to all-reduce): everything runs in this process."""
    import loss.vocab_parallel

    monkeypatch.setattr(loss.vocab_parallel, "_tp_group_rank_size", lambda: (None, 0, 1))


def _model_output(values: torch.Tensor) -> torch.Tensor:
    """A non-leaf tensor nothing else holds, as megatron hands the model's output to the loss."""
    return values + torch.zeros((), dtype=values.dtype, requires_grad=True)


def _log_softmax_tolerance(logits_max: float, vocab: int, dtype: torch.dtype = torch.float32) -> float:
    """A log-softmax over ``vocab`` logits of size <= logits_max in float32 against another order
    or float64 (tests.numerics); bf16 gradients add their own rounding."""
    return rounding(logits_max, vocab) + (rounding(1.0, 1, torch.bfloat16) if dtype == torch.bfloat16 else 0.0)


# --- the chunking rule and the counter ------------------------------------------------------------
def test_chunk_rows_caps_tokens_and_the_share_of_logits_rows():
    assert chunk_rows(100_000, 100_000) == DEFAULT_CHUNK_SIZE  # long: the token cap
    assert chunk_rows(4096, 4096) == 256  # shorter: 1/16 of the rows
    assert chunk_rows(100, 8192) == 512  # the share counts the logits' rows, not the scored tokens
    assert chunk_rows(10, 10) == chunk_rows(0, 0) == 1
    assert chunk_rows(300, 300, chunk_size=0) == 300  # one chunk
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_rows(10, 10, chunk_size=-1)


def test_live_bytes_counts_new_storages_until_freed():
    before = torch.ones(10)
    with LiveBytes() as counter:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:]  # the same storage
        a.add_(1)  # in place
        before.mul_(2)  # in place on a storage from before the block
        b = before * 2  # 40
        c = torch.empty(500)  # 2000: the peak, 6040
        del a, c  # the view keeps a's storage
        d = torch.empty(250)  # 1000
        del view  # now a's storage goes
    assert (counter.peak, counter.live) == (6040, 1040)
    del b, d


# --- measured memory ------------------------------------------------------------------------------
MEMORY_VOCAB = 8192  # a row of bf16 logits (16 KiB) dwarfs the per-token statistics, as in a real vocabulary


def _extra_peak_ratio(tokens: int, dtype: torch.dtype, entropy_grad: bool, chunk_size: int) -> float:
    gen = torch.Generator().manual_seed(tokens)
    logits = _model_output((3 * torch.randn(tokens, MEMORY_VOCAB, generator=gen)).to(dtype))
    positions, targets = torch.arange(tokens), torch.randint(0, MEMORY_VOCAB, (tokens,), generator=gen)
    with LiveBytes() as counter:
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits, positions, targets, TEMPERATURE, True, chunk_size, reuse_logits=True
        )
        (grad,) = torch.autograd.grad(log_probs.sum() + (entropy.sum() if entropy_grad else 0.0), logits)
    assert grad.data_ptr() == logits.data_ptr()
    return counter.peak / (2 * tokens * MEMORY_VOCAB)


@pytest.mark.gpu
def test_extra_peak_on_a_gpu_is_a_fifth_of_the_bf16_logits(one_rank):
    """The allocator's own count on a GPU: Qwen3's vocabulary, 4,096 tokens, entropy differentiated."""
    tokens, vocab = 4096, 151_936
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = _model_output(torch.randn(tokens, vocab, generator=gen, device="cuda", dtype=torch.bfloat16))
    positions = torch.arange(tokens, device="cuda")
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, positions, targets, TEMPERATURE, True,
                                                              reuse_logits=True)
    (grad,) = torch.autograd.grad(log_probs.sum() + entropy.sum(), logits)
    torch.cuda.synchronize()
    assert grad.data_ptr() == logits.data_ptr()
    ratio = (torch.cuda.max_memory_allocated() - before) / (2 * tokens * vocab)
    assert ratio <= 0.25, f"extra peak {ratio:.3f}x the bf16 logits"


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-metric", "entropy-grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [4, 16, 300, 4096])
def test_extra_peak_is_a_quarter_of_the_bf16_logits_from_16_rows_and_under_them_from_4(one_rank, tokens, dtype, entropy_grad):
    # A chunk holds 3x its rows of bf16 logits and ceil(rows / 16) rows: 3/16 from 16 rows up. A
    # chunk is at least one row: 3/4x at 4 rows (at 3, 1x and the per-token statistics over it).
    ratio = _extra_peak_ratio(tokens, dtype, entropy_grad, DEFAULT_CHUNK_SIZE)
    assert ratio <= (0.25 if tokens >= 16 else 1.0), f"{tokens} tokens: extra peak {ratio:.3f}x the bf16 logits"


def test_one_chunk_holds_a_float32_copy_of_the_logits(one_rank):
    # The comparison point (chunk_size 0): a float32 copy and a bf16 gather of every row, ~3x.
    ratio = _extra_peak_ratio(512, torch.bfloat16, False, 0)
    assert 2.5 < ratio < 3.5, ratio


def _batch(rows: int, seq: int, width: int, vocab: int, seed: int, dtype=torch.float32) -> tuple[dict, torch.Tensor]:
    """A padded micro-batch (prompts then responses, right-padded) and its full logits [rows, seq, vocab]."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, seq - width + 1, (rows,), generator=gen)
    response_lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    response_lengths[0] = width  # one full row, one empty one
    response_lengths[-1] = 0
    mask = torch.arange(width) < response_lengths.unsqueeze(-1)
    gen_values = torch.Generator().manual_seed(seed + 1)
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, seq), generator=gen),
        "prompt_lengths": prompt_lengths,
        "response_mask": mask.long(),
        "old_log_probs": torch.where(mask, -2.0, 0.0),
        "advantages": torch.where(mask, torch.randn(rows, width, generator=gen), 0.0),
    }
    return batch, (3 * torch.randn(rows, seq, vocab, generator=gen_values)).to(dtype)


def test_policy_loss_func_extra_peak_is_under_a_quarter_of_the_bf16_logits(one_rank):
    batch, values = _batch(rows=4, seq=512, width=300, vocab=MEMORY_VOCAB, seed=0, dtype=torch.bfloat16)
    mask = batch["response_mask"].bool()
    norm = MiniBatchNorm(dp_size=1, num_microbatches=1, batch_num_tokens=int(mask.sum()), global_batch_size=3)
    cfg = ActorLossConfig(entropy_coeff=0.01, temperature=TEMPERATURE)
    logits = _model_output(values)
    with LiveBytes() as counter:
        loss, _ = policy_loss_func(cfg, norm, batch, logits)
        (grad,) = torch.autograd.grad(loss, logits)
    ratio = counter.peak / (2 * values.numel())
    assert grad.data_ptr() == logits.data_ptr() and ratio <= 0.25, ratio


# --- the gradient in the logits' storage -----------------------------------------------------------
def test_gradient_goes_into_owned_logits_and_never_into_a_leaf(one_rank):
    batch, values = _batch(rows=3, seq=10, width=5, vocab=32, seed=1)
    mask = batch["response_mask"].bool()
    norm = MiniBatchNorm(dp_size=1, num_microbatches=1, batch_num_tokens=int(mask.sum()), global_batch_size=2)
    cfg = ActorLossConfig(entropy_coeff=0.01, temperature=TEMPERATURE, log_prob_chunk_size=2)

    leaf = values.clone().requires_grad_()
    leaf_loss, _ = policy_loss_func(cfg, norm, batch, leaf)
    (leaf_grad,) = torch.autograd.grad(leaf_loss, leaf)
    assert torch.equal(leaf.detach(), values) and leaf_grad.data_ptr() != leaf.data_ptr()

    owned = _model_output(values)
    loss, _ = policy_loss_func(cfg, norm, batch, owned)
    (grad,) = torch.autograd.grad(loss, owned, retain_graph=True)
    # the same arithmetic, written into the logits instead of a fresh buffer
    assert grad.data_ptr() == owned.data_ptr() and torch.equal(grad, leaf_grad) and torch.equal(loss, leaf_loss)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, owned)  # the logits are gone: autograd refuses, nothing reads the gradient


# --- packed micro-batches -----------------------------------------------------------------------------
def _packed(batch: dict, logits: torch.Tensor, gap: int) -> tuple[dict, torch.Tensor]:
    """The same rows back to back on one token axis, each cut to its prompt + response and followed by
    ``gap`` padding tokens; ``sequence_starts`` says where each begins."""
    lengths = batch["prompt_lengths"] + batch["response_mask"].sum(-1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (lengths + gap).cumsum(0)[:-1]])
    total = int(lengths.sum()) + gap * len(lengths)
    input_ids = torch.zeros(1, total, dtype=torch.long)
    packed_logits = torch.full((1, total, logits.shape[-1]), float("nan"))  # padding is never read
    for i, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        input_ids[0, start : start + n] = batch["input_ids"][i, :n]
        packed_logits[0, start : start + n] = logits[i, :n]
    return {**batch, "input_ids": input_ids, "sequence_starts": starts}, packed_logits


def _packed_vs_padded(tp: int, rank: int) -> dict:
    """Log-probs, entropies and gradients of one micro-batch, padded and packed (TP rank ``rank``'s shard)."""
    batch, full = _batch(rows=5, seq=12, width=6, vocab=24, seed=2)
    logits = full.chunk(tp, -1)[rank].contiguous()
    packed_batch, packed_logits = _packed(batch, logits, gap=1)
    weights = torch.randn(2, *batch["response_mask"].shape, generator=torch.Generator().manual_seed(3))

    def run(mb: dict, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        owned = _model_output(values)
        lp, ent = response_log_probs(owned, mb, TEMPERATURE, True, chunk_size=3, reuse_logits=True)
        (grad,) = torch.autograd.grad((lp * weights[0] + ent * weights[1]).sum(), owned)
        return lp, ent, grad

    lp, ent, grad = run(batch, logits)
    packed_lp, packed_ent, packed_grad = run(packed_batch, packed_logits)
    # the padded gradient's rows where the packed layout put them; everything else 0
    expected = torch.zeros_like(packed_grad)
    lengths = batch["prompt_lengths"] + batch["response_mask"].sum(-1)
    for i, (start, n) in enumerate(zip(packed_batch["sequence_starts"].tolist(), lengths.tolist())):
        expected[0, start : start + n] = grad[i, :n]
    padding_grad = max(grad[i, n:].abs().max().item() if n < grad.shape[1] else 0.0 for i, n in enumerate(lengths.tolist()))
    mask = batch["response_mask"].bool()
    return {
        "lp_err": (packed_lp - lp).abs().max().item(),
        "ent_err": (packed_ent - ent).abs().max().item(),
        "grad_err": (packed_grad - expected).abs().max().item(),
        "padded_grad_at_padding": padding_grad,
        "zero_past_responses": bool((packed_lp[~mask] == 0).all() and (packed_ent[~mask] == 0).all()),
        "logits_max": full.abs().max().item() / TEMPERATURE,
        "tokens": int(mask.sum()),
    }


def _check_packed(r: dict) -> None:
    tolerance = _log_softmax_tolerance(r["logits_max"], 24)
    assert r["tokens"] > 10 and r["zero_past_responses"], r
    assert r["lp_err"] < tolerance and r["ent_err"] < tolerance and r["grad_err"] < tolerance, r
    assert r["padded_grad_at_padding"] == 0.0, r


@pytest.mark.numerics
def test_packed_micro_batch_gives_the_padded_numbers(one_rank):
    _check_packed(_packed_vs_padded(1, 0))


# --- refusals -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, match",
    [
        ({"prompt_lengths": torch.tensor([0, 3])}, "after a prompt of at least one token"),
        ({"prompt_lengths": torch.tensor([2, 7])}, "inside their sequence"),  # row 1's response runs past s = 8
        ({"sequence_starts": torch.tensor([0, 4])}, "inside their sequence"),  # row 0's runs into row 1
        ({"sequence_starts": torch.tensor([0])}, "sequence_starts"),
        ({"input_ids": torch.zeros(3, 8, dtype=torch.long)}, "input_ids"),
    ],
)
def test_hook_refuses_tokens_outside_their_sequence(one_rank, change, match):
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "prompt_lengths": torch.tensor([2, 3]),
             "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    batch.update(change)
    if "sequence_starts" in change:
        batch["input_ids"] = batch["input_ids"].reshape(1, -1)
    logits = torch.zeros(*batch["input_ids"].shape, 6)
    with pytest.raises(ValueError, match=match):
        response_log_probs(logits, batch, 1.0, False)


def test_function_refuses_repeated_or_out_of_range_rows(one_rank):
    logits = torch.zeros(5, 6)
    for positions in ([1, 3, 1], [0, 5], [-1, 2]):
        positions = torch.tensor(positions)
        with pytest.raises(ValueError, match="distinct rows"):
            vocab_parallel_log_probs_and_entropy(logits, positions, torch.zeros_like(positions))


def test_log_prob_func_takes_the_chunk_size_by_keyword(one_rank):
    batch, logits = _batch(rows=3, seq=10, width=5, vocab=32, seed=4)
    whole = partial(log_prob_func, TEMPERATURE, True, log_prob_chunk_size=0)(batch, logits)[1]
    chunked = partial(log_prob_func, TEMPERATURE, True, log_prob_chunk_size=1)(batch, logits)[1]
    default = partial(log_prob_func, TEMPERATURE, True)(batch, logits)[1]
    tolerance = _log_softmax_tolerance(logits.abs().max().item() / TEMPERATURE, 32)
    for outputs in (chunked, default):
        assert all((outputs[k] - whole[k]).abs().max() < tolerance for k in ("log_probs", "entropy"))


# --- fused kernels (torch.compile) ---------------------------------------------------------------------
def _fused_against_eager(logits_shard: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                         weights: torch.Tensor) -> dict:
    """Log-probs, entropies and gradients (of the log-probs alone, and with the entropy's) of the
    eager and the fused kernels on the same shard, and whether each wrote its gradient into the logits."""
    out = {}
    for fused in (False, True):
        for entropy_grad in (False, True):
            logits = _model_output(logits_shard)
            lp, ent = vocab_parallel_log_probs_and_entropy(logits, positions, targets, TEMPERATURE, True, 3,
                                                           reuse_logits=True, fused=fused)
            loss = (lp * weights[0]).sum() + ((ent * weights[1]).sum() if entropy_grad else 0.0)
            (grad,) = torch.autograd.grad(loss, logits)
            out[fused, entropy_grad] = lp, ent, grad.float(), grad.data_ptr() == logits.data_ptr()
    return out


def _fused_errors(logits_shard, positions, targets, weights) -> dict:
    runs = _fused_against_eager(logits_shard, positions, targets, weights)
    errors = {"reused": all(r[3] for r in runs.values())}
    for entropy_grad in (False, True):
        eager, fused = runs[False, entropy_grad], runs[True, entropy_grad]
        errors[f"entgrad{entropy_grad}"] = [(a - b).abs().max().item() for a, b in zip(eager[:3], fused[:3])]
    return errors


def _check_fused(errors: dict, logits_max: float, vocab: int) -> None:
    """Fused and eager compute the same arithmetic in another order: equal within rounding; the
    bf16 gradient within one bf16 rounding of it."""
    values_tol = _log_softmax_tolerance(logits_max, vocab)
    grad_tol = _log_softmax_tolerance(logits_max, vocab, torch.bfloat16)
    assert errors["reused"], errors
    for name in ("entgradFalse", "entgradTrue"):
        lp_err, ent_err, grad_err = errors[name]
        assert lp_err < values_tol and ent_err < values_tol and grad_err < grad_tol, (name, errors)


@pytest.mark.numerics
def test_fused_kernels_equal_the_eager_chunks(one_rank):
    """verl's use_fused_kernels: the chunks' passes compiled (torch.compile; inductor's C++ here),
    bf16 logits, temperature, unordered rows with some unscored, with and without the entropy's
    gradient, the gradient written into the logits."""
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(40, 96, generator=gen)).to(torch.bfloat16)
    positions = torch.randperm(40, generator=gen)[:29]
    targets = torch.randint(0, 96, (29,), generator=gen)
    weights = torch.randn(2, 29, generator=gen)
    _check_fused(_fused_errors(logits, positions, targets, weights),
                 logits.float().abs().max().item() / TEMPERATURE, 96)


@pytest.mark.gpu
def test_fused_kernels_hold_no_float32_chunk_on_a_gpu(one_rank):
    """The allocator's count, as the eager test above: the fused kernels read the rows where they lie,
    so the extra peak is the bf16 gradient chunk (1/16 of the rows) and per-token statistics. (On the
    CPU the tensor counter is a dispatch mode, under which torch.compile runs its graph eagerly.)"""
    tokens, vocab = 4096, 151_936
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = torch.randn(tokens, vocab, generator=gen, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(tokens, device="cuda")
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
    for _ in range(2):  # the first call compiles
        logits = _model_output(values.clone())
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(logits, positions, targets, TEMPERATURE, True,
                                                                  reuse_logits=True, fused=True)
        (grad,) = torch.autograd.grad(log_probs.sum() + entropy.sum(), logits)
        torch.cuda.synchronize()
    assert grad.data_ptr() == logits.data_ptr()
    ratio = (torch.cuda.max_memory_allocated() - before) / (2 * tokens * vocab)
    assert ratio <= 0.125, f"extra peak {ratio:.3f}x the bf16 logits"


def _fused_job(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    gen = torch.Generator().manual_seed(7)
    full = (3 * torch.randn(13, VOCAB, generator=gen)).to(torch.bfloat16)
    full[0] += 60.0  # the max all-reduce matters
    positions = torch.tensor([7, 0, 3, 12, 4, 9, 1, 10])
    targets = torch.randint(0, VOCAB, (len(positions),), generator=gen)  # on either shard
    weights = torch.randn(2, len(positions), generator=gen)
    errors = _fused_errors(full.chunk(world_size, -1)[rank].contiguous(), positions, targets, weights)
    return {**errors, "logits_max": full.float().abs().max().item() / TEMPERATURE}


@pytest.mark.slow
@pytest.mark.numerics
def test_fused_kernels_equal_the_eager_chunks_on_tp2_ranks(tmp_path):
    for r in run_ranks(_fused_job, 2, tmp_path):
        _check_fused(r, r["logits_max"], VOCAB)


# --- TP 1 and 2 on gloo ranks -----------------------------------------------------------------------
VOCAB = 24  # divisible by both TP sizes
CHUNK_SIZES = (0, 1, 4, DEFAULT_CHUNK_SIZE)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _gather_vocab(shard: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parts = [torch.empty_like(shard, dtype=torch.float64) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, shard.double().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item() / expected.double().abs().max().item()


def _against_megatron_and_float64(rank: int, world_size: int, dtype: torch.dtype, temperature: float) -> dict:
    from megatron.core import tensor_parallel

    gen = torch.Generator().manual_seed(0)
    full = 3 * torch.randn(13, VOCAB, generator=gen)
    full[0] += 60.0  # large logits: exp overflows unless the max is subtracted
    full[4, 5] = 30.0  # a nearly one-hot distribution
    full = full.to(dtype)
    positions = torch.tensor([7, 0, 3, 12, 4, 9, 1, 10])  # not in order; rows 2, 5, 6, 8, 11 unscored
    targets = torch.randint(0, VOCAB, (len(positions),), generator=gen)
    weights = torch.randn(2, len(positions), generator=gen)
    shard = full.chunk(world_size, -1)[rank]

    ref = full.double().requires_grad_()
    z = ref[positions] / temperature
    ref_lp = torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = entropy_from_logits(z)
    (ref_grad_lp,) = torch.autograd.grad((ref_lp * weights[0]).sum(), ref, retain_graph=True)
    (ref_grad_both,) = torch.autograd.grad((ref_lp * weights[0] + ref_ent * weights[1]).sum(), ref)

    # today's log-prob path before this change: megatron's cross entropy on float32 rows / T
    mega_in = shard.clone().requires_grad_()
    mega_lp = -tensor_parallel.vocab_parallel_cross_entropy(mega_in[positions].float() / temperature, targets)
    (mega_grad,) = torch.autograd.grad((mega_lp * weights[0]).sum(), mega_in)

    cases = {}
    for chunk in CHUNK_SIZES:
        for reuse in (False, True):
            for entropy_grad in (False, True):
                values = shard.clone().requires_grad_()
                logits = values * 1 if reuse else values  # owned (the model's output) or the caller's leaf
                lp, ent = vocab_parallel_log_probs_and_entropy(
                    logits, positions, targets, temperature, True, chunk, reuse_logits=reuse
                )
                loss = (lp * weights[0]).sum() + ((ent * weights[1]).sum() if entropy_grad else 0.0)
                (grad,) = torch.autograd.grad(loss, logits)
                cases[f"chunk{chunk}-reuse{reuse}-entgrad{entropy_grad}"] = {
                    "dtypes": [str(lp.dtype), str(ent.dtype), str(grad.dtype)],
                    "reused": grad.data_ptr() == logits.data_ptr(),
                    "lp_vs_f64": (lp.double() - ref_lp).abs().max().item(),
                    "ent_vs_f64": (ent.double() - ref_ent).abs().max().item(),
                    "grad_vs_f64": _rel_err(_gather_vocab(grad), ref_grad_both if entropy_grad else ref_grad_lp),
                    "lp_vs_megatron": (lp - mega_lp).abs().max().item(),
                    "grad_vs_megatron": None if entropy_grad else _rel_err(grad, mega_grad),
                    "leaf_unmodified": torch.equal(values.detach(), shard) if not reuse else True,
                }
    return {"cases": cases, "logits_max": full.float().abs().max().item() / temperature}


def _job(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {f"{name}-T{t}": _against_megatron_and_float64(rank, world_size, dtype, t)
               for name, dtype in DTYPES.items() for t in (1.0, TEMPERATURE)}
    results["packed"] = _packed_vs_padded(world_size, rank)
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=lambda tp: f"tp{tp}")
def tp_results(request, tmp_path_factory) -> list[dict]:
    return run_ranks(_job, request.param, tmp_path_factory.mktemp(f"chunks_tp{request.param}"))


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_chunking_equals_megatron_and_float64(tp_results, dtype, temperature):
    for rank, results in enumerate(tp_results):
        r = results[f"{dtype}-T{temperature}"]
        values_tol = _log_softmax_tolerance(r["logits_max"], VOCAB)
        grad_tol = _log_softmax_tolerance(r["logits_max"], VOCAB, DTYPES[dtype])
        assert len(r["cases"]) == len(CHUNK_SIZES) * 4
        for name, c in r["cases"].items():
            where = (rank, name, c)
            assert c["dtypes"] == ["torch.float32", "torch.float32", f"torch.{dtype}"], where
            assert c["reused"] == ("reuseTrue" in name) and c["leaf_unmodified"], where
            assert c["lp_vs_f64"] < values_tol and c["ent_vs_f64"] < values_tol, where
            assert c["lp_vs_megatron"] < values_tol, where
            assert c["grad_vs_f64"] < grad_tol, where
            assert c["grad_vs_megatron"] is None or c["grad_vs_megatron"] < grad_tol, where


@pytest.mark.slow
@pytest.mark.numerics
def test_packed_micro_batch_gives_the_padded_numbers_on_tp_ranks(tp_results):
    for results in tp_results:
        _check_packed(results["packed"])


# --- through megatron's schedule --------------------------------------------------------------------
def _train_steps(rank: int, world_size: int, checkpoint: str, batch: dict, reuse: bool) -> dict:
    """One update from the checkpoint per micro-batch size: metrics, new weights, and whether each
    log-prob call wrote its gradient into the model's output."""
    import loss.vocab_parallel
    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig

    held_by_caller, reused = loss.vocab_parallel._held_by_caller, []

    def spy(tensor: torch.Tensor) -> bool:  # True keeps the logits: a fresh gradient buffer
        held = held_by_caller(tensor) or not reuse
        reused.append(not held)
        return held

    loss.vocab_parallel._held_by_caller = spy
    initialize_parallel(TrainParallel())
    cfg = ActorLossConfig(entropy_coeff=0.01, temperature=TEMPERATURE, log_prob_chunk_size=2)
    results = {}
    for micro_batch_size in (1, 2):  # one row: the output is a view of the output layer's; two: a copy
        actor = MegatronActor(load_model_spec(checkpoint), TrainParallel(), BuildOptions(params_dtype=torch.float32),
                              OptimConfig(lr=1e-3), "cpu")
        actor.load_hf(checkpoint)
        reused.clear()
        metrics = actor.train_step(batch, micro_batch_size, partial(policy_loss_func, cfg))
        weights = torch.cat([p.detach().flatten() for chunk in actor.chunks for p in chunk.parameters()])
        results[micro_batch_size] = {"metrics": metrics, "weights": weights.tolist(), "reused": list(reused)}
    return results


@pytest.mark.slow
def test_gradient_in_the_model_output_gives_the_same_update_through_megatron(tmp_path):
    from megatron_bridge.tiny_model import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny", seed=1)
    gen = torch.Generator().manual_seed(5)
    prompt_lengths, width = torch.tensor([3, 5, 2, 4]), 6
    mask = torch.arange(width) < torch.tensor([6, 2, 4, 5]).unsqueeze(-1)
    batch = {"input_ids": torch.randint(3, 512, (4, 11), generator=gen), "prompt_lengths": prompt_lengths,
             "response_mask": mask.float(), "old_log_probs": torch.where(mask, -6.0, 0.0),
             "advantages": torch.randn(4, 1, generator=gen).expand(4, width).clone()}
    runs = {}
    for reuse in (True, False):
        (out := tmp_path / f"reuse{reuse}").mkdir()
        runs[reuse] = run_ranks(_train_steps, 1, out, checkpoint, batch, reuse)[0]
    for size in ("1", "2"):  # JSON keys
        with_reuse, without = runs[True][size], runs[False][size]
        assert with_reuse["reused"] and all(with_reuse["reused"]) and not any(without["reused"]), size
        assert with_reuse["metrics"] == without["metrics"] and with_reuse["weights"] == without["weights"], size
