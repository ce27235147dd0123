"""One GSPO and one GRPO update through megatron's forward_backward_func, DistributedOptimizer and
the loss hook give the same new weights however the mini-batch is split: micro-batch 1 vs 4 vs a
token budget (dynamic batch size), DP1 vs DP2, PP1 vs PP2 (also interleaved, VPP2), EP1 vs EP2,
TP2 with sequence parallel; packed (the rows of a micro-batch back to back) or padded; and whatever
computes it: the fast paths (SDPA attention, grouped experts) or megatron's DotProductAttention
and SequentialMLP. Plus the steps that must not break the weights."""

import math

import pytest
import torch

from loss import PolicyLossSettings
from loss.megatron_hook import ActorLossConfig
from megatron_bridge.plan.layout import TrainParallel
from tests.distributed import reset_parallel_state, run_ranks
from tests.numerics import forward_terms, rounding
from megatron_bridge.tiny_model import save_tiny_checkpoint as save_checkpoint
from megatron_bridge.verify import reference

ROWS, WIDTH = 8, 6
# A large Adam eps: without it, gradients that are zero up to rounding (different in every
# layout) would still move weights by ~lr, since Adam divides by their own magnitude.
OPTIM = dict(lr=1e-3, adam_eps=1e-4, weight_decay=0.1, clip_grad=1.0)
LOSSES = {
    # Clip ranges wide enough that some sequences are clipped and some are not.
    "gspo": ActorLossConfig(loss_mode="gspo", policy=PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-mean")),
    "grpo": ActorLossConfig(loss_mode="vanilla", policy=PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean"),
                            use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01),
}


def make_batch(checkpoint: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """8 rows with different prompt and response lengths; old/ref log-probs near the model's own."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 6, (ROWS,), generator=g)
    response = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    length = int((prompt + response).max())
    ids = torch.randint(3, 512, (ROWS, length), generator=g)
    mask = (torch.arange(WIDTH) < response[:, None]).float()
    ids = torch.where(torch.arange(length) < (prompt + response)[:, None], ids, 0)  # right padding
    batch = {"input_ids": ids, "prompt_lengths": prompt, "response_mask": mask}
    own = own_log_probs(checkpoint, batch)
    return {
        **batch,
        "old_log_probs": own + 0.3 * torch.randn(ROWS, WIDTH, generator=g),
        "ref_log_probs": own + 0.3 * torch.randn(ROWS, WIDTH, generator=g),
        "advantages": torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH).clone(),
    }


def own_log_probs(checkpoint: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' log-probs of the batch's response tokens [B, WIDTH] under the checkpoint."""
    ids, prompt = batch["input_ids"], batch["prompt_lengths"]
    positions = (prompt[:, None] + torch.arange(WIDTH)).clamp(max=ids.shape[1] - 1)
    own = reference(checkpoint, ids)[0]  # [B, S-1]: token t+1 given tokens <= t
    return own.gather(1, (positions - 1).clamp(max=ids.shape[1] - 2))


def _update(rank, world_size, checkpoint, train_kwargs, micro_batch_size, max_tokens, batch, out_prefix, losses):
    """One step per loss (``losses``: name -> ActorLossConfig), each from the checkpoint's weights."""
    from functools import partial

    from megatron.core import parallel_state as ps

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.weights.export import local_hf_slices
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    pack = train_kwargs.get("pack", False)  # the actor's, beside the layout's keys
    train = TrainParallel(**{k: v for k, v in train_kwargs.items() if k != "pack"})
    initialize_parallel(train)
    spec = load_model_spec(checkpoint)
    optim = OptimConfig(**OPTIM)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = len(batch["input_ids"]) // dp
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    results = {}
    for name, loss in losses.items():
        actor = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), optim, "cpu", pack)
        actor.load_hf(checkpoint)
        assert actor.packs == pack
        before = {k: v.clone() for k, v in _named(actor).items()}
        metrics = actor.train_step(mine, micro_batch_size, partial(policy_loss_func, loss), max_tokens)
        slices = [(n, r, c, t.clone()) for n, r, c, t in local_hf_slices(actor.chunks, spec)]
        torch.save(slices, f"{out_prefix}_{name}_rank{rank}.pt")
        after = _named(actor)
        metrics["max_change"] = max(float((after[k] - before[k]).abs().max()) for k in after)
        metrics["max_weight"] = max(float(v.abs().max()) for v in after.values())
        metrics["max_grad"] = max_grad(actor)
        metrics["finite"] = all(bool(torch.isfinite(v).all()) for v in after.values())
        results[name] = metrics
    return results


