"""The step-time model's terms on hand-computed cases, its hardware sheets, the plan CLI's output
of it, and the ranking it gives Qwen3-30B-A3B on 4 x 8 Atlas 800T A2."""

import json
from dataclasses import replace

import pytest

from megatron_bridge.configs import shipped_paths
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan import flops, memory, step_time
from megatron_bridge.plan.cli import main as plan_main
from megatron_bridge.plan.collectives import AllToAll, Group, Groups, ring_bytes
from megatron_bridge.plan.hardware import (Assumptions, Figure, Hardware, Overheads, Overrides, Rates, hardware_for,
                                           load_hardware)
from megatron_bridge.plan.layout import Cluster, Layout, RolloutParallel, TrainParallel, load_layout
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.plan.step_time import Workload, bubble_fraction

Q30 = load_model_spec("qwen3_30b_a3b")
A2 = Cluster(nnodes=4, devices_per_node=8, device="npu", npu_kind="a2", device_memory_gb=64)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# Round rates, so that seconds are bytes or FLOPs over a power of ten.
RATES = Rates(flops=1e14, hbm=1e12, intra=1e11, inter=1e10, hardware="test")
RECIPE = Workload(seq_len=10240, prompt_len=2048, response_len=8192, global_batch=4096, mini_batch=512)


def layout(tp=1, pp=1, ep=1, etp=1, cp=1, cluster=A2, **train):
    t = TrainParallel(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, sequence_parallel=tp > 1, **RECOMPUTE, **train)
    return Layout("x", train=t, rollout=RolloutParallel(tp=4, ep=cluster.world_size), cluster=cluster)


# ---- where groups sit, and the collectives' bytes ----------------------------------------------


def test_groups_follow_megatrons_rank_order():
    g = Groups.of(layout(tp=4, pp=4, ep=8))  # W=32: DP*CP=2, EDP=1
    assert (g.tp, g.dp, g.ep, g.edp, g.pp) == (Group(4, 1), Group(2, 4), Group(8, 1), Group(1, 8), Group(4, 8))
    assert not g.ep.crosses_nodes(8) and not g.dp.crosses_nodes(8) and g.pp.crosses_nodes(8)
    spread = Groups.of(layout(tp=2, ep=8, etp=2))  # EP members 2 ranks apart: 16 ranks, two nodes
    assert spread.ep.members_per_node(8) == 4 and spread.ep.crosses_nodes(8)


def test_all_to_all_bytes_split_into_the_node_and_across_nodes():
    # TP1 EP32 on 4 x 8: 10240 tokens x top-8 x 2048 hidden x 2 bytes, 1/32 of it stays, 7/32 to the node, 24/32 out
    local = step_time.expert_dispatch_bytes(Q30, layout(ep=32), 10240)
    assert local == 10240 * 8 * 2048 * 2 == 335_544_320
    a2a = AllToAll.of(local, Group(32, 1), 8)
    assert (a2a.intra_bytes, a2a.inter_bytes) == (local * 7 / 32, local * 24 / 32)
    assert a2a.seconds(RATES) == local * 24 / 32 / 1e10  # the slower link sets the time
    # TP4 EP8: each rank dispatches its sequence shard (tokens / TP), all inside the node
    inside = step_time.expert_dispatch_bytes(Q30, layout(tp=4, pp=4, ep=8), 10240)
    assert inside == 10240 / 4 * 8 * 2048 * 2
    assert AllToAll.of(inside, Group(8, 1), 8) == AllToAll(inside * 7 / 8, 0.0)


def test_tensor_and_context_parallel_bytes():
    full = 4096 * 2048 * 2  # one [tokens, hidden] bf16 activation
    # sequence parallel: an all-gather and a reduce-scatter per layer, each 3/4 of the full buffer at TP4
    assert step_time.tp_bytes_per_layer(Q30, layout(tp=4), 4096) == 2 * full * 3 / 4
    no_sp = replace(layout(tp=4), train=replace(layout(tp=4).train, sequence_parallel=False))
    assert step_time.tp_bytes_per_layer(Q30, no_sp, 4096) == 2 * 2 * full * 3 / 4  # two all-reduces
    assert step_time.tp_bytes_per_layer(Q30, layout(), 4096) == 0
    # CP2 TP2: its K and V chunk (2048 tokens, 2 of 4 KV heads x 128) passed once
    assert step_time.cp_bytes_per_layer(Q30, layout(tp=2, cp=2), 4096) == 2048 * 2 * 256 * 2
    assert ring_bytes(100.0, 4) == 75.0


def test_bubble_fraction_1f1b_and_interleaved():
    assert bubble_fraction(1, None, 8) == 0
    assert bubble_fraction(4, None, 8) == pytest.approx(3 / 11)  # (p-1) / (m + p-1)
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)  # (p-1) / (v*m + p-1)


def test_the_predicted_bubble_is_that_fraction_of_the_schedule():
    lay = layout(pp=4, ep=8)
    step = step_time.predict(Q30, lay, RECIPE, RATES, Assumptions())
    train = step_time.micro_batch(Q30, lay, 12, True, RECIPE, RATES, training=True)
    forward = step_time.micro_batch(Q30, lay, 12, True, RECIPE, RATES, training=False)
    per_opt = 512 // 8  # DP 8: 64 micro-batches of one sequence per optimizer step
    assert step.seconds["pipeline_bubble"] == pytest.approx(8 * 3 * train.stage_seconds + 3 * forward.stage_seconds)
    one = 3 * train.stage_seconds
    assert one / (per_opt * train.stage_seconds + one) == pytest.approx(bubble_fraction(4, None, per_opt))


