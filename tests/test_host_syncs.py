"""Where the actor makes the host wait for the device. On the CPU nothing waits, but the
operations that would are visible: a value read back (``_local_scalar_dense``: ``.item()``,
``float()``, ``bool()``) and a result whose size depends on the data (``nonzero``,
``masked_select``, indexing by a boolean mask). The MoE token permutation
(``megatron_compat._cover_unfused_permute``) gives megatron-core 0.12.1's order without
``masked_select``: the same tokens, probabilities and order, forward and backward; no layer of
the model reads anything back, so a deeper model waits no more often than a shallow one (the
alltoall dispatcher's one copy of its counts to the host per layer is a copy, invisible on the
CPU); and nothing inside the passes over the micro-batches reads anything back, the routing tap's
capture and replay included. ``gpu``-marked: the same under torch's sync debug mode."""

from __future__ import annotations

import traceback
from collections import Counter
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_bridge.runtime import megatron_compat
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks

# operations whose output size or value the host must read from the device before it can go on
DATA_DEPENDENT = {"masked_select", "nonzero", "_local_scalar_dense", "unique", "_unique2"}
# ... and these where an index is a boolean mask (``x[mask]``: the nonzero runs inside them)
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _masked_indexing(name: str, args) -> bool:
    indices = args[1] if name in INDEXING and len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@pytest.fixture(scope="module")
def permutes():
    """megatron's permute and the one its token dispatchers call once the platform is set up."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    megatron_compat.install("cuda" if torch.cuda.is_available() else "cpu")  # as the platform's activation does

    assert token_dispatcher.permute is not moe_utils.permute, "the cover is not installed"
    return moe_utils.permute, token_dispatcher.permute


class OpNames(TorchDispatchMode):
    """The names of the aten operations run inside it; ``waits``: each data-dependent one by the
    line outside torch that asked for it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.waits: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names.add(name)
        if _masked_indexing(name, args):
            name = f"{name} by a mask"
        if name in DATA_DEPENDENT or name.endswith(" by a mask"):
            frame = [f for f in traceback.extract_stack()[:-1]
                     if not any(part in f.filename for part in ("/torch/", "cpu_adaptor", "test_host_syncs"))][-1]
            self.waits[f"{name} at {frame.filename.split('site-packages/')[-1]}:{frame.lineno}"] += 1
        return func(*args, **(kwargs or {}))


def routing_map(tokens: int, experts: int, topk: int, seed: int, uneven: bool) -> torch.Tensor:
    """Each token's top-k experts of random scores; ``uneven``: some tokens routed to none and some
    to one more (as the allgather dispatcher's map of the local experts, or a capacity-cut map)."""
    g = torch.Generator().manual_seed(seed)
    top = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    routed = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    if uneven:
        routed[::3] = False
        routed[1::4, 0] = True
    return routed


MAPS = {  # name: tokens, experts, top-k, uneven
    "dropless": (37, 8, 2, False),
    "many_experts": (64, 128, 8, False),
    "uneven": (50, 16, 4, True),
    "one_expert_each": (9, 4, 1, True),
    "no_tokens": (0, 4, 2, False),
}


@pytest.mark.parametrize("count_on_host", [int, torch.tensor], ids=["int", "host_tensor"])
@pytest.mark.parametrize("case", list(MAPS))
def test_the_same_tokens_probabilities_and_order_forward_and_backward(permutes, case, count_on_host):
    megatrons, covered = permutes
    tokens, experts, topk, uneven = MAPS[case]
    routed = routing_map(tokens, experts, topk, seed=len(case), uneven=uneven)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, 12, generator=g)
    probs = torch.rand(tokens, experts, generator=g)
    results = []
    for permute, count in ((megatrons, int(routed.sum())), (covered, count_on_host(int(routed.sum())))):
        x, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        out, out_probs, order = permute(x, routed, probs=p, num_out_tokens=count)
        # a loss that weighs each routed copy by its probability and position: both gradients non-trivial
        weights = torch.arange(1, out.shape[0] + 1, dtype=out.dtype)
        ((out.sum(1) * out_probs + out_probs) * weights).sum().backward()
        results.append((out, out_probs, order, x.grad, p.grad))
    for name, want, got in zip(("tokens", "probs", "order", "d hidden", "d probs"), *results):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert results[0][2].numel() == int(routed.sum())