def _updates(rank, world_size, checkpoint, splits, batch, out_dir, losses):
    """``_update`` for each split (layout, micro-batch rows, token budget[, its own losses]),
    megatron's parallel state built again between them."""
    results = {}
    for split, (train_kwargs, micro, max_tokens, *own) in splits.items():
        results[split] = _update(rank, world_size, checkpoint, train_kwargs, micro, max_tokens, batch,
                                 f"{out_dir}/{split}", own[0] if own else losses)
        reset_parallel_state()
    return results


def _named(actor):
    return {f"{i}.{n}": p.detach() for i, c in enumerate(actor.chunks) for n, p in c.named_parameters()}


def max_grad(actor) -> float:
    """The largest gradient element this rank's optimizer stepped with (clipped; megatron keeps
    the grad buffers until the next step)."""
    return max(float(p.main_grad.abs().max()) for c in actor.chunks for p in c.parameters())


def tolerances(checkpoint: str, batch: dict[str, torch.Tensor], ref: dict) -> dict[str, float]:
    """Absolute tolerances for the update's metrics across splits, and for a gradient element
    ("grad"), from the batch and the reference update's metrics and largest gradient element
    (tests.numerics)."""
    from megatron_bridge.plan.model_spec import load_model_spec

    spec, mask = load_model_spec(checkpoint), batch["response_mask"].bool()
    terms, tokens = forward_terms(spec, batch["input_ids"].shape[1]), int(mask.sum())
    # Every metric is a mean over tokens of a function of the model's log-probs: it carries their
    # rounding (|log p| through the forward pass) times the function's slope.
    log_prob = rounding(float(batch["old_log_probs"][mask].abs().max()), terms)
    own = own_log_probs(checkpoint, batch)
    ratio = float((batch["old_log_probs"] - own)[mask].abs().max().exp())  # exp |old - new|
    ref_ratio = float((batch["ref_log_probs"] - own)[mask].abs().max().exp())
    # Gradients: the backward pass retraces the forward's chain and sums over tokens.
    grad = rounding(ref["max_grad"], 2 * terms + tokens)
    params = sum(t.numel() for t in _hf_tensors(checkpoint))
    return {
        "grad": grad,
        "actor/pg_loss": float(batch["advantages"][mask].abs().max()) * ratio * log_prob,
        "actor/ppo_kl": log_prob,
        "actor/entropy": log_prob,
        "actor/kl_loss": ref_ratio * log_prob,
        "actor/pg_clipfrac": rounding(1.0, tokens),  # a share of tokens: exact unless a ratio sits on the clip edge
        "actor/lr": rounding(OPTIM["lr"], 1),
        # sqrt(sum g_i^2): the elements' rounding, and that of the sum of `params` squares
        "actor/grad_norm": grad + rounding(ref["actor/grad_norm"] ** 2, params) / (2 * ref["actor/grad_norm"]),
    }


def _hf_tensors(checkpoint: str) -> list[torch.Tensor]:
    from safetensors import safe_open

    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as f:
        return [f.get_tensor(k) for k in f.keys()]


