"""Routing tables (layout-independent routing) and the ``moe/`` metrics built from them, against
hand-computed values."""

import pytest
import torch

from megatron_bridge.moe.table import (
    NONE,
    RoutingRecord,
    changed_slots,
    empty_routing,
    expert_counts,
    merge_records,
    routing_change,
)
from megatron_bridge.runtime.batch import token_mask
from recipe.driver.routing import replay_source, rollout_routing, routing_metrics


def table(rows):
    return torch.tensor(rows, dtype=torch.int16)


def test_changed_slots_ignores_the_order_of_the_k_experts():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 5], [1, 0], [7, 6]])
    assert changed_slots(a, b).tolist() == [0, 1, 2, 0]


def test_routing_change_by_hand():
    # 1 row, 3 positions, 2 layers, k = 2; position 2 is padding (not valid)
    old = table([[[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[4, 5], [6, 7]]]])
    new = table([[[[0, 1], [2, 4]], [[0, 2], [1, 3]], [[0, 1], [0, 1]]]])
    valid = torch.tensor([[True, True, False]])
    out = routing_change(old, new, valid, "d")
    # layer 0: no slot changed over 2 tokens x 2 slots; layer 1: 1 slot of 4 (position 0: 3 -> 4)
    assert out["d/slot_frac/layer_0"] == 0.0 and out["d/slot_frac/layer_1"] == 0.25
    assert out["d/slot_frac"] == 0.125  # 1 of 8 slots
    assert out["d/token_any_frac"] == 0.5  # position 0 changed in some layer, position 1 in none
    assert out["d/tokens"] == 2.0
    # the same routing: exactly zero everywhere
    same = routing_change(old, old.clone(), valid, "d")
    assert same["d/slot_frac"] == 0.0 and same["d/token_any_frac"] == 0.0
    assert all(v == 0.0 for k, v in same.items() if "slot_frac" in k)


def test_routing_change_skips_tokens_without_a_record():
    old = table([[[[0, 1]], [[2, 3]]]])
    new = table([[[[0, 1]], [[NONE, NONE]]]])
    out = routing_change(old, new, torch.ones(1, 2, dtype=torch.bool), "d")
    assert out["d/tokens"] == 1.0 and out["d/slot_frac"] == 0.0
    assert routing_change(old, empty_routing(1, 2, 1, 2), torch.ones(1, 2, dtype=torch.bool), "d") == {}
    with pytest.raises(ValueError, match="expected two routings"):
        routing_change(old, new[:, :1], torch.ones(1, 2, dtype=torch.bool), "d")


def test_expert_counts_by_hand():
    routing = table([[[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[4, 5], [6, 7]]]])
    valid = torch.tensor([[True, True, False]])
    counts = expert_counts(routing, valid, num_experts=8)
    assert counts.tolist() == [[2, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 2, 0, 0, 0, 0]]


def _record(layers, routing, tokens, overridden=0.0):
    n = len(layers)
    return RoutingRecord(layers=layers, routing=routing, tokens=torch.full((n,), float(tokens)),
                         overridden_slots=torch.full((n,), float(overridden)), entropy=torch.ones(n),
                         topk_mass=torch.full((n,), 0.5))


def test_merge_records_puts_stages_slices_and_replicas_together():
    """Two pipeline stages (layers 0 / 1) of one DP replica, each with two sequence-parallel
    halves; a second replica's rows; a TP replica (no SP) with identical values, not counted."""
    full = torch.arange(2 * 4 * 2 * 2).view(2, 4, 2, 2).to(torch.int16)  # rows 0-1, 4 positions, 2 layers, k 2

    def piece(rows, layer, positions):
        out = empty_routing(len(rows), 4, 1, 2)
        out[:, positions] = full[rows][:, positions][:, :, layer : layer + 1]
        return out

    first, second = torch.tensor([0]), torch.tensor([1])
    records = [
        _record([0], piece(first, 0, slice(0, 2)), 2), _record([0], piece(first, 0, slice(2, 4)), 2),
        _record([1], piece(first, 1, slice(0, 2)), 2), _record([1], piece(first, 1, slice(2, 4)), 2),
        _record([0, 1], full[second], 4), _record([0, 1], full[second], 4, overridden=99),
    ]
    merged = merge_records(records, [first] * 4 + [second] * 2, [True] * 5 + [False], width=4, layers=2, topk=2)
    assert torch.equal(merged.routing, full)
    assert merged.tokens.tolist() == [8.0, 8.0] and merged.overridden_slots.tolist() == [0.0, 0.0]
    assert merged.nbytes == full.numel() * 2


def test_rollout_routing_is_put_in_the_batch_layout():
    experts = [torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.int16), torch.tensor([[[4, 5]]], dtype=torch.int16)]
    out = rollout_routing(experts, width=3)
    assert out.tolist() == [[[[0, 1]], [[2, 3]], [[-1, -1]]], [[[4, 5]], [[-1, -1]], [[-1, -1]]]]
    assert rollout_routing(None, 3) is None


def test_r3_replays_the_rollout_where_it_reported_and_the_old_pass_elsewhere():
    rollout = table([[[[0, 1]], [[NONE, NONE]]]])
    old = table([[[[2, 3]], [[4, 5]]]])
    assert replay_source(rollout, old).tolist() == [[[[0, 1]], [[4, 5]]]]


def test_token_mask_covers_prompt_and_response():
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "prompt_lengths": torch.tensor([2, 3]),
             "response_mask": torch.tensor([[1.0, 1, 0], [1, 0, 0]])}
    assert token_mask(batch).tolist() == [[True] * 4 + [False] * 2, [True] * 4 + [False] * 2]


def test_routing_metrics_by_hand():
    old_routing = table([[[[0, 1]], [[2, 3]]]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    old = merge_records([_record([0], old_routing, 2)], [torch.tensor([0])], [True], 2, 1, 2)
    rollout = table([[[[0, 1]], [[NONE, NONE]]]])
    drift = (torch.tensor([0]), table([[[[0, 2]], [[2, 3]]]]))
    update = merge_records([_record([0], None, 4, overridden=2)], [torch.tensor([0])], [True], 2, 1, 2)
    m = routing_metrics(old, valid, 4, rollout, drift, update)
    assert m["moe/rollout_routing_mismatch/slot_frac"] == 0.0 and m["moe/rollout_routing_mismatch/tokens"] == 1.0
    assert m["moe/routing_drift/slot_frac"] == 0.25 and m["moe/routing_drift/token_any_frac"] == 0.5
    assert m["moe/replay_override/slot_frac"] == 2 / (4 * 2)
    assert m["moe/router_entropy/mean"] == 0.5 and m["moe/router_topk_mass/mean"] == 0.25
    assert m["moe/load_imbalance_max"] == 1.0  # experts 0, 1, 2, 3 once each
    assert m["moe/routing_bytes"] == old_routing.numel() * 2 + rollout.numel() * 2
    without = routing_metrics(old, valid, 4, None, None, None)
    assert not any(k.startswith(("moe/routing_drift", "moe/rollout_routing", "moe/replay")) for k in without)
