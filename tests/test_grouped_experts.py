"""Grouped experts (``megatron_bridge.runtime.experts``) replace megatron's ``SequentialMLP`` without a
trace: ``grouped_linear`` equals the per-expert loop (``torch._grouped_mm`` or not, empty groups,
no tokens, fp32 and bf16, a non-contiguous incoming gradient); the module and the whole actor give
``SequentialMLP``'s forward, gradients and optimizer step under EP1 / EP2 / TP2+SP / PP2; their
sharded state dict is ``SequentialMLP``'s, tensor for tensor, so a checkpoint crosses between the two
layouts (and parallel layouts) with weights and optimizer state bit for bit; ``megatron_bridge.verify``
passes with sequential experts too (its default, grouped, runs in tests/test_actor_parity.py).
The HF export with either layout: tests/test_export.py; the planner's memory: tests/test_memory_megatron.py."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

import pytest
import torch

from megatron_bridge.plan.layout import TrainParallel
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.runtime import experts
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks
from tests.numerics import log_prob_tolerance, rounding
from tests.test_actor_update import LOSSES, OPTIM, make_batch, tolerances
from tests.test_model_merger import _checkpoint

# ---- grouped_linear ------------------------------------------------------------------------------

K, N = 32, 48  # in and out features: rows of 64 / 96 bytes in bf16, as torch._grouped_mm needs (16-byte aligned)


def _grouped_mm_calls(monkeypatch) -> list:
    """Records each call of torch._grouped_mm (grouped_linear looks it up at every call)."""
    calls, real = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


def _linear(x, weight, counts, grad, loop_only: bool, monkeypatch):
    """grouped_linear's output and gradients for incoming gradient ``grad``, on the grouped path or the loop."""
    with monkeypatch.context() as patch:
        if loop_only:
            patch.setattr(experts, "_grouped_mm_runs", lambda device, dtype: False)
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        out = experts.grouped_linear(x, weight, counts)
        out.backward(grad)
    return out.detach(), x.grad, weight.grad


def _inputs(counts, dtype, in_features=K, out_features=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), in_features, generator=g).to(dtype)
    weight = (torch.randn(len(counts), out_features, in_features, generator=g) / in_features**0.5).to(dtype)
    # the incoming gradient laid out transposed: not contiguous, as a slice of a fused backward can be
    grad = torch.randn(out_features, sum(counts), generator=g).to(dtype).t()
    return x, weight, grad


def _assert_close(got, want, x, weight, grad, counts, dtype):
    """Within the rounding of each product's sum: out over K terms x*w, dx over N terms grad*w, dw
    over a group's tokens grad*x."""
    size = lambda t: float(t.abs().max())  # noqa: E731
    sums = {"out": (size(x) * size(weight), K), "dx": (size(grad) * size(weight), N),
            "dw": (size(grad) * size(x), max(counts))}
    for (name, (magnitude, terms)), a, b in zip(sums.items(), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (counts, name)
        assert float((a.float() - b.float()).abs().max()) <= rounding(magnitude, terms, dtype), (counts, name)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 3, 8], [0, 0, 11, 0], [16]], ids=["empty_group", "one_group", "one_expert"])
def test_grouped_mm_equals_the_loop(monkeypatch, dtype, counts):
    """torch._grouped_mm runs here (fp32 and bf16 on the CPU in torch >= 2.9) and gives the loop's
    numbers, forward and backward, with empty groups and a non-contiguous incoming gradient."""
    x, weight, grad = _inputs(counts, dtype)
    assert not grad.is_contiguous()
    calls = _grouped_mm_calls(monkeypatch)
    grouped = _linear(x, weight, counts, grad, False, monkeypatch)
    assert calls, "the grouped path did not run"
    calls.clear()
    loop = _linear(x, weight, counts, grad, True, monkeypatch)
    assert not calls
    _assert_close(grouped, loop, x, weight, grad, counts, dtype)
    # an expert without tokens gets a zero gradient, not none
    for e, n in enumerate(counts):
        if not n:
            assert torch.equal(grouped[2][e], torch.zeros_like(weight[e]))


