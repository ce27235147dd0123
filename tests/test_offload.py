"""Offload of the actor's training state (``megatron_bridge.runtime.offload``) on megatron-core:
for every combination of param/grad/optimizer offload, after a real optimizer step, the bytes
freed equal the planner's exact figures, the storages are really freed, everything comes back bit
for bit (grads zeroed) and the next step equals the step without offload. On an accelerator the
device memory is measured."""

import itertools
from dataclasses import replace

import pytest
import torch

from megatron_bridge.plan import memory
from megatron_bridge.plan.layout import Cluster, Layout, TrainParallel
from megatron_bridge.runtime.offload import KINDS
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks
from tests.test_actor_update import LOSSES, make_batch
from tests.recipe_runs import stable, start_trainer

FLAGS = list(itertools.product((False, True), repeat=3))  # (params, grads, optimizer)
LAYOUTS = {
    "ep2": dict(ep=2, etp=1),  # dense buffers over DP2, experts in their own buffer
    "dp2_plain_optimizer": dict(use_distributed_optimizer=False),  # every parameter its own storage
}
MICRO = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=1)
    return checkpoint, [make_batch(checkpoint, seed) for seed in (0, 1)]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8).clone()


def _snapshot(actor) -> dict[str, torch.Tensor]:
    """Every parameter, main gradient, fp32 main parameter and optimizer state, as bytes."""
    from megatron_bridge.runtime.actor import _optimizers

    out = {f"model.{k}": _bits(p) for k, p in _params(actor)}
    for i, opt in enumerate(_optimizers(actor.optimizer)):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                out[f"optimizer.{i}.{g}.{j}.param"] = _bits(param)
                out.update({f"optimizer.{i}.{g}.{j}.{k}": _bits(v) for k, v in inner.state.get(param, {}).items()
                            if torch.is_tensor(v)})
    return {**out, **{f"grad.{k}": _bits(p.main_grad) for k, p in _params(actor)}}


def _params(actor):
    return [(f"{i}.{n}", p) for i, c in enumerate(actor.chunks) for n, p in c.module.named_parameters()]