def test_no_operation_waits_on_the_routing_maps_contents(permutes):
    megatrons, covered = permutes
    routed = routing_map(*MAPS["dropless"][:3], seed=0, uneven=False)
    hidden, probs = torch.randn(routed.shape[0], 12), torch.rand(routed.shape, requires_grad=True)
    count = int(routed.sum())  # the dispatcher's, known on the host before
    ran = {}
    for name, permute in (("megatron", megatrons), ("covered", covered)):
        with OpNames() as ops:
            out, out_probs, _ = permute(hidden, routed, probs=probs, num_out_tokens=count)
            (out.sum(1) * out_probs).sum().backward()
        ran[name] = ops.names & DATA_DEPENDENT
    assert ran == {"megatron": {"masked_select"}, "covered": set()}


def test_a_count_the_host_does_not_hold_takes_megatrons_path():
    assert megatron_compat._host_count(12) == 12
    assert megatron_compat._host_count(torch.tensor(12)) == 12
    assert megatron_compat._host_count(torch.tensor(12, device="meta")) is None  # as one on a GPU
    assert megatron_compat._host_count(None) is None


@pytest.mark.gpu
def test_the_permutation_does_not_synchronise_on_a_gpu(permutes):
    """On CUDA torch counts every wait of the host for the device; the covered permutation and its
    backward make none (megatron's makes two)."""
    megatrons, covered = permutes
    routed = routing_map(4096, 128, 8, seed=0, uneven=False).cuda()
    hidden = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(4096, 128, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, out_probs, _ = covered(hidden, routed, probs=probs, num_out_tokens=4096 * 8)
        (out.float().sum(1) * out_probs).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = megatrons(hidden.detach(), routed, probs=probs.detach(), num_out_tokens=4096 * 8)
    assert torch.equal(out, want[0]) and torch.equal(out_probs.detach(), want[1])


def _step_runs(checkpoint: str, platform_name: str, options, pack: bool, micro_batch_size: int = 4) -> dict:
    """A tiny actor's train step and log-prob pass on one batch of 8 rows in micro-batches of
    ``micro_batch_size``, after a step that warms it up; "actor" and "batch": the actor and the batch."""
    from loss.megatron_hook import log_prob_func, policy_loss_func
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from tests.test_actor_update import LOSSES, make_batch

    initialize_parallel(TrainParallel())
    actor = MegatronActor(load_model_spec(checkpoint), TrainParallel(), options, OptimConfig(lr=1e-3), platform_name,
                          pack=pack)
    actor.load_hf(checkpoint)
    batch = make_batch(checkpoint)
    train = partial(actor.train_step, batch, micro_batch_size, partial(policy_loss_func, LOSSES["gspo"]))
    train()
    return {"train": train, "log_prob": partial(actor.forward_only, batch, micro_batch_size,
                                                partial(log_prob_func, 1.0, False)), "actor": actor, "batch": batch}


def _by_depth(tmp_path, fn, *args, platform_name: str = "cpu") -> list:
    """fn(rank, world_size, checkpoint, *args) on one rank for the tiny model with 2 and with 6 layers."""
    out = []
    for layers in (2, 6):
        (tmp_path / str(layers)).mkdir()
        checkpoint = save_tiny_checkpoint(tmp_path / f"hf{layers}", seed=1, num_hidden_layers=layers)
        out += run_ranks(fn, 1, tmp_path / str(layers), checkpoint, *args, platform_name=platform_name)
    return out


def _step_waits(rank, world_size, checkpoint, pack):
    """The data-dependent operations of the step and the pass on the CPU, with the alltoall
    dispatcher (the one an accelerator runs), packed or padded: in all, and those inside the passes
    over the micro-batches once they are cut and shipped (what runs on the device)."""
    from megatron_bridge.runtime.model import BuildOptions

    runs = _step_runs(checkpoint, "cpu", BuildOptions(params_dtype=torch.float32, dispatcher="alltoall"), pack)
    passes = _count_passes(runs["actor"])
    out = {}
    for name in ("train", "log_prob"):
        passes.waits.clear()
        with OpNames() as ops:
            runs[name]()
        out[name] = dict(ops.waits)
        out[f"{name} passes"] = dict(passes.waits)
    return out


def _count_passes(actor) -> OpNames:
    """Counts, from now on, what the actor's passes over cut micro-batches run (``actor._run``)."""
    passes = OpNames()
    run_passes = actor._run

    def counted(*args, **kwargs):
        with passes:
            return run_passes(*args, **kwargs)

    actor._run = counted
    return passes


def _tap_waits(rank, world_size, checkpoint):
    """With the routing tap on the actor: the data-dependent operations inside the passes of a
    log-prob pass that captures the routing and of a train step that replays it (R2), packed."""
    from loss.megatron_hook import log_prob_func, policy_loss_func
    from megatron_bridge.moe.routing import RoutingTap
    from megatron_bridge.runtime.batch import ROUTED_EXPERTS
    from megatron_bridge.runtime.model import BuildOptions
    from tests.test_actor_update import LOSSES

    runs = _step_runs(checkpoint, "cpu", BuildOptions(params_dtype=torch.float32, dispatcher="alltoall"), True)
    actor, batch = runs["actor"], runs["batch"]
    tap = RoutingTap(actor.chunks, actor.spec.moe_topk, sequence_parallel=False)
    actor.forward_context = tap.micro_batch
    rows, width = batch["input_ids"].shape
    passes = _count_passes(actor)
    with tap.recording(rows, width, capture=True, replay=False, training=False) as captured:
        actor.forward_only(batch, 4, partial(log_prob_func, 1.0, False))
    out = {"capture": dict(passes.waits)}
    passes.waits.clear()
    with tap.recording(rows, width, capture=False, replay=True, training=True) as replayed:
        actor.train_step({**batch, ROUTED_EXPERTS: captured.record.routing}, 4, partial(policy_loss_func, LOSSES["gspo"]))
    out["replay"] = dict(passes.waits)
    out["overridden"] = int(replayed.record.overridden_slots.sum())  # its own routing replayed: nothing changes
    return out


@pytest.mark.slow
def test_the_routing_tap_reads_nothing_in_a_layer(tmp_path):
    """Capturing and replaying (R2) with 2 and 6 layers: no data-dependent operation inside the
    passes at all (before, about seven per layer and micro-batch: ``nonzero`` for the experts, the
    valid tokens picked by a mask, the replayed experts checked per layer)."""
    waits = _by_depth(tmp_path, _tap_waits)
    assert waits[0] == waits[1] == {"capture": {}, "replay": {}, "overridden": 0}, waits


@pytest.mark.slow
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_a_deeper_model_waits_no_more_often(tmp_path, pack):
    """Two and six layers, the same batch in two micro-batches: the same read-backs, none of them in
    a layer (before, each MoE layer's permutation ran masked_select and each packed attention read
    its longest sequence back), and none at all while the micro-batches run: what the loss reads
    (its response tokens, their checks) and the packed sequence's longest part are computed while
    the actor cuts the micro-batches on the host (before, 3-6 reads per micro-batch)."""
    waits = _by_depth(tmp_path, _step_waits, pack)
    assert waits[0] == waits[1]
    for name in ("train", "log_prob"):
        assert waits[0][f"{name} passes"] == {}, waits
        assert not any("masked_select" in site or "/moe/" in site or "attention" in site for site in waits[0][name]), waits
    # what is left is the cutting on the host (the loss's tokens) and per step (the gradient norm),
    # and the census sees it
    assert any("megatron_hook" in site for site in waits[0]["log_prob"]), waits
    assert any("clip_grads" in site for site in waits[0]["train"]), waits


def _gpu_step_syncs(rank, world_size, checkpoint, micro_batch_sizes=(4,)):
    """On CUDA (bf16, packed, the alltoall dispatcher): how often the step and the pass made the host
    wait, by torch's sync debug mode (``bench.actor_throughput.host_syncs``: waits, the lines), for
    each micro-batch size (the batch: 8 rows)."""
    from bench.actor_throughput import host_syncs
    from megatron_bridge.runtime.model import BuildOptions

    out = []
    for size in micro_batch_sizes:
        runs = _step_runs(checkpoint, "cuda", BuildOptions(), True, size)
        out.append({name: host_syncs(runs[name]) for name in ("train", "log_prob")})
    return out


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_a_layer_waits_once_a_pass(tmp_path):
    """What is left per layer on a GPU is the alltoall dispatcher's read-back of its counts
    (megatron's), once per MoE layer and forward pass: with 4 layers more and two micro-batches, 8
    waits more in the train step (backward runs no dispatcher) and 8 in the log-prob pass."""
    syncs = _by_depth(tmp_path, _gpu_step_syncs, platform_name="cuda")
    for name in ("train", "log_prob"):
        (shallow, _), (deep, _) = syncs[0][0][name], syncs[1][0][name]
        assert deep - shallow == 4 * 2, (name, syncs)


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_a_micro_batch_waits_once_a_layer(tmp_path):
    """Cut on the host and shipped from pinned memory, a micro-batch costs no wait of its own: 8
    micro-batches against 2 add the dispatcher's one wait per layer (2) and micro-batch (6 more), 12,
    in the train step and in the log-prob pass (before, each micro-batch also waited for its copy,
    its sizes and the loss's token positions)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "hf", seed=1, num_hidden_layers=2)
    two, eight = run_ranks(_gpu_step_syncs, 1, tmp_path, checkpoint, (4, 1), platform_name="cuda")[0]
    for name in ("train", "log_prob"):
        assert eight[name][0] - two[name][0] == 2 * 6, (name, two[name], eight[name])