@pytest.mark.gpu
@pytest.mark.numerics
def test_grouped_mm_equals_the_loop_on_a_gpu(monkeypatch):
    """bf16 on a GPU (torch._grouped_mm: Hopper and newer in torch 2.8, any CUDA GPU from 2.9): the
    grouped path runs and gives the loop's numbers, with an empty group and a non-contiguous
    incoming gradient (which its backward refuses without the guard)."""
    counts = [5, 0, 3, 8]
    x, weight, grad = (t.cuda() for t in _inputs(counts, torch.bfloat16))
    assert not grad.is_contiguous()
    calls = _grouped_mm_calls(monkeypatch)
    grouped = _linear(x, weight, counts, grad, False, monkeypatch)
    assert calls, "the grouped path did not run"
    _assert_close(grouped, _linear(x, weight, counts, grad, True, monkeypatch), x, weight, grad, counts, torch.bfloat16)


def test_offsets_given_once_are_the_counts_cumulative_sums(monkeypatch):
    """The experts' forward makes the group offsets once (``expert_offsets``, int32 on the rows'
    device) and hands them to both products: the same numbers as offsets made from the counts."""
    counts = [5, 0, 3, 8]
    offsets = experts.expert_offsets(torch.tensor(counts), torch.device("cpu"))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [5, 5, 8, 16]
    x, weight, _ = _inputs(counts, torch.float32)
    calls = _grouped_mm_calls(monkeypatch)
    assert torch.equal(experts.grouped_linear(x, weight, counts, offsets), experts.grouped_linear(x, weight, counts))
    assert len(calls) == 2