def test_ranks_that_share_the_cores_lose_no_time_in_the_bubble(tmp_path):
    """A sheet whose ranks share the cores (the probe's 4 x 1 on 2 cores) counts no bubble, and only
    the bubble changes: the idle stage's cores run the busy stage."""
    lay = layout(pp=4, ep=8)
    shared = replace(RATES, ranks_share_cores=True)
    own, busy = (step_time.predict(Q30, lay, RECIPE, r, Assumptions()).seconds for r in (RATES, shared))
    assert own["pipeline_bubble"] > 0 and busy["pipeline_bubble"] == 0
    assert {k: v for k, v in busy.items() if k != "pipeline_bubble"} == {k: v for k, v in own.items() if k != "pipeline_bubble"}
    sheet = tmp_path / "cpu.yaml"
    sheet.write_text("device: cpu\n" + "".join(f"{k}: {{value: 1, kind: measured, by: probe, source: a probe}}\n" for k in
                     ("bf16_tflops", "hbm_gb_s", "intra_node_gb_s", "inter_node_gb_s"))
                     + "overheads: {collective_latency_us: 100, ranks_share_cores: true}\n")
    assert Rates.of(load_hardware(str(sheet)), Assumptions()).ranks_share_cores is True


def test_gradient_reduce_scatter_and_parameter_all_gather_bytes():
    # W=16, TP2 PP1 EP8 ETP1: dense over DP*CP = 8, experts over EDP = 2 (the memory test's layout)
    lay = layout(tp=2, ep=8, cluster=Cluster(nnodes=2, devices_per_node=8))
    h, hd = Q30.hidden_size, Q30.head_dim
    dense = Q30.num_layers * ((Q30.attention_params_per_layer - 2 * hd) / 2 + 2 * h + 2 * hd + Q30.num_experts * h) \
        + Q30.embedding_params + h
    experts = Q30.num_layers * Q30.num_experts * Q30.expert_params / 8
    sync = step_time.gradient_sync(Q30, lay, 0, RATES)
    assert sync.reduce_bytes == pytest.approx(4 * dense * 7 / 8 + 4 * experts / 2)  # fp32 gradients
    assert sync.gather_bytes == pytest.approx(2 * dense * 7 / 8 + 2 * experts / 2)  # bf16 parameters
    # both groups span the two nodes (DP 8 ranks 2 apart, EDP 2 ranks 8 apart): the inter-node rate
    assert sync.reduce_seconds == pytest.approx(sync.reduce_bytes / 1e10)
    plain = replace(lay, train=replace(lay.train, use_distributed_optimizer=False))
    all_reduce = step_time.gradient_sync(Q30, plain, 0, RATES)
    assert all_reduce.reduce_bytes == pytest.approx(2 * sync.reduce_bytes) and all_reduce.gather_bytes == 0


def test_overlap_hides_the_gradient_sync_behind_one_micro_batch():
    lay = layout(ep=32)  # EDP 1, dense DP 32 across nodes
    off = step_time.predict(Q30, lay, RECIPE, RATES, Assumptions())
    on = step_time.predict(Q30, lay, RECIPE, RATES, Assumptions(overlap_grad_sync=True))
    sync = step_time.gradient_sync(Q30, lay, 0, RATES)
    train = step_time.micro_batch(Q30, lay, 48, True, RECIPE, RATES, training=True)
    assert off.seconds["gradient_sync"] == pytest.approx(8 * sync.reduce_seconds)
    assert on.seconds["gradient_sync"] == pytest.approx(8 * max(0.0, sync.reduce_seconds - train.compute))


def test_flops_of_a_layer_by_hand():
    h, q, kv, e, i, k = 2048, 4096, 512, 128, 768, 8
    per_token = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * e + 2 * k * 3 * h * i
    assert flops.layer_forward_flops(Q30, 1000) == per_token * 1000 + 2 * q * 1000**2
    assert flops.logits_flops(Q30, 10) == 2 * h * 151936 * 10


def test_training_compute_is_fwd_bwd_and_recompute_over_tp_and_cp():
    lay = layout(tp=2, ep=8)
    mb = step_time.micro_batch(Q30, lay, 48, True, RECIPE, RATES, training=True)
    work = 48 * flops.layer_forward_flops(Q30, 10240) * 4 + flops.logits_flops(Q30, 10240) * 3
    assert mb.compute == pytest.approx(work / 2 / 1e14)


def test_the_local_attention_adds_its_scores_memory_traffic():
    fused = layout(tp=2, ep=8)
    local = replace(fused, train=replace(fused.train, flash_attn=False))
    train_fused = step_time.micro_batch(Q30, fused, 48, True, RECIPE, RATES, training=True)
    train_local = step_time.micro_batch(Q30, local, 48, True, RECIPE, RATES, training=True)
    scores = 48 * 32 / 2 * 10240**2  # layers x heads on this TP rank x s^2
    assert train_local.compute - train_fused.compute == pytest.approx(scores * (6 + 6 + 12) / 1e12)


def test_weight_sync_bytes():
    experts = Q30.num_layers * Q30.num_experts * Q30.expert_params * 2
    dense = Q30.total_params * 2 - experts
    assert step_time.weight_sync_bytes(Q30, layout(ep=8)) == (dense + experts / 32, 1)
    pool = layout(ep=8).with_rollout_pool(2, 8)
    assert step_time.weight_sync_bytes(Q30, pool) == (Q30.total_params * 2, 2)


