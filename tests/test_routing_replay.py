"""Routing capture and replay on megatron-core 0.12.1 routers, on CPU gloo ranks.

Checkpoint B is checkpoint A with every router's weights perturbed, so B routes many tokens to other
experts than A. Replaying A's routing in B must then give exactly the log-probs of transformers'
model B with its gates forced to A's experts (the gate weights still B's probabilities there), in
every layout, in forward-only passes and in the training forward (ratio 1, nothing clipped), with
full recompute too (the recompute replays: same update as without recompute), and the router must
still get gradients. R3 is the same with the CPU rollout engine's routing as the source.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from loss.gspo import PAPER_SETTINGS
from loss.megatron_hook import ActorLossConfig
from megatron_bridge.moe.hf_routing import HFRoutingRecorder
from megatron_bridge.moe.table import changed_slots
from megatron_bridge.tiny_model import save_tiny_checkpoint
from megatron_bridge.verify import reference
from tests.distributed import run_ranks
from tests.numerics import log_prob_tolerance
from tests.test_rollout_sync import engine_batch

ROWS, WIDTH = 8, 6
# GSPO's own clip range: any per-sequence ratio off 1 by more than 3e-4 would be clipped.
GSPO = ActorLossConfig(loss_mode="gspo", policy=PAPER_SETTINGS)
LAYOUTS = {
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2_vpp2": (2, dict(pp=2, vpp=2)),
    "ep2": (2, dict(ep=2, etp=1)),
    "tp2_ep2": (4, dict(tp=2, ep=2, etp=1, sequence_parallel=True)),
    # packed micro-batches: the routers see the rows back to back, with sequence parallel a slice of that
    "tp2_sp_packed": (2, dict(tp=2, sequence_parallel=True, pack=True)),
    # context parallel: each rank routes its load-balanced chunks of every sequence (packed: of each
    # row in the pack), with sequence parallel a TP slice of those
    "cp2": (2, dict(cp=2)),
    "tp2_cp2_packed": (4, dict(tp=2, cp=2, sequence_parallel=True, pack=True)),
}
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(A, B): B = A with noise on every router's weights."""
    from safetensors.torch import load_file, save_file

    a = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt_a"), seed=0)
    b = Path(shutil.copytree(a, tmp_path_factory.mktemp("ckpt") / "b"))
    tensors = load_file(b / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = tensor + tensor.std() * torch.randn(tensor.shape, generator=g)
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    return str(a), str(b)


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 6, (ROWS,), generator=g)
    response = torch.randint(2, WIDTH + 1, (ROWS,), generator=g)
    length = int((prompt + response).max())
    ids = torch.randint(3, 512, (ROWS, length), generator=g)
    ids = torch.where(torch.arange(length) < (prompt + response)[:, None], ids, 0)
    return {"input_ids": ids, "prompt_lengths": prompt, "response_mask": (torch.arange(WIDTH) < response[:, None]).float(),
            "advantages": torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH).clone()}


def response_window(per_position: torch.Tensor, batch: dict) -> torch.Tensor:
    """[B, S-1] log p(token t+1 | <= t) -> [B, WIDTH] over each row's response window."""
    positions = (batch["prompt_lengths"][:, None] + torch.arange(WIDTH) - 1).clamp(max=per_position.shape[1] - 1)
    return per_position.gather(1, positions)


