"""The MoE token permutation without host synchronisation (``megatron_compat._cover_unfused_permute``):
megatron-core 0.12.1's unfused ``permute`` finds each expert's tokens with ``masked_select``, which
makes the host wait for the device; the cover sorts the routing map instead. The same tokens,
probabilities and order, forward and backward, and no operation whose output size depends on the
data."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_bridge.runtime import megatron_compat

# operations whose output size or value the host must read from the device before it can go on
DATA_DEPENDENT = {"masked_select", "nonzero", "_local_scalar_dense", "unique", "_unique2"}


@pytest.fixture(scope="module")
def permutes():
    """megatron's permute and the one its token dispatchers call once the platform is set up."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    megatron_compat.install("cuda" if torch.cuda.is_available() else "cpu")  # as the platform's activation does

    assert token_dispatcher.permute is not moe_utils.permute, "the cover is not installed"
    return moe_utils.permute, token_dispatcher.permute


class OpNames(TorchDispatchMode):
    """The names of the aten operations run inside it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
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