def test_a_rollout_pool_of_its_own_overlaps_rollout_and_training():
    lay = load_layout("qwen3_30b_a3b_2x8_a2").with_rollout_pool(2, 8)
    step = step_time.predict(Q30, lay, RECIPE, RATES, Assumptions())
    training = sum(v for k, v in step.seconds.items() if k not in ("rollout", "weight_sync"))
    assert step.total == pytest.approx(max(training, step.seconds["rollout"]) + step.seconds["weight_sync"])
    colocated = step_time.predict(Q30, load_layout("qwen3_30b_a3b_2x8_a2"), RECIPE, RATES, Assumptions())
    assert colocated.total == pytest.approx(sum(colocated.seconds.values()))


def test_the_workload_rejects_what_cannot_be():
    with pytest.raises(ConfigError, match="exceed --seq-len"):
        Workload(seq_len=4096, prompt_len=2048, response_len=4096, global_batch=8, mini_batch=4)
    with pytest.raises(ConfigError, match="leaves no room for a response"):
        Workload(seq_len=4096, prompt_len=4096, response_len=0, global_batch=8, mini_batch=4)
    with pytest.raises(ConfigError, match="must divide --global-batch"):
        Workload(seq_len=4096, prompt_len=2048, response_len=2048, global_batch=8, mini_batch=3)


# ---- fixed costs: collective latency and per-layer cost (a probe's sheet) ----------------------------

TINY = load_model_spec("tiny_qwen3_moe")  # 4 layers, hidden 64, vocabulary 512
CPU4 = Cluster(nnodes=1, devices_per_node=4, device="cpu")
# 1 GFLOP/s, 1 ms a collective, a layer's micro-batch 2 ms forward and 3 ms backward beyond its FLOPs
FIXED = replace(RATES, flops=1e9, latency=1e-3, layer_forward=2e-3, layer_backward=3e-3, micro_batch_forward=1e-3,
                micro_batch_backward=4e-3, optimizer_step=6e-3)  # the rest of the model's micro-batch 1 ms forward,
# 4 ms backward; an optimizer step 6 ms beyond its Adam bytes
SHORT = Workload(seq_len=128, prompt_len=32, response_len=96, global_batch=16, mini_batch=16, micro_batch_size=4)


def test_fixed_costs_per_layer_and_per_collective_launch():
    # TP2+SP x EP2 (ETP1) on 4 ranks: per layer and pass 2 TP launches over 2 ranks (one ring step
    # each); the all-to-all dispatcher 2 over the EP group of 2 (NPU), the allgather one on CPU ranks
    # 4 forward and 3 backward over ETP x EP = 2 ranks
    train = TrainParallel(tp=2, ep=2, etp=1, sequence_parallel=True)
    bare_rates = replace(FIXED, latency=0, layer_forward=0, layer_backward=0, micro_batch_forward=0,
                         micro_batch_backward=0)
    for cluster, ep_launches in ((Cluster(devices_per_node=4, device="npu"), (2, 2)), (CPU4, (4, 3))):
        lay = Layout("x", train=train, cluster=cluster)
        for training, passes, overhead in ((True, 2, 2e-3 + 3e-3), (False, 1, 2e-3)):
            bare = step_time.micro_batch(TINY, lay, 4, False, SHORT, bare_rates, training)
            fixed = step_time.micro_batch(TINY, lay, 4, False, SHORT, FIXED, training)
            assert fixed.compute - bare.compute == pytest.approx(4 * overhead)  # every TP rank runs every layer
            bare = step_time.micro_batch(TINY, lay, 4, True, SHORT, bare_rates, training)
            fixed = step_time.micro_batch(TINY, lay, 4, True, SHORT, FIXED, training)
            rest = 1e-3 + 4e-3 if training else 1e-3  # the rest of the model, on the last stage
            assert fixed.compute - bare.compute == pytest.approx(4 * overhead + rest)
            # the last stage adds the output layer's and the log-probs' launches (edge_launches)
            edge = step_time.edge_launches(lay, SHORT, False, True, training)
            assert fixed.tensor_parallel - bare.tensor_parallel == pytest.approx((4 * passes * 2 + edge) * 1e-3)
            launches = sum(ep_launches) if training else ep_launches[0]
            assert fixed.expert_all_to_all - bare.expert_all_to_all == pytest.approx(4 * launches * 1e-3)
    # the allgather dispatcher's bytes: each rank's 512 / TP tokens x 64 x 2 bytes, gathered from the
    # ETP x EP ranks and reduce-scattered back, (n-1)/n of the n ranks' buffer each, per pass: with
    # ETP1 the EP pair; with ETP2 all 4 ranks, whose launches are three ring steps each
    local = 512 / 2 * 64 * 2
    on_cpu = step_time.micro_batch(TINY, Layout("x", train=train, cluster=CPU4), 4, True, SHORT, bare_rates, False)
    assert on_cpu.expert_all_to_all == pytest.approx(4 * 2 * local / 1e11)
    etp2 = Layout("x", train=replace(train, etp=2), cluster=CPU4)
    on_cpu = step_time.micro_batch(TINY, etp2, 4, True, SHORT, bare_rates, False)
    assert on_cpu.expert_all_to_all == pytest.approx(4 * 2 * 3 * local / 1e11)
    fixed = step_time.micro_batch(TINY, etp2, 4, True, SHORT, FIXED, False)
    assert fixed.expert_all_to_all - on_cpu.expert_all_to_all == pytest.approx(4 * 4 * 3 * 1e-3)
    assert step_time.dispatcher(Layout("x", cluster=CPU4)) == "allgather"
    assert step_time.dispatcher(layout()) == "alltoall"
    # 512 tokens a micro-batch, 384 of them response: log-prob chunks of 512 / 16 = 32 rows, 12 of
    # them, two all-reduces each; SP: the output layer's all-gather, in backward its reduce-scatter;
    # the embedding's reduce-scatter, in backward its all-gather
    tp2 = Layout("x", train=train, cluster=CPU4)
    assert step_time.edge_launches(tp2, SHORT, False, True, True) == 1 + 1 + 24
    assert step_time.edge_launches(tp2, SHORT, False, True, False) == 1 + 24
    assert step_time.edge_launches(tp2, SHORT, True, False, True) == 2
    assert step_time.edge_launches(Layout("x", cluster=CPU4), SHORT, True, True, True) == 0  # no TP
    assert step_time.launches_per_layer(layout(tp=2, ep=8, etp=2, cp=2)) == {
        "tensor_parallel": 2, "expert_all_to_all": 2, "expert_tp": 2, "context_parallel": 1}
    # a pipeline send: one launch per send; the gradient sync: one reduce-scatter, one all-gather a group
    pp = Layout("x", train=TrainParallel(pp=2), cluster=Cluster(devices_per_node=2))
    assert step_time.micro_batch(TINY, pp, 2, False, SHORT, FIXED, True).pipeline_p2p == pytest.approx(
        2 * (4 * 128 * 64 * 2 / 1e11 + 1e-3))
    # over n ranks a launch is n - 1 ring steps at the sheet's latency: DP4's reduce-scatter and all-gather 3 each
    for ranks in (2, 4):
        sync = step_time.gradient_sync(TINY, Layout("x", cluster=Cluster(devices_per_node=ranks)), 0, FIXED)
        assert sync.reduce_seconds == pytest.approx(sync.reduce_bytes / 1e11 + (ranks - 1) * 1e-3)
        assert sync.gather_seconds == pytest.approx(sync.gather_bytes / 1e11 + (ranks - 1) * 1e-3)