@pytest.mark.gpu
def test_offsets_reach_the_gpu_without_a_host_synchronisation(monkeypatch):
    """The counts arrive in host memory (megatron's dispatchers move them there); their offsets go up
    from pinned memory without making the host wait, and both grouped products and their backward
    run without a wait either (torch's sync debug mode raises on any)."""
    counts = [5, 0, 3, 8]
    x, weight, grad = (t.cuda() for t in _inputs(counts, torch.bfloat16))
    x, weight = x.requires_grad_(), weight.requires_grad_()
    assert experts._grouped_mm_runs(x.device, x.dtype)  # its one-off probe, before the waits are refused
    calls = _grouped_mm_calls(monkeypatch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        offsets = experts.expert_offsets(torch.tensor(counts), x.device)
        out = experts.grouped_linear(x, weight, counts, offsets)
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls and offsets.device == x.device and offsets.tolist() == [5, 5, 8, 16]
    torch.testing.assert_close(out, experts.grouped_linear(x.detach(), weight.detach(), counts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_give_an_empty_output_and_zero_weight_gradients(monkeypatch, dtype):
    x, weight, grad = _inputs([0, 0, 0], dtype)
    for loop_only in (False, True):
        out, dx, dw = _linear(x, weight, [0, 0, 0], grad, loop_only, monkeypatch)
        assert out.shape == (0, N) and dx.shape == (0, K) and out.dtype == dtype
        assert torch.equal(dw, torch.zeros_like(weight))


def test_unaligned_shapes_take_the_loop(monkeypatch):
    """fp32 rows of 7 features (28 bytes) are not 16-byte aligned: the loop runs (the same numbers
    as the loop forced), torch._grouped_mm is not called."""
    counts = [3, 0, 4]
    x, weight, grad = _inputs(counts, torch.float32, in_features=7, out_features=5)
    calls = _grouped_mm_calls(monkeypatch)
    got = _linear(x, weight, counts, grad, False, monkeypatch)
    assert not calls
    for a, b in zip(got, _linear(x, weight, counts, grad, True, monkeypatch)):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[0], torch.cat([rows @ w.t() for rows, w in zip(x.split(counts), weight)]))


# ---- the checkpoint factory, unit by unit ---------------------------------------------------------


def _sharded_tensor_rows(tree) -> list[tuple]:
    """Every ShardedTensor of a nested list as comparable metadata and data."""
    if isinstance(tree, list):
        return [row for item in tree for row in _sharded_tensor_rows(item)]
    return [(tree.key, tree.global_shape, tree.global_offset, tree.local_shape, tree.axis_fragmentations,
             tree.replica_id, tree.prepend_axis_num, tree.flattened_range, tree.dtype, tree.data.tolist())]


@pytest.mark.parametrize("fc", ["linear_fc1", "linear_fc2"])
@pytest.mark.parametrize("etp_rank, etp_size", [(0, 1), (1, 2)])
def test_optimizer_shards_split_per_expert_as_sequential_mlp_gives_them(fc, etp_rank, etp_size):
    """A flat range of a stacked parameter (the distributed optimizer's shard: any start and stop,
    across experts and gate/up halves) becomes the sharded tensors megatron makes from
    SequentialMLP's per-expert factories for the same elements, and merges back to itself."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    local, first, total = 3, 3, 6  # EP rank 1 of 2
    rows, cols = (8, 4) if fc == "linear_fc1" else (4, 8)
    stacked = torch.arange(local * rows * cols, dtype=torch.float32).view(local, rows, cols)
    key = f"decoder.layers.mlp.experts.experts.{fc}.weight"
    offsets = [((0, 2, 5), (1, first + e, total)) for e in range(local)]  # layer 2 of 5, then the expert
    tp_axis = 0 if fc == "linear_fc1" else 1
    templates = [ShardedTensor.from_rank_offsets(key, stacked[e], *o, (len(o) + tp_axis, etp_rank, etp_size),
                                                 replica_id=(0, 0, 1), prepend_axis_num=len(o))
                 for e, o in enumerate(offsets)]
    swiglu = offsets if fc == "linear_fc1" else None
    # megatron's per-expert factories in a SequentialMLP's sharded state dict
    sequential = [apply_swiglu_sharded_factory(t, o) if swiglu else t for t, o in zip(templates, offsets)]
    opt_key, replica = f"optimizer.state.exp_avg.{key}", (0, 0, 0)
    per_expert = rows * cols
    bounds = sorted({0, 5, per_expert // 2 - 1, per_expert // 2, per_expert, per_expert + 3, 2 * per_expert + 9,
                     local * per_expert - 1, local * per_expert})
    checked = 0
    for start in bounds:
        for stop in (b for b in bounds if b > start):
            flat = stacked.flatten()[start:stop].clone()
            got = experts._build_expert_shards(templates, swiglu, opt_key, flat, replica, slice(start, stop))
            want = []
            for e, entry in enumerate(sequential):  # the optimizer's replace() of each expert's entry, built
                lo, hi = max(start, e * per_expert), min(stop, (e + 1) * per_expert)
                if lo < hi:
                    piece, local_range = flat[lo - start : hi - start], slice(lo - e * per_expert, hi - e * per_expert)
                    kwargs = dict(key=opt_key, data=piece, flattened_range=local_range, replica_id=replica)
                    built = replace(entry, **kwargs) if swiglu else replace(entry, dtype=piece.dtype, **kwargs)
                    want.append(built.build() if swiglu else [built])
            assert _sharded_tensor_rows(got) == _sharded_tensor_rows(want), (start, stop)
            merged = experts._merge_expert_shards([[t.data for t in halves] for halves in got])
            assert torch.equal(merged, flat)
            checked += 1
    assert checked > 30
    # the whole stacked parameter (the model's weights): every expert whole, merged back to [E, rows, cols]
    whole = experts._build_expert_shards(templates, swiglu, key, stacked, (0, 0, 1), None)
    assert len(whole) == local and all(len(halves) == (2 if swiglu else 1) for halves in whole)
    assert _sharded_tensor_rows(whole) == _sharded_tensor_rows([e.build() if swiglu else [e] for e in sequential])
    assert torch.equal(experts._merge_expert_shards([[t.data for t in halves] for halves in whole]), stacked)


def _sharded_state_dicts(rank, world_size, checkpoint, train_kwargs):
    """Both expert layouts' model sharded state dicts (factories built) as sorted comparable rows."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions

    initialize_parallel(TrainParallel(**train_kwargs))
    spec = load_model_spec(checkpoint)
    out = {}
    for grouped in (False, True):
        train = TrainParallel(**train_kwargs, grouped_gemm=grouped)
        actor = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), None, "cpu")
        actor.load_hf(checkpoint)
        state = actor.chunks[0].module.sharded_state_dict()
        apply_factories(state)
        rows = []
        for item in nested_values(state):
            fields = [item.key, item.global_shape, item.global_offset, item.replica_id]
            if isinstance(item, ShardedTensor):
                fields += [item.local_shape, item.axis_fragmentations, item.prepend_axis_num, item.flattened_range,
                           item.dtype, item.data.flatten().tolist()]
            rows.append(repr(fields))
        out[str(grouped)] = sorted(rows)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("train_kwargs", [{"ep": 2, "etp": 1}, {"tp": 2, "etp": 2, "sequence_parallel": True}],
                         ids=["ep2", "tp2_etp2"])