def assemble(prefix: str, name: str, world_size: int) -> dict[str, torch.Tensor]:
    """Full HF tensors from every rank's slices; replicated slices must agree."""
    full: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        for hf_name, rows, cols, tensor in torch.load(f"{prefix}_{name}_rank{rank}.pt", weights_only=False):  # slices
            rows, cols = rows or slice(None), cols or slice(None)
            if hf_name not in full:
                full[hf_name] = torch.full(_full_shape(hf_name), math.nan)
            target = full[hf_name][rows] if tensor.dim() == 1 else full[hf_name][rows, cols]
            assert torch.isnan(target).all() or torch.equal(target, tensor), f"replicas of {hf_name} differ"
            if tensor.dim() == 1:
                full[hf_name][rows] = tensor
            else:
                full[hf_name][rows, cols] = tensor
    assert not any(torch.isnan(t).any() for t in full.values()), "some HF tensor was not covered by any rank"
    return full


def _full_shape(hf_name):
    from megatron_bridge.weights.load import hf_shape
    from megatron_bridge.plan.model_spec import load_model_spec

    return hf_shape(load_model_spec("tiny_qwen3_moe"), hf_name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return checkpoint_and_batch(tmp_path_factory)


def checkpoint_and_batch(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """The tiny checkpoint and the batch every update here starts from."""
    checkpoint = save_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=1)
    return checkpoint, make_batch(checkpoint)


SPLITS = {  # name: (ranks, layout, micro-batch rows, token budget)
    "dp1_mb4": (1, {}, 4, None),
    "dp1_mb1": (1, {}, 1, None),
    "dp2_mb1": (2, {}, 1, None),
    "pp2_mb1": (2, {"pp": 2}, 1, None),
    # the interleaved schedule with PP 2: both p2p directions run between the same two ranks
    "pp2_vpp2_mb2": (2, {"pp": 2, "vpp": 2}, 2, None),
    "ep2_mb2": (2, {"ep": 2, "etp": 1}, 2, None),
    # dynamic batch size: micro-batches of 1 to 4 rows, each padded to its own longest sequence
    "dp1_tokens16": (1, {}, 1, 16),
    "dp2_tokens12": (2, {}, 1, 12),
    "ep2_tokens20": (2, {"ep": 2, "etp": 1}, 1, 20),
    "tp2_sp_tokens16": (2, {"tp": 2, "sequence_parallel": True}, 1, 16),
    # megatron's own modules in place of the fast paths the reference runs (SDPA attention, grouped
    # experts): one at a time, then both in the layouts that split attention or experts
    "dp1_mb4_megatron_attention": (1, {"flash_attn": False}, 4, None),
    "dp1_mb4_sequential_experts": (1, {"grouped_gemm": False}, 4, None),
    "ep2_mb2_megatron_kernels": (2, {"ep": 2, "etp": 1, "flash_attn": False, "grouped_gemm": False}, 2, None),
    "tp2_sp_mb2_megatron_kernels": (2, {"tp": 2, "sequence_parallel": True, "flash_attn": False,
                                        "grouped_gemm": False}, 2, None),
    "pp2_mb1_megatron_kernels": (2, {"pp": 2, "flash_attn": False, "grouped_gemm": False}, 1, None),
    # packed micro-batches (use_remove_padding): the rows back to back, no padding between them
    "dp1_mb4_packed": (1, {"pack": True}, 4, None),
    "dp2_tokens12_packed": (2, {"pack": True}, 1, 12),
    "ep2_mb2_packed": (2, {"ep": 2, "etp": 1, "pack": True}, 2, None),
    "tp2_sp_mb2_packed": (2, {"tp": 2, "sequence_parallel": True, "pack": True}, 2, None),
    # the allgather dispatcher's pipeline sends one shape: every micro-batch packed to the longest
    "pp2_mb2_packed": (2, {"pp": 2, "pack": True}, 2, None),
}


@pytest.fixture(scope="module")
def updates(setup, tmp_path_factory):
    return run_splits(setup, SPLITS, LOSSES, tmp_path_factory)


def run_splits(setup, splits: dict, losses: dict, tmp_path_factory) -> dict:
    """Every split's update (``splits``: name -> (ranks, layout, micro-batch rows, token budget[,
    its own losses])): the splits of one world size in one set of ranks (``_updates``). Returns
    per split (every rank's metrics, the assembled weights per loss)."""
    checkpoint, batch = setup
    out = {}
    for world in sorted({world for world, *_ in splits.values()}):
        mine = {split: rest for split, (w, *rest) in splits.items() if w == world}
        tmp = tmp_path_factory.mktemp(f"world{world}")
        results = run_ranks(_updates, world, tmp, checkpoint, mine, batch, str(tmp), losses)
        for split, rest in mine.items():
            names = rest[3] if len(rest) > 3 else losses
            out[split] = ([rank[split] for rank in results],
                          {name: assemble(str(tmp / split), name, world) for name in names})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("split", [s for s in SPLITS if s != "dp1_mb4"])
@pytest.mark.numerics
def test_update_is_the_same_for_any_split(setup, updates, split, loss_name):
    assert_same_update(setup, updates["dp1_mb4"], updates[split], loss_name, LOSSES[loss_name])


def assert_same_update(setup, reference, update, loss_name: str, loss: ActorLossConfig) -> None:
    """``update`` (every rank's metrics, the assembled weights) took the step ``reference`` took
    with the loss ``loss_name``, within the rounding of its sums (``tolerances``)."""
    checkpoint, batch = setup
    ref_results, ref_weights = reference
    results, weights = update
    ref = ref_results[0][loss_name]
    assert ref["actor/skipped"] == 0 and ref["max_change"] > 1e-4, "the reference update must move the weights"
    assert 0 < ref["actor/pg_clipfrac"] < 1, f"{loss_name}: the batch must mix clipped and unclipped tokens"
    tolerance = tolerances(checkpoint, batch, {**ref, "max_grad": max(r[loss_name]["max_grad"] for r in ref_results)})
    keys = ["actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/entropy", "actor/ppo_kl", "actor/lr"]
    keys += ["actor/kl_loss"] if loss.use_kl_loss else []
    for rank_result in results:
        got = rank_result[loss_name]
        for key in keys:
            assert got[key] == pytest.approx(ref[key], rel=0, abs=tolerance[key]), key
    assert weights[loss_name].keys() == ref_weights[loss_name].keys()
    # Adam's first step moves a weight by lr * g / (|g| + eps): its slope in g is at most lr / eps.
    atol = OPTIM["lr"] / OPTIM["adam_eps"] * tolerance["grad"] + rounding(ref["max_weight"], 2)
    for hf_name, tensor in ref_weights[loss_name].items():
        torch.testing.assert_close(weights[loss_name][hf_name], tensor, rtol=0, atol=atol, msg=hf_name)


def _edge_step(rank, world_size, checkpoint, batch, loss_name):
    from functools import partial

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    train = TrainParallel()
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(checkpoint), train, BuildOptions(params_dtype=torch.float32),
                          OptimConfig(lr=1e-3), "cpu")
    actor.load_hf(checkpoint)
    before = {k: v.clone() for k, v in _named(actor).items()}
    metrics = actor.train_step(batch, 2, partial(policy_loss_func, LOSSES[loss_name]))
    after = _named(actor)
    return {
        "metrics": metrics,
        "finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
        "unchanged": all(torch.equal(before[k], after[k]) for k in after),
    }