def _differs(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def _name(flags: tuple[bool, bool, bool]) -> str:
    return "".join("pgo"[i] if on else "-" for i, on in enumerate(flags))


def _freed(actor) -> dict[str, bool]:
    """Per kind: are its storages freed on the device?"""
    from megatron_bridge.runtime.actor import _optimizers

    inner = [o.optimizer for o in _optimizers(actor.optimizer)]
    optimizer = [t for o in inner for g in o.param_groups for t in g["params"]]
    optimizer += [v for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = {"params": [p for _, p in _params(actor)], "grads": [p.main_grad for _, p in _params(actor)],
               "optimizer": optimizer}
    return {kind: all(t.untyped_storage().nbytes() == 0 for t in ts) for kind, ts in tensors.items()}


def _offload_round_trips(rank, world_size, checkpoint, batches, train_kwargs):
    from functools import partial

    from megatron.core import parallel_state as ps

    from loss.megatron_hook import log_prob_func, policy_loss_func
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    spec = load_model_spec(checkpoint)
    rows = len(batches[0]["input_ids"]) // ps.get_data_parallel_world_size()
    lo = ps.get_data_parallel_rank() * rows
    mine = [{k: v[lo:lo + rows] for k, v in b.items()} for b in batches]
    loss = partial(policy_loss_func, LOSSES["grpo"])
    options = BuildOptions(params_dtype=torch.bfloat16)  # fp32 main params of their own, as on accelerators

    def trained_actor():
        actor = MegatronActor(spec, train, options, OptimConfig(lr=1e-3, adam_eps=1e-4), "cpu")
        actor.load_hf(checkpoint)
        actor.train_step(mine[0], MICRO, loss)
        return actor

    reference = trained_actor()
    reference.train_step(mine[1], MICRO, loss)
    expected = _snapshot(reference)
    layout = Layout("measured", train=train, cluster=Cluster(nnodes=1, devices_per_node=world_size))
    static = memory.static_memory(spec, layout, ps.get_pipeline_model_parallel_rank(),
                                  ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank())
    results = {"planner": {"params": static.weights, "grads": static.grads, "optimizer": static.optimizer}}
    for flags in FLAGS:
        actor = trained_actor()
        before = _snapshot(actor)
        off = actor.offload(*flags)
        host = sum(a.host.numel() for away in actor.host_copy.away.values() for a in away if a.host is not None)
        planned = replace(train, **{f"{kind}_offload": on for kind, on in zip(("param", "grad", "optimizer"), flags)})
        case = {"offload": off, "freed": _freed(actor), "again": actor.offload(*flags), "host": host,
                "planned_kept": memory.kept_during_rollout(static, planned),
                "planned_host": memory.offload_host_bytes(static, planned)}
        try:
            actor.forward_only(mine[0], MICRO, partial(log_prob_func, 1.0, False))
            case["pass_refused"] = False
        except RuntimeError as e:
            case["pass_refused"] = "onload()" in str(e)
        case["onload"] = actor.onload()
        case["changed"] = _differs(before, _snapshot(actor))
        case["grads_zero"] = all(not p.main_grad.any() for _, p in _params(actor))
        actor.train_step(mine[1], MICRO, loss)
        case["next_step_differs"] = _differs(expected, _snapshot(actor))
        results[_name(flags)] = case
    ref = MegatronActor(spec, train, options, None, "cpu")  # the reference model: no optimizer
    ref.load_hf(checkpoint)
    log_probs = ref.forward_only(mine[0], MICRO, partial(log_prob_func, 1.0, False))["log_probs"]
    results["ref_offload"] = ref.offload(True, True, True)
    ref.onload()
    again = ref.forward_only(mine[0], MICRO, partial(log_prob_func, 1.0, False))["log_probs"]
    results["ref_same_log_probs"] = torch.equal(log_probs, again)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_frees_the_planned_bytes_and_restores_bit_for_bit(setup, layout, tmp_path):
    checkpoint, batches = setup
    for rank, r in enumerate(run_ranks(_offload_round_trips, 2, tmp_path, checkpoint, batches, LAYOUTS[layout])):
        planned = r["planner"]
        for flags in FLAGS:
            case, where = r[_name(flags)], f"rank {rank}, offload {_name(flags)}"
            on = dict(zip(KINDS, flags))
            print(f"{layout} {where}: offload {case['offload']}, onload {case['onload']}")
            assert {k: case["offload"][k] for k in KINDS} == {k: planned[k] if on[k] else 0 for k in KINDS}, where
            assert sum(planned.values()) - sum(case["offload"][k] for k in KINDS) == case["planned_kept"], where
            assert case["host"] == case["planned_host"], where  # grads are not copied
            assert case["freed"] == on, where
            assert {k: case["again"][k] for k in KINDS} == dict.fromkeys(KINDS, 0), where  # already away
            assert case["pass_refused"] == any(flags), where
            assert {k: case["onload"][k] for k in KINDS} == {k: case["offload"][k] for k in KINDS}, where
            grads = [k for k in case["changed"] if k.startswith("grad.")]
            assert case["changed"] == grads, where  # params, main params, optimizer state: bit for bit
            assert case["grads_zero"] if on["grads"] else grads == [], where
            assert case["next_step_differs"] == [], where
        # the reference model: its weights (the planner's reference term), no grad buffer, no optimizer
        assert r["ref_offload"]["params"] == planned["params"]
        assert r["ref_offload"]["grads"] == r["ref_offload"]["optimizer"] == 0
        assert r["ref_same_log_probs"]


def _device_memory(rank, world_size, checkpoint, batch):
    from functools import partial

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.platform import active

    train = TrainParallel()
    initialize_parallel(train)
    spec = load_model_spec(checkpoint)
    actor = MegatronActor(spec, train, BuildOptions(params_dtype=torch.bfloat16), OptimConfig(lr=1e-3), active().name)
    actor.load_hf(checkpoint)
    actor.train_step(batch, MICRO, partial(policy_loss_func, LOSSES["grpo"]))
    before = _snapshot(actor)
    torch.cuda.synchronize()  # the npu through transfer_to_npu
    allocated = [torch.cuda.memory_allocated()]
    off = actor.offload(True, True, True)
    allocated.append(torch.cuda.memory_allocated())
    on = actor.onload()
    allocated.append(torch.cuda.memory_allocated())
    static = memory.static_memory(spec, Layout("one", train=train), 0, 0, 0)
    return {"allocated": allocated, "offload": off, "onload": on, "changed": _differs(before, _snapshot(actor)),
            "planner": [static.weights, static.grads]}


@pytest.mark.parametrize("platform_name", [pytest.param("cuda", marks=pytest.mark.gpu),
                                           pytest.param("npu", marks=pytest.mark.npu)])
def test_offload_frees_device_memory(setup, platform_name, tmp_path):
    checkpoint, batches = setup
    (r,) = run_ranks(_device_memory, 1, tmp_path, checkpoint, batches[0], platform_name=platform_name)
    freed = sum(r["offload"][k] for k in KINDS)
    print(f"{platform_name}: allocated {r['allocated']}, offload {r['offload']}, onload {r['onload']}")
    assert [r["offload"]["params"], r["offload"]["grads"]] == r["planner"]
    # the allocator rounds each block up to 512 bytes (Adam's 4-byte step counters, on the device with
    # the fused kernel, take one each)
    assert freed <= r["allocated"][0] - r["allocated"][1] < freed + 512 * 4096
    assert r["allocated"][2] == r["allocated"][0]
    assert all(k.startswith("grad.") for k in r["changed"])


@pytest.mark.slow
def test_recipe_trains_the_same_with_offload(tmp_path, local_ray):
    """Through the trainer, with the reference model: a step, validation (the state leaves the
    device), a checkpoint (it comes back), another step; the same metrics as without offload."""
    runs = {}
    for name, on in (("kept", "false"), ("offloaded", "true")):
        flags = [f"actor_rollout_ref.actor.megatron.{k}_offload={on}" for k in ("param", "grad", "optimizer")]
        trainer = start_trainer(tmp_path, name, [*flags, "actor_rollout_ref.actor.use_kl_loss=true"])
        try:
            first = trainer.train_step(1)
            trainer.validate()
            trainer.save_checkpoint()
            runs[name] = [first, trainer.train_step(2)]
        finally:
            trainer.close()
    for kept, offloaded in zip(runs["kept"], runs["offloaded"]):
        assert stable(kept) == stable(offloaded)
        assert not any(k.startswith(("timing_s/offload", "timing_s/onload", "perf/offload_bytes")) for k in kept)
        assert offloaded["timing_s/offload"] > 0 and offloaded["timing_s/onload"] > 0
    # step 1 moves the params and grads of actor and reference (equal shards), and no optimizer
    # state: Adam has none before its first step and an fp32 model has no main params of its own.
    # Step 2 counts validation's offload (both models) and its own generation's (the checkpoint
    # brought back only the actor).
    moved = [{kind: run[f"perf/offload_bytes/{kind}"] for kind in KINDS} for run in runs["offloaded"]]
    assert moved[0]["params"] > 0 and moved[0]["grads"] > 0 and moved[0]["optimizer"] == 0, moved
    assert 2 * moved[1]["params"] == 3 * moved[0]["params"] and moved[1]["optimizer"] > 0, moved
