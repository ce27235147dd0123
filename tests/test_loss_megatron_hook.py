"""Megatron loss hook: vocab-parallel log-probs and entropy against full-vocabulary torch at TP 1/2/4,
response positions, micro-batch / DP sharding invariance of the loss gradient and metrics,
degenerate batches, forward-only outputs, config validation.

Everything that needs megatron's TP group runs in one spawned gloo job per world size (a module
fixture); the tests then check that job's numbers case by case.
"""

import math
import subprocess
import sys

import pytest
import torch

from loss import LOSS_AGG_MODES, agg_loss, PolicyLossSettings, compute_policy_loss, entropy_from_logits, kl_penalty, masked_mean
from loss.megatron_hook import ActorLossConfig, MiniBatchNorm
from tests.distributed import run_ranks
from tests.numerics import rounding

pytestmark = pytest.mark.numerics  # CI runs these again under another CPU kernel path

VOCAB = 24  # divisible by every TP size below
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TEMPERATURES = (1.0, 0.7)


def log_softmax_tolerance(logits_max: float, dtype: str) -> float:
    """A log-softmax over VOCAB logits of size <= logits_max, computed in fp32, against fp64: the
    log-sum-exp's rounding (tests.numerics). bf16 logits get their gradients rounded to bf16."""
    return rounding(logits_max, VOCAB) + (rounding(1.0, 1, torch.bfloat16) if dtype == "bfloat16" else 0.0)

LOSS_MODES = ("gspo", "vanilla")
METRIC_KEYS = {
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower",
}


def _init_tp(world_size: int) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)


def _max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return _max_err(actual, expected) / expected.double().abs().max().item()