def test_a_layer_under_tp_and_ep_adds_the_sheets_fixed_costs():
    # the sheet: a layer adds 1 ms forward and 4 ms backward under TP > 1, 0.5 and 2 ms under EP > 1
    extra = replace(FIXED, tp_layer_forward=1e-3, tp_layer_backward=4e-3, ep_layer_forward=0.5e-3,
                    ep_layer_backward=2e-3)
    for train, fwd, bwd in ((TrainParallel(), 0.0, 0.0), (TrainParallel(tp=2, sequence_parallel=True), 1e-3, 4e-3),
                            (TrainParallel(ep=2, etp=1), 0.5e-3, 2e-3),
                            (TrainParallel(tp=2, ep=2, etp=1, sequence_parallel=True), 1.5e-3, 6e-3),
                            (TrainParallel(tp=4, sequence_parallel=True), 1e-3, 4e-3)):  # any TP > 1 alike
        lay = Layout("x", train=train, cluster=CPU4)
        assert step_time.layer_fixed_seconds(lay, extra) == pytest.approx((2e-3 + fwd, 3e-3 + bwd))
        for training, added in ((True, fwd + bwd), (False, fwd)):
            base = step_time.micro_batch(TINY, lay, 4, False, SHORT, FIXED, training)
            more = step_time.micro_batch(TINY, lay, 4, False, SHORT, extra, training)
            assert more.compute - base.compute == pytest.approx(4 * added)  # every layer, every rank
            assert more.tensor_parallel == base.tensor_parallel  # not a collective's
    # with full recompute the forward's runs twice
    lay = Layout("x", train=TrainParallel(tp=2, sequence_parallel=True, recompute_granularity="full"), cluster=CPU4)
    base = step_time.micro_batch(TINY, lay, 4, False, SHORT, FIXED, True)
    assert step_time.micro_batch(TINY, lay, 4, False, SHORT, extra, True).compute - base.compute == pytest.approx(
        4 * (2 * 1e-3 + 4e-3))


def test_one_optimizer_step_by_hand_and_the_rl_step_made_of_them():
    # one rank: 16 sequences of 128 tokens in 4 micro-batches of 4; forward, backward = 3x the FLOPs
    one = Layout("x", cluster=Cluster(device="cpu"))
    work = 4 * 4 * flops.layer_forward_flops(TINY, 128) * 3 + flops.logits_flops(TINY, 512) * 3
    per_mb = work / 1e9 + 4 * 5e-3 + 5e-3  # FLOPs, 4 layers' fixed costs, the rest of the model's
    terms = step_time.optimizer_step(TINY, one, SHORT, FIXED, Assumptions())
    assert terms["compute"] == pytest.approx(4 * per_mb)
    # the update: fp32 Adam reads the parameter, its gradient and both moments and writes three of
    # them, 28 bytes a parameter at the memory rate, and the step's fixed cost
    update = TINY.total_params * 28 / 1e12 + 6e-3
    assert terms["optimizer"] == pytest.approx(update)
    assert sum(terms.values()) == pytest.approx(4 * per_mb + update)  # nothing to send on one rank
    log_probs = step_time.log_prob_pass(TINY, one, SHORT, FIXED)
    per_mb = (4 * 4 * flops.layer_forward_flops(TINY, 128) + flops.logits_flops(TINY, 512)) / 1e9 + 4 * 2e-3 + 1e-3
    assert log_probs["compute"] == pytest.approx(4 * per_mb)
    # the RL step's training terms: its optimizer steps and its log-prob passes
    lay = layout(pp=4, ep=8)
    w = replace(RECIPE, reference=True)
    step = step_time.predict(Q30, lay, w, RATES, Assumptions())
    train = step_time.optimizer_step(Q30, lay, w, RATES, Assumptions())
    forward = step_time.log_prob_pass(Q30, lay, w, RATES)
    for key, seconds in train.items():
        assert step.seconds[key] == pytest.approx(8 * seconds + 2 * forward.get(key, 0.0))