def test_sharded_state_dict_is_sequential_mlps(tmp_path, train_kwargs):
    """The same sharded tensors and objects, data included, as SequentialMLP on every rank: experts
    spread over EP ranks, and gate/up halves over expert-TP ranks."""
    checkpoint = save_tiny_checkpoint(tmp_path / "hf", seed=0)
    for rank in run_ranks(_sharded_state_dicts, 2, tmp_path, checkpoint, train_kwargs):
        sequential, grouped = rank["False"], rank["True"]
        assert any("experts.experts.linear_fc1.weight" in row for row in sequential)
        assert grouped == sequential


# ---- the module and the whole actor ---------------------------------------------------------------


def _module_pair(rank, world_size, dtype_name):
    """SequentialMLP and GroupedExperts with the same weights on the same permuted tokens (one expert
    without tokens): outputs and gradients of both."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.kernels import resolve
    from megatron_bridge.runtime.model import BuildOptions, transformer_config

    dtype = getattr(torch, dtype_name)
    train = TrainParallel()
    initialize_parallel(train)
    spec = load_model_spec("tiny_qwen3_moe")
    config = transformer_config(spec, train, BuildOptions(params_dtype=dtype), "cpu", resolve(train, "cpu"))
    local = spec.num_experts
    sequential = SequentialMLP(local, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear))
    grouped = experts.GroupedExperts(local, config)
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            grouped.fc1_weight[e].copy_(expert.linear_fc1.weight)
            grouped.fc2_weight[e].copy_(expert.linear_fc2.weight)
    counts = torch.tensor([3, 0, 5, 1, 7, 2, 4, 6])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(int(counts.sum()), spec.hidden_size, generator=g).to(dtype)
    probs = torch.rand(int(counts.sum()), generator=g).to(dtype)
    grad = torch.randn(hidden.shape, generator=g).to(dtype)
    results = []
    for module in (sequential, grouped):
        x, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = module(x, counts, p)
        assert bias is None
        out.backward(grad)
        weights = ((torch.stack([m.linear_fc1.weight.grad for m in module.local_experts]),
                    torch.stack([m.linear_fc2.weight.grad for m in module.local_experts]))
                   if module is sequential else (module.fc1_weight.grad, module.fc2_weight.grad))
        results.append([out, x.grad, p.grad, *weights])
    return {"max_abs": [float(t.abs().max()) for t in results[0]],
            "diff": [float((a.float() - b.float()).abs().max()) for a, b in zip(*results)],
            "terms": max(spec.hidden_size, 2 * spec.moe_ffn_hidden_size, int(counts.max()))}


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_module_equals_sequential_mlp(tmp_path, dtype):
    (result,) = run_ranks(_module_pair, 1, tmp_path, dtype)
    # output, d hidden, d probs, d fc1, d fc2: each a chain of two matmuls over at most `terms` terms
    for name, diff, magnitude in zip(("out", "dx", "dprobs", "dfc1", "dfc2"), result["diff"], result["max_abs"]):
        tolerance = 2 * rounding(magnitude, result["terms"], getattr(torch, dtype))
        assert diff <= tolerance, f"{name}: {diff} > {tolerance}"


_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.linear_fc([12])\.weight$")


def _by_grouped_name(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-parameter tensors keyed as GroupedExperts names them: SequentialMLP's experts stacked."""
    out, stacks = {}, {}
    for name, tensor in named.items():
        if m := _SEQUENTIAL.match(name):
            stacks.setdefault(f"{m[1]}fc{m[3]}_weight", {})[int(m[2])] = tensor
        else:
            out[name] = tensor
    out.update({name: torch.stack([per[e] for e in sorted(per)]) for name, per in stacks.items()})
    return out


