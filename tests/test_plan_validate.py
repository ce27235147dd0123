"""Validator rules (megatron-core 0.12.1 and vLLM), stage splits and shipped layouts."""

from dataclasses import replace

import pytest

from megatron_bridge.configs import shipped_paths
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import Cluster, Layout, RolloutParallel, TrainParallel, load_layout
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.plan.stages import layers_per_chunk, layers_per_stage
from megatron_bridge.plan.validate import validate

Q30 = load_model_spec("qwen3_30b_a3b")
Q235 = load_model_spec("qwen3_235b_a22b")
TINY = load_model_spec("tiny_qwen3_moe")


def make(train=None, rollout=None, nnodes=1, devices=8, device="npu", **cluster):
    w = nnodes * devices
    return Layout(
        "test",
        train=train or TrainParallel(),
        rollout=rollout or RolloutParallel(tp=1, dp=w),
        cluster=Cluster(nnodes=nnodes, devices_per_node=devices, device=device, **cluster),
    )


def rules(spec, layout, seq_len=4096, **kw):
    """rule -> its messages (one rule may be broken in several places), joined by newlines."""
    found = {}
    for v in validate(spec, layout, seq_len, **kw):
        found[v.rule] = f"{found[v.rule]}\n{v.message}" if v.rule in found else v.message
    return found


def test_tp8_rejected_for_qwen3_30b_with_the_message_users_need():
    layout = make(TrainParallel(tp=8, ep=4, etp=1, sequence_parallel=True), nnodes=4)
    found = rules(Q30, layout)
    assert found["train.tp_divides_num_query_groups"] == (
        "tensor_model_parallel_size=8: num_query_groups (4) must be a multiple of it; "
        "valid TP for this model: 1, 2, 4"
    )
    assert "train.tp_divides_num_attention_heads" not in found  # 32 heads % 8 == 0


def test_seed_layout_valid_on_4x8_and_rejected_on_2x8():
    seeds = load_layout("qwen3_30b_a3b_4x8_a2")
    assert (seeds.train.tp, seeds.train.pp, seeds.train.ep, seeds.train.expert_tp) == (4, 4, 8, 1)
    assert (seeds.rollout.tp, seeds.rollout.dp) == (4, 8)  # DP derived from the 32 devices
    assert validate(Q30, seeds, 4096) == []
    found = rules(Q30, seeds.with_cluster(nnodes=2, devices_per_node=8))
    assert "rollout.tp_dp_equals_world" not in found  # DP follows the world: 16 / 4
    assert "pure EP (EP = TP*DP = 16)" in found["rollout.moe_pure_ep_or_tp"]
    assert "ETP*EP*PP = 1*8*4 = 32" in found["train.world_divisible_by_etp_ep_pp"]


def test_ep3_rejected_for_128_experts():
    layout = make(TrainParallel(ep=3, etp=1), nnodes=3)
    msg = rules(Q30, layout)["train.ep_divides_experts"]
    assert "num_experts (128) must be divisible by it" in msg
    assert "valid EP: 1, 2, 4, 8, 16, 32, 64, 128" in msg