def test_a_token_budget_times_micro_batches_of_the_sequences_it_holds():
    """Dynamic batch size: the step is timed for micro-batches of as many mean-length sequences as the
    budget holds (CP x the budget), at most a DP rank's share of the pass's rows."""
    lay = layout(pp=4, ep=8)  # 32 devices, TP1 PP4: DP 8, 64 sequences a rank per optimizer step
    four = replace(RECIPE, micro_batch_size=4)
    budget = replace(RECIPE, max_token_len=4 * RECIPE.mean_len)
    for a, b in ((step_time.optimizer_step(Q30, lay, budget, RATES, Assumptions()),
                  step_time.optimizer_step(Q30, lay, four, RATES, Assumptions())),
                 (step_time.log_prob_pass(Q30, lay, budget, RATES), step_time.log_prob_pass(Q30, lay, four, RATES))):
        assert a == pytest.approx(b)
    # a budget of many sequences: one micro-batch of a rank's 64 sequences to train on, 512 to score
    huge = replace(RECIPE, max_token_len=10**9)
    assert step_time.optimizer_step(Q30, lay, huge, RATES, Assumptions()) == pytest.approx(
        step_time.optimizer_step(Q30, lay, replace(RECIPE, micro_batch_size=64), RATES, Assumptions()))
    assert step_time.log_prob_pass(Q30, lay, huge, RATES) == pytest.approx(
        step_time.log_prob_pass(Q30, lay, replace(RECIPE, micro_batch_size=512), RATES))
    # the log-prob passes' own budget sizes their micro-batches only
    own = replace(budget, log_prob_max_token_len=8 * RECIPE.mean_len)
    assert step_time.optimizer_step(Q30, lay, own, RATES, Assumptions()) == pytest.approx(
        step_time.optimizer_step(Q30, lay, four, RATES, Assumptions()))
    assert step_time.log_prob_pass(Q30, lay, own, RATES) == pytest.approx(
        step_time.log_prob_pass(Q30, lay, replace(RECIPE, micro_batch_size=8), RATES))
    # or their own rows, whatever cuts the training micro-batches
    for train in (budget, four):
        rows = replace(train, log_prob_micro_batch_size=8)
        assert step_time.optimizer_step(Q30, lay, rows, RATES, Assumptions()) == pytest.approx(
            step_time.optimizer_step(Q30, lay, four, RATES, Assumptions()))
        assert step_time.log_prob_pass(Q30, lay, rows, RATES) == pytest.approx(
            step_time.log_prob_pass(Q30, lay, replace(RECIPE, micro_batch_size=8), RATES))
    # CP2 halves what a rank holds of each sequence: twice the sequences in the same budget
    cp2 = layout(pp=4, ep=8, cp=2)
    assert step_time.optimizer_step(Q30, cp2, budget, RATES, Assumptions()) == pytest.approx(
        step_time.optimizer_step(Q30, cp2, replace(RECIPE, micro_batch_size=8), RATES, Assumptions()))


def test_the_optimizer_updates_its_shard_of_the_parameters():
    # the distributed optimizer: DP2 updates half of every parameter on each rank; EP2 on 2 ranks
    # (EDP 1) holds half the experts whole and half the dense parameters; without the distributed
    # optimizer each rank updates all it holds
    experts = TINY.num_layers * TINY.num_experts * TINY.expert_params
    dense = TINY.total_params - experts
    two = Cluster(device="cpu", devices_per_node=2)
    seconds = {name: step_time.optimizer_update_seconds(TINY, Layout("x", train=train, cluster=two), 0, FIXED) - 6e-3
               for name, train in (("dp2", TrainParallel()), ("ep2", TrainParallel(ep=2, etp=1)),
                                   ("dp2_plain", TrainParallel(use_distributed_optimizer=False)))}
    assert seconds["dp2"] == pytest.approx(TINY.total_params / 2 * 28 / 1e12)
    assert seconds["ep2"] == pytest.approx((dense / 2 + experts / 2) * 28 / 1e12)
    assert seconds["dp2_plain"] == pytest.approx(TINY.total_params * 28 / 1e12)
    # 5 ms a decoder layer of the stage, whatever the DP
    per_layer = replace(FIXED, optimizer_layer=5e-3)
    extra = {name: step_time.optimizer_update_seconds(TINY, Layout("x", train=train, cluster=two), 0, per_layer)
             - step_time.optimizer_update_seconds(TINY, Layout("x", train=train, cluster=two), 0, FIXED)
             for name, train in (("dp2", TrainParallel()), ("dp2_plain", TrainParallel(use_distributed_optimizer=False)),
                                 ("pp2", TrainParallel(pp=2)), ("tp2", TrainParallel(tp=2, sequence_parallel=True)))}
    assert extra == pytest.approx({"dp2": 4 * 5e-3, "dp2_plain": 4 * 5e-3, "pp2": 2 * 5e-3, "tp2": 4 * 5e-3})