def _actor_pair(rank, world_size, checkpoint, train_kwargs, batch, out_prefix):
    """Under one layout, SequentialMLP and then GroupedExperts: the batch's log-probs, one update's
    metrics, gradients (per parameter, by GroupedExperts' names) and new weights (HF slices)."""
    from megatron.core import parallel_state as ps

    from loss.megatron_hook import log_prob_func, policy_loss_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.weights.export import local_hf_slices

    initialize_parallel(TrainParallel(**train_kwargs))
    spec = load_model_spec(checkpoint)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = len(batch["input_ids"]) // dp
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    summary = {}
    for grouped in (False, True):
        actor = MegatronActor(spec, TrainParallel(**train_kwargs, grouped_gemm=grouped),
                              BuildOptions(params_dtype=torch.float32), OptimConfig(**OPTIM), "cpu")
        actor.load_hf(checkpoint)
        kinds = {type(m).__name__ for c in actor.chunks for m in c.modules()}
        log_probs = actor.forward_only(mine, 2, partial(log_prob_func, 1.0, False))["log_probs"]
        log_probs = log_probs[mine["response_mask"].bool()]
        metrics = actor.train_step(mine, 2, partial(policy_loss_func, LOSSES["gspo"]))
        # the step's (clipped) gradients stay in the grad buffers; with DP > 1 (EP2's dense parameters)
        # both actors lay the buffer out alike, so each element holds the same sum in both
        grads = _by_grouped_name({f"{i}.{n}": p.main_grad.clone() for i, c in enumerate(actor.chunks)
                                  for n, p in c.module.named_parameters()})
        torch.save({"log_probs": log_probs, "grads": grads,
                    "weights": [(n, r, c, t.clone()) for n, r, c, t in local_hf_slices(actor.chunks, spec)]},
                   f"{out_prefix}_{grouped}_rank{rank}.pt")
        summary[str(grouped)] = {**metrics, "max_grad": max(float(g.abs().max()) for g in grads.values()),
                                 "max_weight": max(float(p.abs().max()) for c in actor.chunks for p in c.parameters()),
                                 "experts": sorted(kinds & {"SequentialMLP", "GroupedExperts"})}
    return summary


ACTOR_LAYOUTS = {  # name: (ranks, layout)
    "ep1": (1, {}),
    "ep2": (2, {"ep": 2, "etp": 1}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}),  # expert TP 2: gate and up halves split
    "pp2": (2, {"pp": 2}),
}


@pytest.fixture(scope="module")
def model_and_batch(tmp_path_factory):
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=1)
    return checkpoint, make_batch(checkpoint)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("layout", list(ACTOR_LAYOUTS))