@pytest.mark.slow
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_zero_length_response_and_equal_rewards_keep_weights_finite(setup, tmp_path, loss_name):
    checkpoint, batch = setup
    batch = {k: v.clone() for k, v in batch.items()}
    batch["response_mask"][0] = 0  # a zero-length response
    batch["advantages"].zero_()  # every group's rewards equal
    (result,) = run_ranks(_edge_step, 1, tmp_path, checkpoint, batch, loss_name)
    assert result["metrics"]["actor/skipped"] == 0
    assert all(math.isfinite(v) for v in result["metrics"].values())
    assert result["finite"]


@pytest.mark.slow
def test_non_finite_loss_skips_the_step_and_keeps_the_weights(setup, tmp_path):
    checkpoint, batch = setup
    batch = {k: v.clone() for k, v in batch.items()}
    batch["advantages"][1] = math.nan
    (result,) = run_ranks(_edge_step, 1, tmp_path, checkpoint, batch, "gspo")
    assert result["metrics"]["actor/skipped"] == 1
    assert result["unchanged"]


def _epochs(rank, world_size, checkpoint, batch, optim_kwargs):
    from functools import partial

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    train = TrainParallel()
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(checkpoint), train, BuildOptions(params_dtype=torch.float32),
                          OptimConfig(**optim_kwargs), "cpu")
    actor.load_hf(checkpoint)
    steps = actor.update(batch, mini_batch_size=4, micro_batch_size=2, epochs=2,
                         loss_fn=partial(policy_loss_func, LOSSES["gspo"]))
    return {"lrs": [s["actor/lr"] for s in steps], "losses": [s["actor/pg_loss"] for s in steps], "steps": actor.steps}