def _loop_response(
    logits: torch.Tensor, input_ids, prompt_lengths, response_lengths, width: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference by explicit indexing: response token j of row i is input_ids[i, p_i + j], read at
    position p_i + j - 1. Differentiable; 0 past each response."""
    log_probs = logits.new_zeros(logits.shape[0], width, dtype=torch.float64)
    entropy = torch.zeros_like(log_probs)
    for i, (p, n) in enumerate(zip(prompt_lengths.tolist(), response_lengths.tolist())):
        for j in range(n):
            z = logits[i, p + j - 1].double() / temperature
            log_probs[i, j] = torch.log_softmax(z, -1)[input_ids[i, p + j]]
            entropy[i, j] = entropy_from_logits(z)
    return log_probs, entropy


# --- vocab-parallel log-probs and entropy (TP = world size) -----------------------------------
def _my_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, -1)[rank].clone()


def _gather_vocab(shard: torch.Tensor, world_size: int) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parts = [torch.empty_like(shard, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(parts, shard.double().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)


def _compare_with_full_vocab(rank: int, world_size: int, dtype: torch.dtype, temperature: float) -> dict:
    from loss.vocab_parallel import vocab_parallel_log_probs_and_entropy

    def log_probs_and_entropy(logits, target):  # every position, as [3, 5]
        lp, ent = vocab_parallel_log_probs_and_entropy(
            logits.flatten(0, 1), torch.arange(target.numel()), target.flatten(), temperature
        )
        return lp.view(target.shape), ent.view(target.shape)

    gen = torch.Generator().manual_seed(0)
    full = 3 * torch.randn(3, 5, VOCAB, generator=gen)
    full[0, 0] += 60.0  # large logits: exp overflows unless the max is subtracted
    full[1, 2, 5] = 30.0  # a nearly one-hot distribution
    full = full.to(dtype)
    target = torch.randint(0, VOCAB, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen)  # arbitrary upstream gradients

    shard = _my_shard(full, rank, world_size).requires_grad_()
    before = shard.detach().clone()
    log_probs, _ = log_probs_and_entropy(shard, target)
    (grad_lp,) = torch.autograd.grad((log_probs * weights[0]).sum(), shard)
    _, entropy = log_probs_and_entropy(shard, target)
    (grad_ent,) = torch.autograd.grad((entropy * weights[1]).sum(), shard)
    # Forward only on a plain tensor: an in-place step on a float32 input at T = 1 would land
    # exactly on this tensor if it were passed through.
    plain = _my_shard(full, rank, world_size)
    with torch.no_grad():
        log_probs_and_entropy(plain, target)

    ref = full.double().requires_grad_()
    ref_lp = torch.log_softmax(ref / temperature, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_ent = entropy_from_logits(ref / temperature)
    (ref_grad_lp,) = torch.autograd.grad((ref_lp * weights[0]).sum(), ref)
    (ref_grad_ent,) = torch.autograd.grad((ref_ent * weights[1]).sum(), ref)
    return {
        "dtypes": [str(log_probs.dtype), str(entropy.dtype), str(grad_lp.dtype), str(grad_ent.dtype)],
        "lp_err": _max_err(log_probs, ref_lp),
        "ent_err": _max_err(entropy, ref_ent),
        "lp_grad_rel_err": _rel_err(_gather_vocab(grad_lp, world_size), ref_grad_lp),
        "ent_grad_rel_err": _rel_err(_gather_vocab(grad_ent, world_size), ref_grad_ent),
        "unmodified": torch.equal(shard.detach(), before) and torch.equal(plain, before),
        "logits_max": float(full.float().abs().max()) / temperature,
    }


def _response_positions(rank: int, world_size: int) -> dict:
    from loss.megatron_hook import response_log_probs

    # Row 1's response runs to the end of the sequence; row 2 has an empty response.
    prompt_lengths = torch.tensor([2, 5, 1, 3])
    response_lengths = torch.tensor([4, 3, 0, 2])
    width, temperature = 4, 0.9
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (4, 8), generator=gen)
    full = torch.randn(4, 8, VOCAB, generator=gen)
    mask = torch.arange(width) < response_lengths.unsqueeze(-1)
    batch = {"input_ids": input_ids, "prompt_lengths": prompt_lengths, "response_mask": mask.long()}

    shard = _my_shard(full, rank, world_size).requires_grad_()
    log_probs, entropy = response_log_probs(shard, batch, temperature, True)
    (grad,) = torch.autograd.grad(torch.where(mask, log_probs, 0.0).sum(), shard)
    ref_lp, ref_ent = _loop_response(full, input_ids, prompt_lengths, response_lengths, width, temperature)

    # The gradient must reach exactly the positions p_i + j - 1 of valid tokens.
    read = torch.zeros(4, 8, dtype=torch.bool)
    for i, (p, n) in enumerate(zip(prompt_lengths.tolist(), response_lengths.tolist())):
        read[i, p - 1 : p - 1 + n] = True
    _, no_entropy = response_log_probs(shard, batch, temperature, False)
    return {
        "shapes": [list(log_probs.shape), list(entropy.shape)],
        "lp_err": _max_err(log_probs[mask], ref_lp[mask]),
        "ent_err": _max_err(entropy[mask], ref_ent[mask]),
        "zero_past_responses": bool((log_probs[~mask] == 0).all() and (entropy[~mask] == 0).all()),
        "read_positions_ok": torch.equal(grad.abs().sum(-1) > 0, read),
        "no_entropy_is_none": no_entropy is None,
        "logits_max": float(full.abs().max()) / temperature,
    }


def _vocab_parallel_job(rank: int, world_size: int) -> dict:
    _init_tp(world_size)
    results = {
        f"{name}-T{t}": _compare_with_full_vocab(rank, world_size, dtype, t)
        for name, dtype in DTYPES.items()
        for t in TEMPERATURES
    }
    results["response"] = _response_positions(rank, world_size)
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def vocab_results(request, tmp_path_factory) -> list[dict]:
    tp = request.param
    return run_ranks(_vocab_parallel_job, tp, tmp_path_factory.mktemp(f"tp{tp}"))


@pytest.mark.slow
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_vocab_parallel_matches_full_vocabulary(vocab_results, dtype, temperature):
    for rank, results in enumerate(vocab_results):
        r = results[f"{dtype}-T{temperature}"]
        assert r["dtypes"] == ["torch.float32", "torch.float32", f"torch.{dtype}", f"torch.{dtype}"], rank
        # Values are computed in float32 from the (exactly representable) inputs in every case.
        tolerance = log_softmax_tolerance(r["logits_max"], "float32")
        assert r["lp_err"] < tolerance and r["ent_err"] < tolerance, (rank, r)
        # Gradients (softmax - onehot, relative to their largest): the same log-sum-exp.
        tolerance = log_softmax_tolerance(r["logits_max"], dtype)
        assert r["lp_grad_rel_err"] < tolerance and r["ent_grad_rel_err"] < tolerance, (rank, r)
        assert r["unmodified"], f"rank {rank}: the caller's logits were modified"


@pytest.mark.slow
def test_response_log_probs_reads_the_right_positions(vocab_results):
    for rank, results in enumerate(vocab_results):
        r = results["response"]
        assert r["shapes"] == [[4, 4], [4, 4]] and r["zero_past_responses"] and r["no_entropy_is_none"], (rank, r)
        tolerance = log_softmax_tolerance(r["logits_max"], "float32")
        assert r["lp_err"] < tolerance and r["ent_err"] < tolerance, (rank, r)
        assert r["read_positions_ok"], f"rank {rank}: gradient reached other positions than p + j - 1"


# --- the loss hook (TP = 1) -------------------------------------------------------------------
PROMPT_LENGTHS = [2, 4, 3, 5, 1, 6, 2, 3]
RESPONSE_LENGTHS = [5, 3, 0, 5, 2, 4, 1, 5]  # row 2 is empty; prompt + response <= SEQ
SEQ, WIDTH = 10, 5
# DP rank -> its micro-batches (row indices): 4 micro-batches of unequal sizes, and the two
# ranks run different numbers of them.
SPLITS = [[[0], [1, 2], [3]], [[4, 5, 6, 7]]]
# (loss_mode, loss_agg_mode, kl_loss_type): k2 / mse, unlike k3, would turn NaN padding into NaN
# gradients (0 * NaN in its backward) if the hook let it reach the estimator.
DEGENERATE_CASES = [
    ("gspo", "seq-mean-token-mean", "low_var_kl"),
    ("gspo", "token-mean", "mse"),
    ("vanilla", "seq-mean-token-mean", "abs"),
    ("vanilla", "token-mean", "k2"),
]


def _hook_batch(seed: int, padding: float) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(micro-batch, full logits, response lengths); old/ref log-probs near the current ones so
    that some ratios clip and some do not; ``padding`` fills the masked entries."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.tensor(PROMPT_LENGTHS)
    lengths = torch.tensor(RESPONSE_LENGTHS)
    mask = torch.arange(WIDTH) < lengths.unsqueeze(-1)
    input_ids = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=gen)
    logits = 2 * torch.randn(len(lengths), SEQ, VOCAB, generator=gen)
    current, _ = _loop_response(logits, input_ids, prompt_lengths, lengths, WIDTH, 1.0)
    rows = len(lengths)
    noise = 0.3 * torch.randn(3, rows, WIDTH, generator=gen, dtype=torch.float64)
    drift = 0.2 * torch.randn(rows, 1, generator=gen, dtype=torch.float64)  # moves whole sequences
    advantages = torch.randn(rows, 1, generator=gen, dtype=torch.float64) + noise[2]
    batch = {
        "input_ids": input_ids,
        "prompt_lengths": prompt_lengths,
        "response_mask": mask.long(),
        "old_log_probs": torch.where(mask, current + drift + noise[0], padding).float(),
        "advantages": torch.where(mask, advantages, padding).float(),
        "ref_log_probs": torch.where(mask, current + noise[1], padding).float(),
    }
    return batch, logits, lengths


def _hook_config(loss_mode: str, loss_agg_mode: str, kl_loss_type: str = "low_var_kl") -> ActorLossConfig:
    return ActorLossConfig(
        loss_mode=loss_mode, policy=PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=loss_agg_mode),
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kl_loss_type, entropy_coeff=0.05, temperature=0.8,
    )


def _reference_loss(cfg: ActorLossConfig, batch: dict, logits: torch.Tensor, lengths) -> tuple[torch.Tensor, dict]:
    """The whole-batch loss and metrics straight from the torch-only library, no hook involved."""
    log_probs, entropy = _loop_response(
        logits, batch["input_ids"], batch["prompt_lengths"], lengths, WIDTH, cfg.temperature
    )
    mask, mode = batch["response_mask"], cfg.policy.loss_agg_mode
    pg_loss, pg_metrics = compute_policy_loss(
        cfg.loss_mode, batch["old_log_probs"], log_probs, batch["advantages"], mask, cfg.policy
    )
    kl_loss = agg_loss(kl_penalty(log_probs, batch["ref_log_probs"], cfg.kl_loss_type), mask, mode)
    loss = pg_loss + cfg.kl_loss_coef * kl_loss - cfg.entropy_coeff * agg_loss(entropy, mask, mode)
    metrics = {"actor/pg_loss": pg_loss.item(), "actor/kl_loss": kl_loss.item(),
               "actor/entropy": masked_mean(entropy, mask).item(), **pg_metrics}
    return loss, metrics


def _metric_err(actual: dict, expected: dict) -> float:
    """Largest error over the keys, relative for values above 1 (token-sum losses are large)."""
    return max(abs(float(actual[k]) - float(expected[k])) / max(1.0, abs(float(expected[k]))) for k in expected)


def _sharding_case(loss_mode: str, loss_agg_mode: str) -> dict:
    from loss.megatron_hook import policy_loss_func

    cfg = _hook_config(loss_mode, loss_agg_mode)
    batch, logits, lengths = _hook_batch(seed=2, padding=50.0)
    mask = batch["response_mask"].bool()
    counts = dict(batch_num_tokens=int(mask.sum()), global_batch_size=int(mask.any(-1).sum()))

    whole_logits = logits.clone().requires_grad_()
    loss, metrics = policy_loss_func(cfg, MiniBatchNorm(dp_size=1, num_microbatches=1, **counts), batch, whole_logits)
    (grad_whole,) = torch.autograd.grad(loss, whole_logits)

    ref_logits = logits.double().requires_grad_()
    ref_loss, ref_metrics = _reference_loss(cfg, batch, ref_logits, lengths)
    (grad_ref,) = torch.autograd.grad(ref_loss, ref_logits)

    # Emulate megatron (loss / num_microbatches per micro-batch, summed) and DDP (mean over DP).
    grad_split = torch.zeros_like(logits)
    metric_sum = dict.fromkeys(metrics, 0.0)
    for micro_batches in SPLITS:
        norm = MiniBatchNorm(dp_size=len(SPLITS), num_microbatches=len(micro_batches), **counts)
        for rows in micro_batches:
            idx = torch.tensor(rows)
            leaf = logits.clone().requires_grad_()
            mb_loss, mb_metrics = policy_loss_func(cfg, norm, {k: v[idx] for k, v in batch.items()}, leaf[idx])
            (grad,) = torch.autograd.grad(mb_loss / norm.num_microbatches, leaf)
            grad_split += grad / norm.dp_size
            metric_sum = {k: metric_sum[k] + mb_metrics[k].item() for k in metric_sum}

    return {
        "metric_keys": sorted(metrics),
        "metrics_detached_fp32_scalars": all(
            m.dtype == torch.float32 and m.dim() == 0 and not m.requires_grad for m in metrics.values()
        ),
        "loss_vs_ref": abs(loss.item() - ref_loss.item()),
        "grad_vs_ref": _rel_err(grad_whole, grad_ref),
        "split_vs_whole": _rel_err(grad_split, grad_whole),
        "grad_max": grad_whole.abs().max().item(),
        "metrics_vs_ref": _metric_err(metrics, ref_metrics),
        "metric_sum_vs_whole": _metric_err(metric_sum, {k: v.item() for k, v in metrics.items()}),
        "clipfrac": metrics["actor/pg_clipfrac"].item(),
        "loss_tolerance": _loss_tolerance(cfg, batch, logits, lengths),
        "metric_max": max(abs(v.item()) for v in metrics.values()),
    }


def _loss_tolerance(cfg: ActorLossConfig, batch: dict, logits: torch.Tensor, lengths: torch.Tensor) -> float:
    """The fp32 loss against the fp64 one (tests.numerics): each token's term carries the rounding
    of its log-prob (a log-softmax over VOCAB logits) times its slope in the log-prob, at most
    |A| x ratio for the policy term, the KL's exp(|ref - log p|) and log(VOCAB) for the entropy; a
    token-sum aggregation adds up to WIDTH of them."""
    mask = batch["response_mask"].bool()
    current, _ = _loop_response(logits, batch["input_ids"], batch["prompt_lengths"], lengths, WIDTH, cfg.temperature)
    ratio = (batch["old_log_probs"].double() - current).abs()[mask].max().exp()
    ref_ratio = (batch["ref_log_probs"].double() - current).abs()[mask].max().exp()
    slope = batch["advantages"][mask].abs().max() * ratio + cfg.kl_loss_coef * ref_ratio + cfg.entropy_coeff * math.log(VOCAB)
    return WIDTH * float(slope) * log_softmax_tolerance(float(logits.abs().max()) / cfg.temperature, "float32")


def _degenerate_case(loss_mode: str, loss_agg_mode: str, kl_loss_type: str) -> dict:
    """All-zero advantages, an empty response row, NaN/inf padding; and a micro-batch of only the empty row."""
    from loss.megatron_hook import policy_loss_func

    cfg = _hook_config(loss_mode, loss_agg_mode, kl_loss_type)
    batch, logits, _ = _hook_batch(seed=3, padding=float("nan"))
    batch["advantages"] = torch.where(batch["response_mask"].bool(), 0.0, float("inf"))
    norm = MiniBatchNorm(dp_size=2, num_microbatches=3, batch_num_tokens=25, global_batch_size=7)

    leaf = logits.clone().requires_grad_()
    loss, metrics = policy_loss_func(cfg, norm, batch, leaf)
    (grad,) = torch.autograd.grad(loss, leaf)

    empty = {k: v[2:3] for k, v in batch.items()}  # row 2 has no response token
    empty_leaf = logits[2:3].clone().requires_grad_()
    empty_loss, empty_metrics = policy_loss_func(cfg, norm, empty, empty_leaf)
    (empty_grad,) = torch.autograd.grad(empty_loss, empty_leaf)
    return {
        "finite": bool(loss.isfinite() and grad.isfinite().all() and all(m.isfinite() for m in metrics.values())),
        "grad_nonzero": bool(grad.abs().sum() > 0),  # KL and entropy still pull
        "empty_loss": empty_loss.item(),
        "empty_grad_zero": bool((empty_grad == 0).all()),
        "empty_metrics": [m.item() for m in empty_metrics.values()],
    }


def _log_prob_func_case() -> dict:
    from loss.megatron_hook import log_prob_func, response_log_probs

    batch, logits, _ = _hook_batch(seed=4, padding=0.0)
    leaf = logits.clone().requires_grad_()
    loss, outputs = log_prob_func(0.8, True, batch, leaf)
    _, only_lp = log_prob_func(0.8, False, batch, leaf)
    expected_lp, expected_ent = response_log_probs(logits, batch, 0.8, True)
    return {
        "loss": [loss.dim(), loss.item()],
        "keys": [sorted(outputs), sorted(only_lp)],
        "detached": not any(t.requires_grad for t in (*outputs.values(), *only_lp.values())),
        "equal": torch.equal(outputs["log_probs"], expected_lp) and torch.equal(outputs["entropy"], expected_ent),
    }


def _hook_job(rank: int, world_size: int) -> dict:
    _init_tp(world_size)
    modes = [(m, a) for m in LOSS_MODES for a in LOSS_AGG_MODES]
    return {
        "sharding": {f"{m}/{a}": _sharding_case(m, a) for m, a in modes},
        "degenerate": {"/".join(case): _degenerate_case(*case) for case in DEGENERATE_CASES},
        "log_prob_func": _log_prob_func_case(),
    }


@pytest.fixture(scope="module")
def hook_results(tmp_path_factory) -> dict:
    return run_ranks(_hook_job, 1, tmp_path_factory.mktemp("hook"))[0]


@pytest.mark.slow
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", LOSS_MODES)
def test_policy_loss_is_invariant_to_micro_batch_and_dp_split(hook_results, loss_mode, loss_agg_mode):
    r = hook_results["sharding"][f"{loss_mode}/{loss_agg_mode}"]
    assert set(r["metric_keys"]) == METRIC_KEYS and r["metrics_detached_fp32_scalars"], r
    # The whole batch as one micro-batch is the library's loss on full-vocabulary log-probs ...
    assert r["loss_vs_ref"] < r["loss_tolerance"] and r["metrics_vs_ref"] < r["loss_tolerance"], r
    assert r["grad_vs_ref"] < r["loss_tolerance"] / r["grad_max"], r
    # ... and 4 uneven micro-batches over 2 DP ranks give the same gradient and metric sums: the
    # same terms added in up to 8 parts.
    assert r["grad_max"] > 1e-4, "test batch gives no gradient"
    assert 0.0 < r["clipfrac"] < 1.0, "test batch should clip some tokens, not all"
    parts = sum(len(micro_batches) for micro_batches in SPLITS)
    assert r["split_vs_whole"] < rounding(1.0, parts) and r["metric_sum_vs_whole"] < rounding(r["metric_max"], parts), r


@pytest.mark.slow
@pytest.mark.parametrize("case", DEGENERATE_CASES, ids="/".join)
def test_degenerate_batches_give_finite_loss_and_grads(hook_results, case):
    r = hook_results["degenerate"]["/".join(case)]
    assert r["finite"] and r["grad_nonzero"], r
    assert r["empty_loss"] == 0.0 and r["empty_grad_zero"] and r["empty_metrics"] == [0.0] * 6, r


@pytest.mark.slow
def test_log_prob_func_returns_zero_loss_and_detached_outputs(hook_results):
    r = hook_results["log_prob_func"]
    assert r["loss"] == [0, 0.0]
    assert r["keys"] == [["entropy", "log_probs"], ["log_probs"]]
    assert r["detached"] and r["equal"]


# --- in-process: rollout IS weights from the micro-batch (full vocabulary = TP 1, no megatron) ----
@pytest.fixture
def torch_only_hook(monkeypatch):
    """The hook module with megatron's TP group replaced by one rank (nothing to all-reduce), in process."""
    import loss.megatron_hook as hook
    import loss.vocab_parallel

    monkeypatch.setattr(loss.vocab_parallel, "_tp_group_rank_size", lambda: (None, 0, 1))
    return hook


def _whole_batch_loss(hook, cfg: ActorLossConfig, batch: dict, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    mask = batch["response_mask"].bool()
    norm = MiniBatchNorm(dp_size=1, num_microbatches=1, batch_num_tokens=int(mask.sum()),
                         global_batch_size=int(mask.any(-1).sum()))
    leaf = logits.clone().requires_grad_()
    loss, metrics = hook.policy_loss_func(cfg, norm, batch, leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad, metrics


@pytest.mark.filterwarnings("ignore:policy loss 'gspo")  # the GSPO aggregation warning has its own test
@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("loss_mode", ["gspo", "gspo_token", "vanilla"])
def test_policy_loss_func_applies_rollout_is_weights_from_the_micro_batch(torch_only_hook, loss_mode, loss_agg_mode):
    cfg = _hook_config(loss_mode, loss_agg_mode)
    batch, logits, _ = _hook_batch(seed=5, padding=50.0)
    mask = batch["response_mask"].bool()
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(6)) * 2
    weighted = {**batch, "rollout_is_weights": weights.masked_fill(~mask, float("nan"))}

    plain_loss, plain_grad, _ = _whole_batch_loss(torch_only_hook, cfg, batch, logits)
    ones = {**batch, "rollout_is_weights": torch.ones_like(weights)}
    ones_loss, ones_grad, _ = _whole_batch_loss(torch_only_hook, cfg, ones, logits)
    assert torch.equal(ones_loss, plain_loss) and torch.equal(ones_grad, plain_grad)

    loss, grad, metrics = _whole_batch_loss(torch_only_hook, cfg, weighted, logits)
    log_probs, _ = torch_only_hook.response_log_probs(logits, batch, cfg.temperature, False)
    expected_pg, _ = compute_policy_loss(
        cfg.loss_mode, batch["old_log_probs"], log_probs, batch["advantages"], mask, cfg.policy,
        rollout_is_weights=weights,
    )  # fmt: skip
    # the same fp32 terms, |A| x weight x ratio at most, summed by another code path
    term = batch["advantages"][mask].abs().max() * weights.max() * (log_probs - batch["old_log_probs"])[mask].abs().max().exp()
    assert metrics["actor/pg_loss"].item() == pytest.approx(expected_pg.item(), abs=rounding(float(term), int(mask.sum())))
    assert not torch.equal(loss, plain_loss) and grad.isfinite().all()

    # Split over micro-batches and DP ranks, the weighted gradient is still the whole batch's.
    counts = dict(batch_num_tokens=int(mask.sum()), global_batch_size=int(mask.any(-1).sum()))
    grad_split = torch.zeros_like(logits)
    for micro_batches in SPLITS:
        norm = MiniBatchNorm(dp_size=len(SPLITS), num_microbatches=len(micro_batches), **counts)
        for rows in micro_batches:
            idx = torch.tensor(rows)
            leaf = logits.clone().requires_grad_()
            micro_batch = {k: v[idx] for k, v in weighted.items()}
            mb_loss, _ = torch_only_hook.policy_loss_func(cfg, norm, micro_batch, leaf[idx])
            grad_split += torch.autograd.grad(mb_loss / norm.num_microbatches, leaf)[0] / norm.dp_size
    assert _rel_err(grad_split, grad) < rounding(1.0, sum(len(micro_batches) for micro_batches in SPLITS))


# --- in-process: config validation and import isolation ------------------------------------------
@pytest.mark.parametrize(
    "field, value, listed",
    [("loss_mode", "ppo2", "gspo"), ("kl_loss_type", "k4", "low_var_kl")],
)
def test_config_rejects_unknown_choices_naming_field_and_choices(field, value, listed):
    with pytest.raises(ValueError, match=field) as info:
        ActorLossConfig(**{field: value})
    assert listed in str(info.value)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_config_rejects_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        ActorLossConfig(temperature=temperature)


def test_config_rejects_negative_log_prob_chunk_size():
    assert ActorLossConfig(log_prob_chunk_size=0).log_prob_chunk_size == 0  # one chunk: no chunking
    with pytest.raises(ValueError, match="log_prob_chunk_size"):
        ActorLossConfig(log_prob_chunk_size=-1)


def test_config_defaults_are_verls_and_the_recipes_and_frozen():
    from recipe.config import ActorConfig

    cfg = ActorLossConfig()
    assert (cfg.loss_mode, cfg.policy.loss_agg_mode, cfg.policy.clip_ratio_low, cfg.policy.clip_ratio_high) == (
        "vanilla", "token-mean", 0.2, 0.2,
    )
    # One source: the recipe's loss keys default to the loss package's values.
    actor = ActorConfig()
    assert (actor.policy_loss.loss_mode, actor.loss_agg_mode, actor.clip_ratio_low, actor.clip_ratio_high,
            actor.clip_ratio_c, actor.kl_loss_coef, actor.kl_loss_type, actor.entropy_coeff) == (
        cfg.loss_mode, cfg.policy.loss_agg_mode, cfg.policy.clip_ratio_low, cfg.policy.clip_ratio_high,
        cfg.policy.clip_ratio_c, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.entropy_coeff,
    )
    with pytest.raises(AttributeError):
        cfg.temperature = 2.0


def test_importing_loss_and_the_hook_does_not_import_megatron():
    # On Ascend, MindSpeed must patch megatron before anything imports it.
    code = "import sys, loss, loss.megatron_hook; print(any(m.startswith('megatron.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