def test_a_probes_sheet_gives_its_fixed_costs(tmp_path):
    sheet = tmp_path / "cpu.yaml"
    figure = "{value: %s, kind: measured, by: probe, source: a probe}"
    body = (f"device: cpu\nbf16_tflops: {figure % 0.01}\nhbm_gb_s: {figure % 10}\nintra_node_gb_s: {figure % 1}\n"
            f"inter_node_gb_s: {figure % 1}\n")
    sheet.write_text(body + "overheads: {collective_latency_us: 500, layer_forward_us: 2000, layer_backward_us: 3000, "
                            "tp_layer_forward_us: 100, tp_layer_backward_us: 200, ep_layer_forward_us: 300, "
                            "ep_layer_backward_us: 400, optimizer_step_us: 7000, by: probe, source: a probe}\n")
    hw = load_hardware(str(sheet))
    assert hw.overheads == Overheads(500, 2000, 3000, tp_layer_forward_us=100, tp_layer_backward_us=200,
                                     ep_layer_forward_us=300, ep_layer_backward_us=400, optimizer_step_us=7000,
                                     by="probe", source="a probe")
    r = Rates.of(hw, Assumptions(mfu=0.4))  # a measured compute rate is achieved already: no MFU on it
    assert (r.flops, r.intra, r.latency, r.layer_forward, r.layer_backward, r.optimizer_step) == pytest.approx(
        (1e10, 1e9, 5e-4, 2e-3, 3e-3, 7e-3))
    assert (r.tp_layer_forward, r.tp_layer_backward, r.ep_layer_forward, r.ep_layer_backward) == pytest.approx(
        (1e-4, 2e-4, 3e-4, 4e-4))
    sheet.write_text(body)  # none given: none counted, as a vendor sheet
    assert Rates.of(load_hardware(str(sheet)), Assumptions()).latency == 0.0
    sheet.write_text(body + "overheads: {collective_latency_us: -1}\n")
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_hardware(str(sheet))


# ---- the hardware sheets ---------------------------------------------------------------------------


def test_every_shipped_sheet_loads_with_a_source_for_each_figure():
    assert len(shipped_paths("hardware")) >= 4
    for path in shipped_paths("hardware"):
        hw = load_hardware(path)
        for figure in (hw.bf16_tflops, hw.hbm_gb_s, hw.intra_node_gb_s, hw.inter_node_gb_s):
            assert figure.source.strip() and figure.kind in ("peak", "measured")
    assert hardware_for(A2).name == "atlas_800t_a2" and hardware_for(Cluster(device="cpu")) is None
    assert hardware_for(Cluster(device="npu", npu_kind="a3")).name == "atlas_800_a3"