@pytest.mark.slow
def test_update_runs_ppo_epochs_over_mini_batches_on_the_lr_schedule(setup, tmp_path):
    checkpoint, batch = setup
    (tmp_path / "warm").mkdir()
    (tmp_path / "cos").mkdir()
    (warm,) = run_ranks(_epochs, 1, tmp_path / "warm", checkpoint, batch, dict(lr=1e-3, lr_warmup_steps=2))
    # 8 rows / mini-batch 4 x 2 epochs = 4 optimizer steps; linear warmup reaches lr at step 2.
    assert warm["steps"] == 4
    assert warm["lrs"] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    # The second epoch sees the first mini-batch again, after two updates: its loss has moved.
    assert warm["losses"][2] != pytest.approx(warm["losses"][0], abs=1e-7)
    (cos,) = run_ranks(_epochs, 1, tmp_path / "cos", checkpoint, batch,
                       dict(lr=1e-3, min_lr=1e-4, lr_warmup_steps=1, lr_decay_style="cosine", lr_decay_steps=4))
    lrs = cos["lrs"]
    assert lrs[0] == pytest.approx(1e-3) and lrs[0] > lrs[1] > lrs[2] > lrs[3] >= 1e-4


def test_token_budget_runs_group_sorted_rows_under_the_budget():
    from megatron_bridge.runtime.actor import token_budget_runs

    lengths = [11, 9, 9, 6, 5, 3, 2, 1]  # longest first
    runs = token_budget_runs(lengths, max_tokens=20, multiple=1)
    assert runs == [(0, 1), (1, 3), (3, 6), (6, 8)]
    # each run's padded size (rows x its first length) fits, and the runs cover every row once
    assert all((end - start) * lengths[start] <= 20 for start, end in runs)
    # rounded up to a multiple of TP 2: 6 -> 6, 5 -> 6 fit three rows (18), 3 rows of 9 -> 10 do not
    assert token_budget_runs(lengths, max_tokens=20, multiple=2) == [(0, 1), (1, 3), (3, 6), (6, 8)]
    assert token_budget_runs(lengths, max_tokens=18, multiple=4) == [(0, 1), (1, 2), (2, 3), (3, 5), (5, 8)]
    # a multiple of PP micro-batches (the interleaved schedule), when there are rows enough: the
    # runs with the most rows are halved
    assert token_budget_runs([2] * 8, max_tokens=100, multiple=1, runs_multiple_of=2) == [(0, 4), (4, 8)]
    assert token_budget_runs([2] * 8, max_tokens=100, multiple=1) == [(0, 8)]
    assert token_budget_runs(lengths, max_tokens=20, multiple=1, runs_multiple_of=3) == [
        (0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 8)]
    assert token_budget_runs([5, 5], max_tokens=100, multiple=1, runs_multiple_of=4) == [(0, 1), (1, 2)]
    # packed, a run's size is its rows' tokens (rounded up to the multiple), not rows x the longest
    assert token_budget_runs(lengths, max_tokens=20, multiple=1, packed=True) == [(0, 2), (2, 5), (5, 8)]
    assert token_budget_runs(lengths, max_tokens=19, multiple=1, packed=True) == [(0, 1), (1, 3), (3, 8)]
    assert token_budget_runs(lengths, max_tokens=19, multiple=4, packed=True) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    with pytest.raises(ValueError, match="12 tokens .* at least 12"):
        token_budget_runs([12, 3], max_tokens=10, multiple=4)