@pytest.mark.parametrize("pp,first,last", [(4, 22, 24), (8, 10, 12), (6, 14, 16)])
def test_uneven_pp_for_235b_accepted_where_megatron_accepts_it(pp, first, last):
    train = TrainParallel(tp=4, pp=pp, ep=16, etp=1, sequence_parallel=True,
                          first_stage_layers=first, last_stage_layers=last)
    layout = make(train, rollout=RolloutParallel(tp=4, dp=32 * pp // 4, ep=1), nnodes=pp * 2, devices=16)
    assert validate(Q235, layout, 4096) == []
    stages = layers_per_stage(94, train)
    assert stages[0] == first and stages[-1] == last and sum(stages) == 94


def test_235b_even_pp4_rejected_and_bad_uneven_split_rejected():
    even = make(TrainParallel(pp=4, ep=8, etp=1), nnodes=4)
    msg = rules(Q235, even)["train.pp_divides_layers"]
    assert "94 layers must be divisible by it; valid even PP: 1, 2, 47, 94" in msg
    bad = make(TrainParallel(pp=8, ep=8, etp=1, first_stage_layers=10, last_stage_layers=10), nnodes=8)
    msg = rules(Q235, bad)["train.uneven_pp_layers"]
    assert "94 layers - first 10 - last 10 = 74" in msg and "6 middle stage(s)" in msg
    # The suggested first-stage values really are valid.
    suggested = [int(x) for x in msg.rsplit(": ", 1)[1].split(", ")]
    assert 10 not in suggested and suggested
    for f in suggested:
        ok = replace(bad, train=replace(bad.train, first_stage_layers=f))
        assert "train.uneven_pp_layers" not in rules(Q235, ok)


def test_account_for_embedding_and_loss_split():
    train = TrainParallel(pp=4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert "train.pp_divides_layers" not in rules(Q235, make(train, nnodes=4))  # 96 % 4 == 0
    assert layers_per_stage(94, train) == [23, 24, 24, 23]
    uneven_too = replace(train, first_stage_layers=22)
    assert "train.uneven_pp_not_with_accounting" in rules(Q235, make(uneven_too, nnodes=4))


def test_vpp_rules_and_chunk_split():
    assert layers_per_chunk(48, TrainParallel(pp=4, vpp=3)) == [[4, 4, 4]] * 4
    assert "train.vpp_divides_stage_layers" in rules(Q30, make(TrainParallel(pp=4, vpp=5), nnodes=4))
    assert "train.vpp_needs_pp" in rules(Q30, make(TrainParallel(pp=1, vpp=2)))
    uneven = TrainParallel(pp=4, vpp=2, first_stage_layers=11, last_stage_layers=13, ep=8, etp=1)
    found = rules(Q30, make(uneven, nnodes=4))
    assert "num_layers_in_first_pipeline_stage=11 must be divisible" in found["train.uneven_pp_vpp"]
    assert layers_per_chunk(48, replace(uneven, first_stage_layers=10, last_stage_layers=14)) == [[5, 5], [6, 6], [6, 6], [7, 7]]


def test_uneven_first_and_last_need_a_middle_stage():
    # megatron-core 0.12.1 raised ZeroDivisionError in TransformerConfig for this layout
    both = TrainParallel(pp=2, first_stage_layers=1, last_stage_layers=3)
    found = rules(TINY, make(both, devices=2, device="cpu"), seq_len=16)
    assert found["train.uneven_pp_needs_middle_stage"].endswith("set only one of them, or PP >= 3")
    assert validate(TINY, make(replace(both, last_stage_layers=None), devices=2, device="cpu"), 16) == []


def test_interleaved_uneven_last_stage_needs_the_first():
    # megatron-core 0.12.1 built layers 0 and 2 on both pipeline ranks: wrong log-probs, no error
    last = TrainParallel(pp=2, vpp=2, last_stage_layers=2)
    msg = rules(TINY, make(last, devices=2, device="cpu"), seq_len=16)["train.uneven_pp_vpp_last_needs_first"]
    assert msg.endswith("use num_layers_in_first_pipeline_stage: 2 instead (the same split)")
    first = replace(last, first_stage_layers=2, last_stage_layers=None)
    assert validate(TINY, make(first, devices=2, device="cpu"), 16) == []
    pp4 = TrainParallel(pp=4, vpp=2, ep=8, etp=1, last_stage_layers=12)
    msg = rules(Q30, make(pp4, nnodes=4))["train.uneven_pp_vpp_last_needs_first"]
    assert msg.endswith("set num_layers_in_first_pipeline_stage: 12 too (the same split)")
    assert validate(Q30, make(replace(pp4, first_stage_layers=12), nnodes=4), 4096) == []
    assert layers_per_chunk(48, replace(pp4, first_stage_layers=12)) == [[6, 6]] * 4


def test_etp_must_equal_tp_without_expert_parallel():
    # issue 16: TP2 ETP1 EP1 was accepted and failed in megatron-core's first forward
    tp2 = TrainParallel(tp=2, etp=1, sequence_parallel=True)
    msg = rules(TINY, make(tp2, devices=2, device="cpu"), seq_len=16)["train.etp_equals_tp_without_ep"]
    assert "ETP must equal TP (2)" in msg and "'First dimension of the tensor should be divisible" in msg
    assert msg.endswith("set expert_tensor_parallel_size: 2, or keep ETP=1 with expert_model_parallel_size in: 2")
    # ETP above TP runs but reduces the expert gradients over the wrong group; no EP fits 2 devices
    msg = rules(TINY, make(TrainParallel(etp=2), devices=2, device="cpu"), seq_len=16)["train.etp_equals_tp_without_ep"]
    assert "First dimension" not in msg and msg.endswith("set expert_tensor_parallel_size: 1")
    with_ep = TrainParallel(tp=2, ep=2, etp=1, sequence_parallel=True)
    assert validate(TINY, make(with_ep, devices=4, device="cpu"), 16) == []


def test_uneven_pp_needs_pp():
    found = rules(Q30, make(TrainParallel(first_stage_layers=20)))
    assert "train.uneven_pp_needs_pp" in found


def test_world_divisibility_rules():
    found = rules(Q30, make(TrainParallel(tp=4, pp=3, ep=8, etp=1, sequence_parallel=True), nnodes=2))
    assert "world size 16 (nodes x devices) must be divisible by TP*PP*CP = 4*3*1 = 12" in found["train.world_divisible_by_tp_pp_cp"]
    assert "ETP*EP*PP = 1*8*3 = 24" in found["train.world_divisible_by_etp_ep_pp"]


def test_expert_tp_must_split_moe_ffn():
    found = rules(TINY, make(TrainParallel(tp=1, etp=3), devices=3, device="cpu"))
    assert "moe_intermediate_size (32) must be divisible by it" in found["train.etp_divides_moe_ffn"]


def test_sequence_parallel_rules():
    assert "train.sp_needs_tp" in rules(Q30, make(TrainParallel(sequence_parallel=True)))
    assert "train.moe_tp_needs_sp" in rules(Q30, make(TrainParallel(tp=2)))
    msg = rules(Q30, make(TrainParallel(tp=4, sequence_parallel=True)), seq_len=4098)["train.seq_len_divisible"]
    assert msg == ("seq_len=4098 must be a multiple of 4: sequence parallel splits each rank's seq_len/CP over "
                   "tensor_model_parallel_size=4; pad sequences to a multiple of 4 (e.g. 4100)")


def test_heads_and_vocab_must_divide_tp():
    odd = replace(TINY, num_attention_heads=6, num_query_groups=6, head_dim=16, vocab_size=510)
    found = rules(odd, make(TrainParallel(tp=4, sequence_parallel=True), devices=4, device="cpu",),)
    assert "num_attention_heads (6) must be a multiple of it" in found["train.tp_divides_num_attention_heads"]
    assert "vocab_size (510) must be divisible by it" in found["train.tp_divides_vocab"]


CP2 = TrainParallel(tp=2, pp=2, ep=8, etp=1, cp=2, sequence_parallel=True)  # Q30 on 2 x 8 devices


def test_a_context_parallel_layout_is_valid_on_every_platform():
    for device in ("cpu", "cuda", "npu"):
        assert validate(Q30, make(CP2, nnodes=2, device=device), 4096) == [], device
    assert validate(TINY, make(TrainParallel(cp=2), devices=2, device="cpu"), 16) == []
    # MindSpeed's algorithms on the NPU: Ulysses over 8 ranks (32 heads / 8; 4 KV heads repeated),
    # hybrid with 2 Ulysses x 2 ring ranks
    ulysses = TrainParallel(cp=8, ep=8, etp=1, cp_algo="ulysses_cp_algo")
    assert validate(Q30, make(ulysses), 4096) == []
    hybrid = TrainParallel(cp=4, ep=8, etp=1, cp_algo="hybrid_cp_algo", ulysses_degree_in_cp=2)
    assert validate(Q30, make(hybrid), 4096) == []


def test_context_parallel_lengths_split_into_2cp_chunks_and_over_tp():
    # megatron's load-balanced split: 2*CP chunks, rank r holds chunks r and 2CP-1-r
    msg = rules(TINY, make(TrainParallel(cp=2), devices=2, device="cpu"), seq_len=18)["train.seq_len_divisible"]
    assert msg == ("seq_len=18 must be a multiple of 4: context parallel cuts each sequence into 2*CP = 4 chunks "
                   "(CP rank r holds chunks r and 3-r); pad sequences to a multiple of 4 (e.g. 20)")
    # with sequence parallel each rank's seq_len/CP splits over TP too: lcm(2*CP, CP*TP)
    tp4 = replace(CP2, tp=4, pp=1)
    msg = rules(Q30, make(tp4, nnodes=2), seq_len=4100)["train.seq_len_divisible"]
    assert msg.startswith("seq_len=4100 must be a multiple of 8: context parallel cuts each sequence into 2*CP = 4 "
                          "chunks (CP rank r holds chunks r and 3-r); sequence parallel splits each rank's seq_len/CP "
                          "over tensor_model_parallel_size=4")
    assert msg.endswith("(e.g. 4104)")
    assert validate(Q30, make(tp4, nnodes=2), 4104) == []
    assert (CP2.seq_multiple, tp4.seq_multiple, replace(CP2, cp=4, tp=1, sequence_parallel=False).seq_multiple) == (4, 8, 8)
    # Ulysses gives each rank one contiguous slice: CP, not 2*CP
    ulysses = TrainParallel(cp=8, ep=8, etp=1, cp_algo="ulysses_cp_algo")
    assert ulysses.seq_multiple == 8
    assert "cuts each sequence into CP = 8 contiguous slices" in rules(Q30, make(ulysses), 4092)["train.seq_len_divisible"]
    assert "train.seq_len_divisible" not in rules(Q30, make(ulysses), 4088)


def test_context_parallel_needs_the_fused_attention():
    found = rules(Q30, make(replace(CP2, flash_attn=False), nnodes=2, device="cuda"))
    # megatron-core 0.12.1 transformer/dot_product_attention.py, DotProductAttention.__init__
    assert "'Context parallelism is only supported by TEDotProductAttention!'" in found["train.cp_needs_flash_attn"]
    assert found["train.cp_needs_flash_attn"].endswith("set use_flash_attn: true")
    assert "train.cp_needs_flash_attn" not in rules(Q30, make(TrainParallel(ep=8, etp=1, flash_attn=False)))


def test_mindspeeds_cp_algorithms_are_the_npus_and_checked_as_mindspeed_would():
    for device in ("cpu", "cuda"):
        found = rules(TINY, make(TrainParallel(cp=2, cp_algo="ulysses_cp_algo"), devices=2, device=device), 16)
        assert set(found) == {"train.cp_algo_needs_npu"}
        assert f"on {device} the context-parallel attention is the package's own" in found["train.cp_algo_needs_npu"]
        assert found["train.cp_algo_needs_npu"].endswith("set context_parallel_algo: megatron_cp_algo")
    adaptive = rules(Q30, make(TrainParallel(cp=2, ep=8, etp=1, cp_algo="adaptive_cp_algo")))
    assert "choose megatron_cp_algo (ring), ulysses_cp_algo or hybrid_cp_algo" in adaptive["train.cp_algo_unsupported"]
    stray = rules(Q30, make(TrainParallel(cp=2, ep=8, etp=1, ulysses_degree_in_cp=2)))
    assert stray["train.ulysses_degree_needs_hybrid"].endswith("set context_parallel_algo: hybrid_cp_algo")
    # hybrid: CP / ulysses_degree_in_cp is the ring, at least 2 (MindSpeed's validate_args, which repatch skips)
    hybrid = TrainParallel(cp=4, ep=8, etp=1, cp_algo="hybrid_cp_algo")
    for degree, got in ((None, "ulysses_degree_in_cp is not set"), (4, "ulysses_degree_in_cp=4"), (3, "ulysses_degree_in_cp=3")):
        msg = rules(Q30, make(replace(hybrid, ulysses_degree_in_cp=degree)))["train.cp_hybrid_ulysses_degree"]
        assert got in msg and msg.endswith("valid: 1, 2")
    # Ulysses deals each rank heads / (degree x TP): 32 heads over 16 x TP4 do not divide
    wide = TrainParallel(tp=4, cp=16, ep=8, etp=1, sequence_parallel=True, cp_algo="ulysses_cp_algo")
    msg = rules(Q30, make(wide, nnodes=8))["train.cp_ulysses_heads"]
    assert "num_attention_heads (32) must be divisible by context_parallel_size x tensor_model_parallel_size = 16*4" in msg
    assert msg.endswith("with TP=4 valid context_parallel_size: 2, 4, 8")
    ring3 = TrainParallel(cp=6, ep=2, etp=1, cp_algo="hybrid_cp_algo", ulysses_degree_in_cp=3)
    msg = rules(Q30, make(ring3, devices=6), seq_len=4092)["train.cp_ulysses_heads"]
    assert msg.endswith("with TP=1 valid ulysses_degree_in_cp: 2")
    # 6 key/value heads cannot be split evenly over 4 Ulysses ranks (nor repeated: 4 is not above 6)
    six_kv = replace(Q30, num_attention_heads=24, num_query_groups=6)
    found = rules(six_kv, make(TrainParallel(cp=4, ep=8, etp=1, cp_algo="ulysses_cp_algo")))
    assert set(found) == {"train.cp_ulysses_kv_heads"}
    assert "the 6 key/value heads per TP rank must be divisible by context_parallel_size=4" in found["train.cp_ulysses_kv_heads"]


def test_recompute_rules():
    base = TrainParallel(pp=4, ep=8, etp=1)
    assert "train.recompute_method" in rules(Q30, make(replace(base, recompute_granularity="full", recompute_num_layers=1), nnodes=4))
    too_many = replace(base, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=13)
    assert "(12); got 13" in rules(Q30, make(too_many, nnodes=4))["train.recompute_num_layers"]
    sel = replace(base, recompute_granularity="selective", recompute_num_layers=2)
    assert "train.recompute_selective" in rules(Q30, make(sel, nnodes=4))
    ok = replace(base, recompute_granularity="full", recompute_method="block", recompute_num_layers=12)
    assert validate(Q30, make(ok, nnodes=4), 4096) == []


def test_rollout_rules():
    train = TrainParallel(ep=8, etp=1)
    # vLLM replicates KV heads above 4: TP8 is fine for rollout (unlike megatron), TP3/6 are not.
    assert validate(Q30, make(train, rollout=RolloutParallel(tp=8, dp=1, ep=8)), 4096) == []
    found = rules(Q30, make(TrainParallel(ep=2, etp=1), rollout=RolloutParallel(tp=6, dp=1), devices=6))
    assert "num_attention_heads (32) must be divisible by it" in found["rollout.tp_divides_heads"]
    assert "with 4 KV heads vLLM needs TP to divide 4 or be a multiple of it" in found["rollout.kv_heads"]
    mixed = rules(Q30, make(train, rollout=RolloutParallel(tp=2, dp=4, ep=4)))
    assert "pure EP (EP = TP*DP = 8) or pure TP (EP = 1), never mixed" in mixed["rollout.moe_pure_ep_or_tp"]
    odd_experts = replace(Q30, num_experts=96)
    found = rules(odd_experts, make(TrainParallel(ep=1), rollout=RolloutParallel(tp=1, dp=64, ep=64), nnodes=8))
    assert "num_experts (96) must be divisible by it" in found["rollout.ep_divides_experts"]
    few = replace(TINY, num_attention_heads=16, num_query_groups=16, head_dim=4)
    assert "rollout.tp_le_experts" in rules(few, make(TrainParallel(), rollout=RolloutParallel(tp=16, dp=1), devices=16, device="cpu"))


def test_every_violation_is_reported_at_once():
    layout = make(TrainParallel(tp=8, pp=5, ep=3, etp=1), rollout=RolloutParallel(tp=3, dp=3), nnodes=2)
    found = rules(Q30, layout)
    for rule in ("train.tp_divides_num_query_groups", "train.moe_tp_needs_sp", "train.world_divisible_by_tp_pp_cp",
                 "train.world_divisible_by_etp_ep_pp", "train.ep_divides_experts", "train.pp_divides_layers",
                 "rollout.tp_divides_heads", "rollout.tp_dp_equals_world"):
        assert rule in found, rule


MODEL_OF_LAYOUT = {"qwen3_30b_a3b": Q30, "qwen3_235b_a22b": Q235, "tiny_cpu": TINY}


@pytest.mark.parametrize("path", shipped_paths("parallel"), ids=lambda p: p.rsplit("/", 1)[-1])
def test_every_shipped_layout_is_valid_for_its_model(path):
    layout = load_layout(path)
    spec = next(m for prefix, m in MODEL_OF_LAYOUT.items() if layout.name.startswith(prefix))
    assert validate(spec, layout, 4096) == []


def test_rollout_tp_dp_ep_are_checked_on_the_rollout_pool():
    """With a pool of its own the rollout's TP x DP and EP are checked against the pool's devices,
    not the training world: 2x16 training devices, rollout on 1 x 8."""
    layout = load_layout("qwen3_30b_a3b_2x16_a3").with_rollout_pool(1, 8)
    assert (layout.rollout.tp, layout.rollout.dp) == (2, 4)  # DP derived from the pool
    found = rules(Q30, layout)
    assert set(found) == {"rollout.moe_pure_ep_or_tp"}  # EP32 is the training world's TP x DP
    assert "pure EP (EP = TP*DP = 8)" in found["rollout.moe_pure_ep_or_tp"]
    assert validate(Q30, replace(layout, rollout=replace(layout.rollout, ep=8)), 4096) == []
    pinned = replace(layout, rollout=replace(layout.rollout, dp=16, ep=1))  # the colocated DP, kept
    assert ("must equal the rollout's device count 8 (its own pool); with rollout TP=2 use data_parallel_size=4"
            in rules(Q30, pinned)["rollout.tp_dp_equals_world"])
    # rollout TP above the pool's devices: no DP makes TP x DP = 1 device
    found = rules(Q30, replace(load_layout("qwen3_30b_a3b_2x16_a3"), rollout=RolloutParallel(tp=2, ep=1))
                  .with_rollout_pool(1, 1))
    assert "TP*DP = 2*1 = 2 must equal the rollout's device count 1" in found["rollout.tp_dp_equals_world"]


def test_a_layout_yaml_reads_exponents_as_numbers_as_a_recipe_does(tmp_path):
    """One YAML reader for every config: ``6.4e1`` is a float in a layout file too (PyYAML's own
    loader reads it as a string), and a file that is no mapping is named."""
    path = tmp_path / "big.yaml"
    path.write_text("trainer:\n  nnodes: 1\n  n_gpus_per_node: 8\n  device: npu\n  device_memory_gb: 6.4e1\n")
    assert load_layout(str(path)).cluster.device_memory_gb == 64.0
    path.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match=f"{path}: expected a mapping of config keys, got list"):
        load_layout(str(path))