def test_a_bad_sheet_is_a_config_error(tmp_path):
    good = tmp_path / "x.yaml"
    sheet = open(shipped_paths("hardware")[0]).read()
    good.write_text(sheet.replace("\n  kind: peak", "\n  kind: guess", 1))
    with pytest.raises(ConfigError, match="choose one of peak, measured"):
        load_hardware(str(good))
    good.write_text(sheet + "nvlink: 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_hardware(str(good))


def test_rates_scale_peaks_use_measurements_and_overrides_as_given():
    fig = lambda value, kind: Figure(value, kind, "vendor", "s")  # noqa: E731
    hw = Hardware("npu", fig(100, "peak"), fig(1000, "peak"), fig(50, "measured"), fig(10, "peak"), name="t")
    r = Rates.of(hw, Assumptions(mfu=0.5, link_efficiency=0.8, hbm_efficiency=0.9))
    assert (r.flops, r.hbm, r.intra, r.inter) == (50e12, 900e9, 50e9, 8e9)
    given = Rates.of(hw, Assumptions(mfu=0.5), Overrides(tflops=200, inter_node_gb_s=3))
    assert (given.flops, given.inter) == (100e12, 3e9)
    assert Rates.of(None, Assumptions()) is None
    assert Rates.of(None, Assumptions(), Overrides(1, 1, 1, 1)).hardware == "command line"


# ---- the CLI -------------------------------------------------------------------------------------


def test_check_prints_the_step_under_the_memory_verdict(capsys):
    assert plan_main(["check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_4x8_a2", "--seq-len", "10240"]) == 0
    out = capsys.readouterr().out
    assert out.index("fits: training yes") < out.index("predicted RL step (ESTIMATE; rates: atlas_800t_a2")
    for label in ("compute (train", "EP all-to-all", "pipeline bubble", "rollout (prefill + decode)", "step "):
        assert label in out
    assert plan_main(["check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_4x8_a2", "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["step_time_s"]
    assert step["total"] == pytest.approx(sum(step["terms"].values()))
    assert step["rates"]["hardware"] == "atlas_800t_a2" and step["assumptions"]["mfu"] == 0.4


def test_check_takes_rates_from_the_command_line(capsys):
    args = ["check", "--model", "tiny_qwen3_moe", "--parallel", "tiny_cpu", "--seq-len", "256"]
    assert plan_main(args) == 0
    assert "no predicted step: no rates for cpu devices" in capsys.readouterr().out
    assert plan_main(args + ["--tflops", "1", "--hbm-bandwidth", "10", "--link-bandwidth", "intra=2,inter=1", "--json"]) == 0
    rates = json.loads(capsys.readouterr().out)["step_time_s"]["rates"]
    assert rates == {"hardware": "command line", "flops": 0.4e12, "hbm_bytes_s": 10e9,
                     "intra_node_bytes_s": 2e9, "inter_node_bytes_s": 1e9}


@pytest.mark.parametrize("bad", [
    ["--link-bandwidth", "intra=1,nvlink=2"], ["--link-bandwidth", "intra=-1"], ["--mfu", "0"], ["--mfu", "1.5"],
    ["--link-efficiency", "x"], ["--hardware", "h100"], ["--hardware", "nope"], ["--mini-batch", "500"],
    ["--response-len", "5000"], ["--prompt-len", "5000"],
])
def test_unusable_step_arguments_exit_2(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(plan_main(["check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_4x8_a2", *bad]))
    assert exit_.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()[-1]) > 0


def test_search_ranks_by_the_predicted_step(capsys):
    """Qwen3-30B-A3B at 10k-token sequences on 4 x 8 A2 (docs/launch.md): the layouts whose experts
    stay in a node come before TP1 PP1 EP32, whose all-to-all crosses four nodes over RoCE."""
    args = ["search", "--model", "qwen3_30b_a3b", "--nnodes", "4", "--devices-per-node", "8", "--npu-kind", "a2",
            "--device-memory-gb", "64", "--seq-len", "10240", "--top", "100"]
    assert plan_main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["layout"] for r in rows]
    totals = [r["step_time_s"]["total"] for r in rows]
    comfortable = [r for r in rows if r["memory_bytes"]["training_peak"] <= 0.8 * 64 * memory.GIB]
    assert [r["step_time_s"]["total"] for r in comfortable] == sorted(r["step_time_s"]["total"] for r in comfortable)
    ep32, seeds = names.index("qwen3_30b_a3b_tp1_pp1_ep32_etp1"), names.index("qwen3_30b_a3b_tp4_pp4_ep8_etp1")
    best = rows[0]
    assert "_ep32_" not in best["layout"] and seeds < ep32 and totals[seeds] < totals[ep32]
    a2a = lambda r: r["step_time_s"]["terms"]["expert_all_to_all"]  # noqa: E731
    assert a2a(rows[ep32]) > 5 * a2a(best) and a2a(rows[ep32]) > 5 * a2a(rows[seeds])
    assert plan_main(args[:-2] + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "ranked by predicted RL step" in out and "step s" in out and "EP8 inside a node" in out


# ---- bench/plan_calibrate.py: the probe's fits and the sheet it writes ------------------------------


def test_the_probes_fits_recover_known_costs_and_write_a_sheet_the_planner_reads(tmp_path):
    from bench import plan_calibrate as probe

    # gloo: 800 us + bytes / 0.5 GB/s; a layer: 2 ms forward, 3 ms backward fixed, 4 GFLOP/s
    collectives = [{"op": op, "through_bytes": b, "s": 800e-6 + b / 0.5e9}
                   for op, b in (("all_gather", 1e3), ("all_gather", 1e6), ("all_to_all", 5e2), ("all_to_all", 5e5))]
    # the rest of the model: 1 ms forward, 1.5 ms backward beyond the output layer's FLOPs
    layers = [{"flops": f, "fwd_s": 2e-3 + f / 4e9, "bwd_s": 3e-3 + 2 * f / 4e9, "logits_flops": f / 10,
               "rest_fwd_s": 1e-3 + f / 10 / 4e9, "rest_bwd_s": 1.5e-3 + 2 * f / 10 / 4e9} for f in (1e6, 1e7, 5e7)]
    # the actor's train step on 2 ranks (DP2): the schedule and the loss add 1 ms a micro-batch; a step
    # adds 7 ms + 3 ms a layer + its half of the parameters' 28 Adam bytes at the copy rate + the reduce-scatter of the gradients and the
    # all-gather of the parameters (fp32) at the gloo fit; the optimizer step alone, 2 ms + 3 ms a layer
    def fixed(n: float, layers: int) -> float:
        return 7e-3 + 3e-3 * layers + n / 2 * 28 / 5e9 + 2 * (800e-6 + n / 2 * 4 / 0.5e9)

    steps = [{"params": n, "ranks": 2, "layers": layers, "micro_batch_s": 1e-3, "fixed_s": fixed(n, layers),
              "optimizer_s": 2e-3 + 3e-3 * layers} for layers, n in ((1, 1e5), (2, 3e5))]
    fit = probe.summarise_probe([{"collectives": collectives, "layers": layers, "steps": steps, "copy_bytes_s": 5e9}])
    assert fit["collectives"] == pytest.approx({"latency_s": 800e-6, "bytes_s": 0.5e9})
    assert fit["layer"] == pytest.approx({"fixed_fwd_s": 2e-3, "fixed_bwd_s": 3e-3, "flops_s": 4e9,
                                          "rest_fwd_s": 1e-3, "rest_bwd_s": 1.5e-3})
    assert fit["train_step"] == pytest.approx({"micro_batch_s": 1e-3, "layer_s": 3e-3, "step_s": 7e-3})
    fit.update(ranks=2, when="now")
    path = tmp_path / "cpu.yaml"
    path.write_text(probe.sheet(2, 1, fit, fit, "python bench/plan_calibrate.py probe", "now"))
    hw = load_hardware(str(path))
    assert hw.device == "cpu" and hw.bf16_tflops.kind == "measured" and hw.bf16_tflops.by == "probe"
    r = Rates.of(hw, Assumptions())  # the MFU leaves a measured rate alone
    # the latency per ring step: the probe's 2 ranks are one; a training micro-batch's rest adds the train step's 1 ms
    assert (r.flops, r.intra, r.latency, r.layer_forward, r.layer_backward, r.micro_batch_forward,
            r.micro_batch_backward, r.optimizer_step, r.optimizer_layer) == pytest.approx(
        (4e9, 0.5e9, 800e-6, 2e-3, 3e-3, 1e-3, 2.5e-3, 7e-3, 3e-3))
    fit.update(ranks=4)  # without the TP pairs' calls, the 4-rank fit's intercept spans three ring steps
    path.write_text(probe.sheet(4, 1, fit, fit, "python bench/plan_calibrate.py probe", "now"))
    assert Rates.of(load_hardware(str(path)), Assumptions()).latency == pytest.approx(800e-6 / 3, rel=1e-3)
    # with the layers at TP2 and EP2: a call in the TP2 layers is the latency (a pair's call is one ring
    # step); a layer at TP2 takes half its FLOPs at the rate + the layer's fixed cost + 1 ms forward and
    # 5 ms backward, at EP2 all its FLOPs + the fixed cost + 0.5 ms and 0 ms (here less: taken as 0)
    f = 2e7

    def parallel(call_s: float) -> dict:
        return {"tp": {"parallel": {"tp": 2, "sequence_parallel": True}, "flops": f, "call_s": call_s,
                       "fwd_s": 2e-3 + f / 2 / 4e9 + 1e-3, "bwd_s": 3e-3 + f / 4e9 + 5e-3},
                "ep": {"parallel": {"ep": 2}, "flops": f, "call_s": 0.0,
                       "fwd_s": 2e-3 + f / 4e9 + 0.5e-3, "bwd_s": 3e-3 + 2 * f / 4e9 - 1e-3}}

    ranks = [{"collectives": collectives, "layers": layers, "steps": steps, "copy_bytes_s": 5e9,
              "parallel": parallel(s)} for s in (0.9e-3, 1.1e-3, 1.2e-3)]
    fit = probe.summarise_probe(ranks)
    assert fit["in_layer_call_s"] == pytest.approx(1.1e-3)
    assert fit["parallel_layers"]["tp"] == pytest.approx({"fwd_s": 1e-3, "bwd_s": 5e-3})
    assert fit["parallel_layers"]["ep"] == pytest.approx({"fwd_s": 0.5e-3, "bwd_s": -1e-3})
    fit.update(ranks=4, when="now")
    path.write_text(probe.sheet(4, 1, fit, fit, "python bench/plan_calibrate.py probe", "now"))
    r = Rates.of(load_hardware(str(path)), Assumptions())
    assert (r.latency, r.tp_layer_forward, r.tp_layer_backward, r.ep_layer_forward, r.ep_layer_backward) == \
        pytest.approx((1.1e-3, 1e-3, 5e-3, 0.5e-3, 0.0))
    assert "| 1.00 / 5.00 | 0.50 / -1.00 |" in probe.probe_table({(4, 1): fit})


def test_the_probe_table_says_when_a_collectives_time_did_not_grow_with_its_bytes():
    from bench import plan_calibrate as probe

    grows = probe.fit_collectives([{"through_bytes": b, "s": 800e-6 + b / 0.5e9} for b in (1e3, 1e6)])
    assert probe._op_fit(grows) == "800 us + bytes / 0.50 GB/s"
    # a busy machine: the larger call came out faster; no rate to show, the intercept is the latency
    flat = probe.fit_collectives([{"through_bytes": 1e3, "s": 3.0e-3}, {"through_bytes": 1e6, "s": 2.9e-3}])
    assert flat["bytes_s"] == float("inf") and probe._op_fit(flat) == "3,000 us, no growth with the bytes"


def _parallel_layers_on_a_rank(rank: int, repeats: int) -> dict:
    from bench.plan_calibrate import _parallel_layers

    return _parallel_layers(TINY, repeats)


@pytest.mark.slow
def test_the_probe_times_the_layer_at_tp2_and_ep2_on_gloo_ranks():
    # megatron's groups rebuilt for TP2+SP, then EP2, on 2 real gloo ranks; every collective the
    # layers issue is timed (the TP pair's gathers and scatters, the allgather dispatcher's)
    from bench.common import run_ranks

    for r in run_ranks(_parallel_layers_on_a_rank, 2, 1, 1):
        assert r["tp"]["parallel"] == {"tp": 2, "sequence_parallel": True} and r["ep"]["parallel"] == {"ep": 2}
        for name in ("tp", "ep"):
            assert r[name]["flops"] == 4 * flops.layer_forward_flops(TINY, 128)
            assert 0 < r[name]["call_s"] < 1
            assert all(abs(r[name][k]) < 1 for k in ("fwd_s", "bwd_s"))


def test_the_comparison_holds_the_model_only_to_pairs_the_rounds_tell_apart():
    from bench.plan_calibrate import told_apart

    # a's rounds all beat b's; c's overlap both, so neither pair with c has an order to reproduce
    rounds = {"a": [0.10, 0.12], "b": [0.13, 0.15], "c": [0.11, 0.14]}
    assert told_apart(rounds) == [("a", "b")]


@pytest.mark.parametrize("argv, says", [
    (["calibrate", "--configs", "1x1", "2x1", "--layouts", "single-1t", "dp2", "tp2ep2"],
     "--configs probes no cpu_gloo_4x1.yaml, which --layouts need"),
    (["calibrate", "--configs", "1x1", "--layouts", "single-1t"], "--configs has no configuration of 2 or more ranks"),
    (["probe", "--configs", "1x2"], "--configs has no configuration of 2 or more ranks"),
    (["calibrate", "--rounds", "0"], "--rounds must be >= 1"),
])
def test_a_calibration_that_could_not_write_its_sheets_is_refused_before_it_measures(argv, says, capsys):
    from bench.plan_calibrate import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(argv + ["--out-dir", "/nonexistent/sheets"])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_calibrate_reads_the_sheets_its_own_probe_writes(tmp_path):
    from bench.plan_calibrate import parse_args, sheet_for

    args = parse_args(["calibrate", "--out-dir", str(tmp_path)])
    assert args.sheets == args.out_dir == tmp_path.resolve()
    assert {sheet_for(n, args.sheets, args.threads).parent for n in args.layouts} == {tmp_path.resolve()}