def forced_log_probs(hf_dir: str, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """transformers' log-probs [B, S-1] with every gate forced to the experts of ``table``
    [B, S, layers, k] (-1: the gate's own choice), gate weights = its softmax renormalised there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for name, gate in model.named_modules():
        match = _GATE.match(name)
        if not match:
            continue
        forced = table[:, :, int(match[1])].reshape(-1, table.shape[-1]).long()

        def forward(hidden, gate=gate, forced=forced):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            own = logits.topk(gate.top_k, dim=-1).indices
            experts = torch.where((forced >= 0).all(-1, keepdim=True), forced, own)
            weights = torch.softmax(logits, dim=-1).gather(1, experts)
            return logits, weights / weights.sum(-1, keepdim=True), experts

        gate.forward = forward
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def _replay(rank, world_size, ckpt_a, ckpt_b, train_kwargs, batch, source, forced, out_prefix):
    """On each rank: capture A's routing, then in B: its own routing, replay in a forward-only pass
    and in a training step. ``source``: the table to replay (None: A's captured routing)."""
    from functools import partial

    from megatron.core import parallel_state as ps

    from loss.megatron_hook import log_prob_func, policy_loss_func
    from megatron_bridge.moe.routing import RoutingTap
    from megatron_bridge.runtime.batch import ROUTED_EXPERTS
    from megatron_bridge.moe.table import merge_records, routing_change
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.weights.export import local_hf_slices

    pack = train_kwargs.get("pack", False)  # the actor's, beside the layout's keys
    train = TrainParallel(**{k: v for k, v in train_kwargs.items() if k != "pack"})
    initialize_parallel(train)
    spec = load_model_spec(ckpt_a)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = torch.arange(ROWS).view(dp, -1)[dp_rank]
    mine = {k: v[share] for k, v in batch.items()}
    width = batch["input_ids"].shape[1]
    distinct = ps.get_tensor_model_parallel_rank() == 0 or train.sequence_parallel
    fp32 = BuildOptions(params_dtype=torch.float32)

    def table(record) -> torch.Tensor:
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, (share, record, distinct))
        return merge_records([e[1] for e in everyone], [e[0] for e in everyone], [e[2] for e in everyone], width,
                             spec.num_layers, spec.moe_topk).routing

    def log_probs(actor, tap, rows, micro=2, **mode):
        with tap.recording(len(rows["input_ids"]), width, training=False, **mode) as out:
            lp = actor.forward_only(rows, micro, partial(log_prob_func, 1.0, False))["log_probs"]
        return lp, out.record

    actor_a = MegatronActor(spec, train, fp32, None, "cpu", pack)
    actor_a.load_hf(ckpt_a)
    tap_a = RoutingTap(actor_a.chunks, spec.moe_topk, train.sequence_parallel)
    actor_a.forward_context = tap_a.micro_batch
    captured = table(log_probs(actor_a, tap_a, mine, capture=True, replay=False)[1])
    replayed = captured if source is None else source
    # the same weights routed again, in other micro-batches: no drift at all
    with tap_a.recording(len(share), width, capture=True, replay=False, training=False) as again:
        actor_a.forward_only(mine, 1, partial(log_prob_func, 1.0, False))
    repeat = routing_change(captured, table(again.record), valid_tokens(batch), "repeat")

    optim = OptimConfig(lr=1e-3, adam_eps=1e-4, weight_decay=0.0, clip_grad=1.0)
    actor_b = MegatronActor(spec, train, fp32, optim, "cpu", pack)
    actor_b.load_hf(ckpt_b)
    tap_b = RoutingTap(actor_b.chunks, spec.moe_topk, train.sequence_parallel)
    actor_b.forward_context = tap_b.micro_batch
    lp_native, record = log_probs(actor_b, tap_b, mine, capture=True, replay=False)
    native_b = table(record)
    with_source = {**mine, ROUTED_EXPERTS: replayed[share]}
    # replayed in other micro-batches than it was recorded in (4 rows instead of 2)
    lp_replay, _ = log_probs(actor_b, tap_b, with_source, micro=4, capture=False, replay=True)
    expected = forced[share]

    routers = {n: p.detach().clone() for c in actor_b.chunks for n, p in c.named_parameters() if n.endswith("router.weight")}
    step = {**with_source, "old_log_probs": expected}
    with tap_b.recording(len(share), width, capture=False, replay=True, training=True) as out:
        metrics = actor_b.train_step(step, 2, partial(policy_loss_func, GSPO))
    moved = [float((p.detach() - routers[n]).abs().max()) for c in actor_b.chunks for n, p in c.named_parameters()
             if n.endswith("router.weight")]
    slices = [(n, r, c, t.clone()) for n, r, c, t in local_hf_slices(actor_b.chunks, spec)]
    torch.save(slices, f"{out_prefix}_rank{rank}.pt")
    mask = mine["response_mask"].bool()
    return {
        "captured": captured.tolist(), "native_b": native_b.tolist(),
        "replay_vs_forced": float((lp_replay - expected)[mask].abs().max()),
        # transformers' forward against megatron's sharded one (tests.numerics); also bounds
        # ppo_kl, a mean of the same differences
        "tolerance": log_prob_tolerance(spec, expected[mask], mine["input_ids"].shape[1]),
        "native_vs_forced": float((lp_native - expected)[mask].abs().max()),
        "ppo_kl": metrics["actor/ppo_kl"], "pg_clipfrac": metrics["actor/pg_clipfrac"], "skipped": metrics["actor/skipped"],
        "router_moved": moved, "overridden_slots": float(out.record.overridden_slots.sum()), "repeat": repeat,
    }


def valid_tokens(batch) -> torch.Tensor:
    ends = batch["prompt_lengths"] + batch["response_mask"].sum(1).long()
    return torch.arange(batch["input_ids"].shape[1]) < ends[:, None]


@pytest.fixture(scope="module")
def reference_tables(checkpoints):
    """A's routing by transformers, and B's log-probs forced to it (the R2 reference)."""
    ckpt_a, ckpt_b = checkpoints
    batch = make_batch()
    _, routing_a = reference(ckpt_a, batch["input_ids"])
    forced = response_window(forced_log_probs(ckpt_b, batch["input_ids"], routing_a), batch)
    return batch, routing_a, forced


def run_replay(tmp_path, checkpoints, batch, world, kwargs, source, forced, name):
    prefix = str(tmp_path / name)
    results = run_ranks(_replay, world, tmp_path, *checkpoints, kwargs, batch, source, forced, prefix)
    return results, prefix


def slices(prefix: str, world: int) -> dict:
    """Every rank's HF-named weight slices after the step, keyed by name and slice."""
    return {(n, str(r), str(c)): t for rank in range(world)
            for n, r, c, t in torch.load(f"{prefix}_rank{rank}.pt", weights_only=False)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.numerics
def test_r2_replays_the_recorded_routing(name, checkpoints, reference_tables, tmp_path):
    batch, routing_a, forced = reference_tables
    world, kwargs = LAYOUTS[name]
    results, _ = run_replay(tmp_path, checkpoints, batch, world, kwargs, None, forced, name)
    r = results[0]
    valid = valid_tokens(batch)
    captured, native_b = torch.tensor(r["captured"]), torch.tensor(r["native_b"])
    # capture: every valid token in every layer, equal to transformers' top-k of model A
    assert (captured[valid] >= 0).all() and torch.equal(captured[valid], routing_a[valid])
    # unchanged weights, other micro-batches: the drift metric is exactly 0
    assert r["repeat"]["repeat/slot_frac"] == 0.0 and r["repeat"]["repeat/token_any_frac"] == 0.0
    assert r["repeat"]["repeat/tokens"] == valid.sum()
    # B routes differently on its own ...
    flips = int(changed_slots(captured[valid].long(), native_b[valid].long()).sum())
    assert flips > 0.05 * valid.sum() * captured.shape[-1], flips
    assert r["native_vs_forced"] > 1e-2
    # ... and replaying A's routing gives exactly transformers' B forced to it: forward-only ...
    assert r["replay_vs_forced"] < r["tolerance"], r
    # ... and in the training forward: ratio 1, nothing clipped, while the router moved natively
    assert r["skipped"] == 0 and abs(r["ppo_kl"]) < r["tolerance"] and r["pg_clipfrac"] == 0, r
    assert r["overridden_slots"] > 0
    # the router still learns: its weights change (Adam moves nothing without a gradient)
    assert all(m > 0 for m in r["router_moved"]) and r["router_moved"], r["router_moved"]
    assert all(result["replay_vs_forced"] < result["tolerance"] for result in results)


@pytest.mark.slow
def test_r2_with_full_recompute_replays_in_the_recompute(checkpoints, reference_tables, tmp_path):
    """The recomputed forward in the backward pass replays the same experts: the update equals the
    update without recompute (it would differ if the recompute routed natively)."""
    batch, _, forced = reference_tables
    world, kwargs = LAYOUTS["tp2_ep2"]
    plain, plain_prefix = run_replay(tmp_path, checkpoints, batch, world, kwargs, None, forced, "plain")
    again, again_prefix = run_replay(tmp_path, checkpoints, batch, world, {**kwargs, **RECOMPUTE}, None, forced, "recompute")
    r = again[0]
    assert r["replay_vs_forced"] < r["tolerance"] and abs(r["ppo_kl"]) < r["tolerance"] and r["pg_clipfrac"] == 0, r
    a, b = slices(plain_prefix, world), slices(again_prefix, world)
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-6, worst


@pytest.mark.slow
def test_r3_replays_the_rollout_engines_routing(checkpoints, tmp_path):
    """The CPU engine (model A) reports its routing while generating; put into the batch's layout
    and replayed by model B, it gives transformers' B forced to the engine's routing."""
    from recipe.rollout.base import SamplingParams
    from recipe.rollout.hf_engine import HFEngine
    from recipe.driver.routing import rollout_routing

    ckpt_a, ckpt_b = checkpoints
    engine = HFEngine(ckpt_a, load_from_checkpoint=True, return_routed_experts=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (ROWS,), generator=g)]
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=WIDTH, seed=5))
    batch = engine_batch(prompts, out.token_ids, WIDTH)
    batch["advantages"] = torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH).clone()
    ids, length = batch["input_ids"], batch["input_ids"].shape[1]
    engine_table = rollout_routing(out.routed_experts, length)
    # the engine's routing is transformers' own routing of A (its last token never went through the model)
    _, routing_a = reference(ckpt_a, ids)
    reported = engine_table >= 0
    assert torch.equal(engine_table[reported], routing_a[reported])
    forced = response_window(forced_log_probs(ckpt_b, ids, engine_table), batch)
    results, _ = run_replay(tmp_path, checkpoints, batch, *LAYOUTS["ep2"], engine_table, forced, "r3")
    r = results[0]
    assert r["native_vs_forced"] > 1e-2
    assert r["replay_vs_forced"] < r["tolerance"] and abs(r["ppo_kl"]) < r["tolerance"] and r["pg_clipfrac"] == 0, r