def test_actor_with_grouped_experts_equals_sequential(model_and_batch, tmp_path, layout):
    """Forward log-probs, the update's metrics and gradients, and the weights after one optimizer
    step, within fp32 rounding (tests.numerics, as tests/test_actor_update.py derives them)."""
    checkpoint, batch = model_and_batch
    world, train_kwargs = ACTOR_LAYOUTS[layout]
    summaries = run_ranks(_actor_pair, world, tmp_path, checkpoint, train_kwargs, batch, str(tmp_path / "r"))
    ref = summaries[0]["False"]
    kinds = [s[k]["experts"] for s in summaries for k in ("False", "True")]
    assert kinds == [["SequentialMLP"], ["GroupedExperts"]] * world
    assert ref["actor/skipped"] == 0
    tolerance = tolerances(checkpoint, batch, {**ref, "max_grad": max(s["False"]["max_grad"] for s in summaries)})
    for s in summaries:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/entropy", "actor/ppo_kl"):
            assert s["True"][key] == pytest.approx(s["False"][key], rel=0, abs=tolerance[key]), key
    weight_tolerance = OPTIM["lr"] / OPTIM["adam_eps"] * tolerance["grad"] + rounding(ref["max_weight"], 2)
    spec, seq_len = load_model_spec(checkpoint), batch["input_ids"].shape[1]
    for rank in range(world):
        sequential, grouped = (torch.load(f"{tmp_path}/r_{g}_rank{rank}.pt", weights_only=False) for g in (False, True))
        want = sequential["log_probs"]  # this DP rank's response tokens
        assert want.numel() and (want < 0).all()
        torch.testing.assert_close(grouped["log_probs"], want, rtol=0, atol=log_prob_tolerance(spec, want, seq_len))
        assert grouped["grads"].keys() == sequential["grads"].keys()
        assert any(name.endswith("fc1_weight") for name in grouped["grads"])
        for name, grad in sequential["grads"].items():
            torch.testing.assert_close(grouped["grads"][name], grad, rtol=0, atol=tolerance["grad"], msg=name)
        got, want = (_by_slice(result["weights"]) for result in (grouped, sequential))
        assert got.keys() == want.keys()
        for where, tensor in want.items():
            torch.testing.assert_close(got[where], tensor, rtol=0, atol=weight_tolerance, msg=where[0])


def _by_slice(slices) -> dict[tuple[str, str, str], torch.Tensor]:
    """HF slices (name, rows, cols, tensor) by where they sit (the layouts list them in other orders)."""
    return {(name, repr(rows), repr(cols)): tensor for name, rows, cols, tensor in slices}


# ---- checkpoints across the two layouts -----------------------------------------------------------


def _stored(rank, world_size, directories):
    """Which stored tensors of each checkpoint differ from the first one's (all keys alike), the
    keys, and the largest Adam moment of the experts (the update moved them)."""
    from megatron.core import dist_checkpointing

    from megatron_bridge.runtime.checkpoint import numpy2_compat

    numpy2_compat()
    first, *others = [dist_checkpointing.load_plain_tensors(d) for d in directories]
    tensors = sorted(k for k, v in first.items() if torch.is_tensor(v))
    moment = first["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    return {"keys": tensors,
            "same_keys": [sorted(other) == sorted(first) for other in others],
            "differ": [[k for k in tensors if not torch.equal(other[k], first[k])] for other in others],
            "max_expert_moment": float(moment.abs().max())}


CROSSING = [  # (name, layout on 2 ranks, the checkpoint it loads; None: one update from the HF model)
    ("sequential_ep2", {"ep": 2, "etp": 1, "grouped_gemm": False}, None),
    # the experts in the dense buffer, optimizer state sharded over DP2: a shard ends inside a stacked fc1
    ("grouped_dp2", {}, "sequential_ep2"),
    ("grouped_tp2_etp2", {"tp": 2, "etp": 2, "sequence_parallel": True}, "grouped_dp2"),  # gate/up halves over ETP
    ("sequential_dp2", {"grouped_gemm": False}, "grouped_tp2_etp2"),
]
LAYERS = 3  # the tiny model with 3 layers: DP2's optimizer shards of the grouped layout split an expert