def _log_probs(rank, world_size, checkpoint, batch, train_kwargs, micro_batch_size, max_tokens, pack=False):
    from functools import partial

    from loss.megatron_hook import log_prob_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(checkpoint), train, BuildOptions(params_dtype=torch.float32),
                          OptimConfig(lr=1e-3), "cpu", pack)
    actor.load_hf(checkpoint)
    try:
        shapes = [tuple(mb["input_ids"].shape) for mb in actor.micro_batches(batch, micro_batch_size, max_tokens)]
        out = actor.forward_only(batch, micro_batch_size, partial(log_prob_func, 1.0, False), max_tokens)
    except ValueError as error:
        return {"error": str(error)}
    return {"shapes": shapes, "log_probs": out["log_probs"].tolist()}


@pytest.mark.slow
def test_forward_only_by_token_budget_returns_rows_in_batch_order(setup, tmp_path):
    checkpoint, batch = setup
    (tmp_path / "rows").mkdir()
    (tmp_path / "tokens").mkdir()
    (fixed,) = run_ranks(_log_probs, 1, tmp_path / "rows", checkpoint, batch, {}, 4, None)
    (budget,) = run_ranks(_log_probs, 1, tmp_path / "tokens", checkpoint, batch, {}, 1, 16)
    fixed["shapes"], budget["shapes"] = [list(map(tuple, r["shapes"])) for r in (fixed, budget)]
    assert len(set(fixed["shapes"])) == 1
    assert len(budget["shapes"]) > len(fixed["shapes"]) and len({s[1] for s in budget["shapes"]}) > 1
    padded = lambda shapes: sum(rows * length for rows, length in shapes)  # noqa: E731
    assert padded(budget["shapes"]) < padded(fixed["shapes"])
    mask = batch["response_mask"].bool()
    got, want = torch.tensor(budget["log_probs"]), torch.tensor(fixed["log_probs"])
    assert (want[mask] < 0).all()
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_packed_micro_batches_hold_their_rows_back_to_back(setup, tmp_path):
    checkpoint, batch = setup
    (tmp_path / "padded").mkdir()
    (tmp_path / "packed").mkdir()
    (padded,) = run_ranks(_log_probs, 1, tmp_path / "padded", checkpoint, batch, {}, 4, None)
    (packed,) = run_ranks(_log_probs, 1, tmp_path / "packed", checkpoint, batch, {}, 4, None, True)
    ends = (batch["prompt_lengths"] + batch["response_mask"].sum(1)).long()
    # one sequence per micro-batch, as long as its rows' tokens up to their response ends
    assert [tuple(shape) for shape in packed["shapes"]] == [(1, int(ends[:4].sum())), (1, int(ends[4:].sum()))]
    assert sum(rows * length for rows, length in padded["shapes"]) > sum(length for _, length in packed["shapes"])
    mask = batch["response_mask"].bool()
    got, want = torch.tensor(packed["log_probs"]), torch.tensor(padded["log_probs"])
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_token_budget_with_pipeline_and_allgather_dispatcher_is_refused(setup, tmp_path):
    checkpoint, batch = setup
    results = run_ranks(_log_probs, 2, tmp_path, checkpoint, batch, {"pp": 2}, 1, 16)
    assert all("pipeline_model_parallel_size=1" in r["error"] for r in results)