def test_hf_recorder_reads_transformers_top_k(checkpoints):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints[0], dtype=torch.float32).eval()
    recorder = HFRoutingRecorder(model)
    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    table = recorder.take()
    for layer, logits in enumerate(out.router_logits):
        assert torch.equal(table[:, layer], logits.topk(2, dim=-1).indices.sort(-1).values.to(table.dtype))
    with pytest.raises(RuntimeError, match="call the model first"):
        recorder.take()
    json.dumps(table.tolist())


def test_the_routers_choices_are_read_without_a_host_read():
    """The tap reads each token's k experts with a stable sort, not ``nonzero`` (which waits for
    the device in every layer): the same ids, ascending; a token routed to other than k experts is
    counted, and the pass ends with that error."""
    from megatron_bridge.moe.routing import sorted_topk, topk_miscounted
    from tests.test_host_syncs import OpNames, routing_map

    for tokens, experts, topk in ((37, 8, 2), (64, 128, 8), (5, 4, 1), (0, 4, 2)):
        routed = routing_map(tokens, experts, topk, seed=tokens, uneven=False)
        with OpNames() as ops:
            ids, miscounted = sorted_topk(routed, topk), topk_miscounted(routed, topk)
        assert "nonzero" not in ops.names and "_local_scalar_dense" not in ops.names
        assert torch.equal(ids, routed.nonzero()[:, 1].view(-1, topk)) and int(miscounted) == 0
    uneven = routing_map(50, 16, 4, seed=1, uneven=True)
    assert int(topk_miscounted(uneven, 4)) == int((uneven.sum(1) != 4).sum()) > 0


@pytest.mark.parametrize("case, message", [
    ("twice", "layer 3: a token lists an expert id twice"),
    ("outside", "layer 3: a token lists an expert id twice or one outside"),
    ("mixed", "layer 3: a token mixes expert ids and -1"),
])
def test_replayed_experts_are_checked_for_every_layer_at_once(case, message):
    """k distinct ids in range, or all -1; the error names the layer (all layers in one read)."""
    from megatron_bridge.moe.routing import _check_targets

    targets = torch.tensor([[[0, 1], [2, 3]], [[-1, -1], [1, 0]], [[3, 2], [-1, -1]]])  # [tokens, layers, k]
    _check_targets(targets, 4, [0, 3])  # valid: nothing raised
    bad = targets.clone()
    bad[1, 1] = {"twice": torch.tensor([2, 2]), "outside": torch.tensor([1, 4]), "mixed": torch.tensor([1, -1])}[case]
    with pytest.raises(ValueError, match=message):
        _check_targets(bad, 4, [0, 3])