def _shard_cuts_an_expert(spec) -> bool:
    """Whether DP2's optimizer shard boundary (grouped experts, one buffer) falls inside a stacked
    fc1 parameter, away from an expert's edge (the planner lays the buffer out as megatron does)."""
    from megatron_bridge.plan import memory

    train = TrainParallel(**CROSSING[1][1])
    params = memory.chunk_params(spec, train, 0, 0)
    buffer = memory.buffer_layout([p.numel for p in params], 2, distributed_optimizer=True)
    cut = buffer.numel // 2
    per_expert = 2 * spec.moe_ffn_hidden_size * spec.hidden_size
    for index, (start, stop) in zip(reversed(range(len(params))), buffer.ranges):
        if start < cut < stop:
            return params[index].numel == spec.num_experts * per_expert and (cut - start) % per_expert != 0
    return False


@pytest.mark.slow
def test_checkpoint_crosses_between_expert_layouts_bit_for_bit(tmp_path):
    """Written with SequentialMLP under EP2 after an update; loaded with grouped experts under DP2
    and saved; that loaded under TP2 with expert TP2 and saved; that loaded with SequentialMLP under
    DP2 and saved: every stored tensor (weights, fp32 main parameters, Adam moments) of every
    checkpoint is the first one's, bit for bit. The checkpoints read back as the same Hub tensors
    (megatron_bridge.weights.dist_checkpoint, the HF export's reader)."""
    from megatron_bridge.weights.dist_checkpoint import DistCheckpoint

    model = save_tiny_checkpoint(tmp_path / "hf", seed=1, num_hidden_layers=LAYERS)
    spec = load_model_spec(model)
    assert spec.num_layers == LAYERS and _shard_cuts_an_expert(spec)
    batch = make_batch(model)
    for name, train_kwargs, source in CROSSING:
        (tmp_path / f"run_{name}").mkdir()
        run_ranks(_checkpoint, 2, tmp_path / f"run_{name}", model, batch, train_kwargs, str(tmp_path / name),
                  None if source is None else str(tmp_path / source))
    (tmp_path / "compare").mkdir()
    (stored,) = run_ranks(_stored, 1, tmp_path / "compare", [str(tmp_path / name) for name, *_ in CROSSING])
    assert any(k.startswith("optimizer.state.exp_avg_sq.") and "experts" in k for k in stored["keys"])
    assert any(k.startswith("optimizer.state.fp32_param.") and "experts" in k for k in stored["keys"])
    assert stored["max_expert_moment"] > 0
    assert stored["same_keys"] == [True] * 3 and stored["differ"] == [[]] * 3
    first, last = (DistCheckpoint(tmp_path / name, spec) for name in (CROSSING[0][0], CROSSING[-1][0]))
    for (name_a, a), (name_b, b) in zip(first.stream(), last.stream(), strict=True):
        assert name_a == name_b and torch.equal(a, b), name_a


# ---- verify -----------------------------------------------------------------------------------------


def _verify_sequential(rank, world_size, argv):
    """``megatron_bridge.verify`` with SequentialMLP (it builds with TrainParallel's default, grouped)."""
    from megatron_bridge import verify

    layout = verify._train_parallel
    verify._train_parallel = lambda args: replace(layout(args), grouped_gemm=False)
    return verify.run(verify.parse_args(argv))


@pytest.mark.slow
@pytest.mark.numerics
def test_verify_passes_with_sequential_experts(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "hf", seed=0)
    argv = ["--hf-dir", checkpoint, "--platform", "cpu", "--seq-len", "24", "--tp", "2", "--ep", "2", "--etp", "2"]
    reports = run_ranks(_verify_sequential, 4, tmp_path, argv)
    assert all(r["passed"] for r in reports)
    report = reports[0]
    assert report["round_trip"]["bit_exact"] and report["routing"]["passed"]
