"""Memory model at scale, MC2 facts, config readers and the plan CLI."""

import json
from dataclasses import replace
import subprocess
import sys

import pytest
import yaml

from megatron_bridge.plan import mc2, memory
from megatron_bridge.plan.batching import TokenBudget
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import Cluster, Layout, RolloutParallel, TrainParallel, layout_from_dict, load_layout
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.plan.cli import main as plan_main
from megatron_bridge.plan.verdict import evaluate

Q30 = load_model_spec("qwen3_30b_a3b")
Q235 = load_model_spec("qwen3_235b_a22b")


def test_param_counts_match_the_model_cards():
    assert Q30.total_params == 30_532_122_624 and Q30.active_params == 3_353_032_704
    assert round(Q235.total_params / 1e9, 3) == 235.094 and round(Q235.active_params / 1e9, 3) == 22.191


# (model, W, TP, PP, EP, ETP, GiB of weights+grads+optimizer on the worst stage): the worked
# examples of facts §5, derived there as 2 + 4 + 12/d bytes with d = DP*CP (dense), EDP (experts).
FACTS = [
    (Q30, 8, 1, 1, 8, 1, 71.5), (Q30, 16, 2, 1, 8, 1, 45.9), (Q30, 16, 1, 2, 8, 1, 35.8),
    (Q30, 16, 4, 1, 16, 1, 33.6), (Q30, 32, 2, 2, 8, 1, 22.9), (Q235, 128, 4, 8, 16, 1, 33.5),
    (Q235, 128, 4, 4, 32, 1, 34.5), (Q235, 256, 4, 8, 32, 1, 17.8),
]


@pytest.mark.parametrize("spec,w,tp,pp,ep,etp,gib", FACTS)
def test_static_memory_matches_the_worked_examples(spec, w, tp, pp, ep, etp, gib):
    uneven = {} if spec.num_layers % pp == 0 else {"first_stage_layers": 94 - (pp - 1) * 12, "last_stage_layers": 12}
    if pp == 4 and spec is Q235:
        uneven = {"first_stage_layers": 22, "last_stage_layers": 24}
    train = TrainParallel(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1, **uneven)
    layout = Layout("x", train=train, cluster=Cluster(nnodes=1, devices_per_node=w))
    worst = max(memory.static_memory(spec, layout, r).total for r in range(pp))
    # The examples ignore padding and Adam's step counters and round to 0.1 GiB (0.5% margin).
    assert worst / memory.GIB == pytest.approx(gib, rel=0.005)


def test_expert_and_dense_states_shard_over_different_groups():
    # W=16, TP2 PP1 EP8 ETP1: dense states shard over DP*CP = 8, experts over EDP = 2.
    layout = Layout("x", train=TrainParallel(tp=2, ep=8, etp=1, sequence_parallel=True),
                    cluster=Cluster(nnodes=2, devices_per_node=8))
    assert memory.data_parallel_sizes(layout) == (8, 2)
    h, hd = Q30.hidden_size, Q30.head_dim
    attention_split = Q30.attention_params_per_layer - 2 * hd  # q/k/v/o split over TP
    replicated = 2 * h + 2 * hd + Q30.num_experts * h  # norms and the router are whole on every TP rank
    dense = Q30.num_layers * (attention_split / 2 + replicated) + 2 * Q30.embedding_params / 2 + h
    experts = Q30.num_layers * Q30.num_experts * Q30.expert_params / 8
    expected = 12 * dense / 8 + 12 * experts / 2
    assert memory.static_memory(Q30, layout, 0).optimizer == pytest.approx(expected, rel=1e-4)


def test_buffer_layout_follows_megatron_padding_rules():
    buf = memory.buffer_layout([10, 100, 7], dp=2, distributed_optimizer=True)
    # reverse order, each start aligned to 64, end padded to lcm(2, 128)
    assert buf.ranges == [(0, 7), (64, 164), (192, 202)] and buf.numel == 256
    assert memory.shard_numel(buf, 2, 0) == 7 + 64 and memory.shard_numel(buf, 2, 1) == 36 + 10
    plain = memory.buffer_layout([10, 100, 7], dp=2, distributed_optimizer=False)
    assert plain.numel == 117


def test_full_recompute_cuts_activation_estimate():
    t = TrainParallel(tp=2, pp=2, ep=8, etp=1, sequence_parallel=True)
    none = memory.activation_memory(Q30, t, 24, 4096)
    full = memory.activation_memory(Q30, TrainParallel(**{**t.__dict__, "recompute_granularity": "full",
                                                          "recompute_method": "uniform", "recompute_num_layers": 1}), 24, 4096)
    assert full < none / 10


def test_attention_memory_is_linear_in_length_with_the_fused_kernel_and_quadratic_without():
    t = TrainParallel(tp=2, pp=2, ep=8, etp=1, sequence_parallel=True)
    local = TrainParallel(**{**t.__dict__, "flash_attn": False})
    fused = [memory.activation_memory(Q30, t, 24, s) for s in (8192, 16384, 32768)]
    assert fused[1] == 2 * fused[0] and fused[2] == 2 * fused[1]
    unfused = [memory.activation_memory(Q30, local, 24, s) for s in (8192, 16384)]
    # instead of the fused kernel's fp32 log-sum-exp per head and token, the fp32 softmax and bf16
    # probabilities (6 bytes a score) of 16 heads a TP rank in each of 24 layers, for the PP = 2
    # micro-batches in flight; and one layer's backward at work (12 bytes a score)
    for s, fused_bytes, unfused_bytes in zip((8192, 16384), fused, unfused):
        assert unfused_bytes - fused_bytes == 2 * 24 * (16 * s**2 * 6 - s * 16 * 4) + 16 * s**2 * 12


def test_logits_are_held_once_in_bf16_beside_one_float32_chunk():
    from loss.vocab_parallel import CHUNKS_AT_LEAST, DEFAULT_CHUNK_SIZE

    # the planner's chunking is the loss package's (it imports no torch, so it keeps its own copy)
    assert (memory.LOG_PROB_CHUNK_TOKENS, memory.LOG_PROB_CHUNKS_AT_LEAST) == (DEFAULT_CHUNK_SIZE, CHUNKS_AT_LEAST)
    t = TrainParallel(tp=2)
    vocab = 151936 // 2
    # 4096 tokens: bf16 logits, and a chunk of 4096 / 16 = 256 rows in float32 with its bf16 source
    assert memory.logits_memory(Q30, t, 4096) == 4096 * vocab * 2 + 256 * vocab * 6
    # 32k tokens: the chunk stops at 1024 rows
    assert memory.logits_memory(Q30, t, 32768) == 32768 * vocab * 2 + 1024 * vocab * 6
    # several padded rows come out of megatron's GPTModel transposed, a second copy for a moment
    assert memory.logits_memory(Q30, t, 4096, 2, packed=False) == 8192 * vocab * 4 + 512 * vocab * 6
    # no chunks: a float32 copy of every row
    assert memory.logits_memory(Q30, t, 4096, log_prob_chunk_size=0) == 4096 * vocab * 8


def test_longest_sequence_is_the_last_length_whose_training_fits():
    layout = load_layout("qwen3_30b_a3b_2x8_a2").with_cluster(device_memory_gb=64)
    longest = memory.longest_sequence(Q30, layout)
    assert longest % layout.train.tp == 0 and layout.train.seq_multiple == layout.train.tp
    assert memory.estimate(Q30, layout, longest).train_fits
    assert not memory.estimate(Q30, layout, longest + layout.train.tp).train_fits
    # megatron's attention keeps every head's s x s probabilities: far shorter sequences fit
    local = replace(layout, train=replace(layout.train, flash_attn=False))
    assert memory.longest_sequence(Q30, local) < longest / 2
    assert memory.longest_sequence(Q30, layout.with_cluster(device_memory_gb=1)) == 0
    unknown = replace(layout, cluster=replace(layout.cluster, device_memory_gb=None))
    assert memory.longest_sequence(Q30, unknown) is None


def test_context_parallel_divides_every_per_token_term_and_holds_longer_sequences():
    t = TrainParallel(tp=2, pp=2, ep=8, etp=1, sequence_parallel=True)
    cp2 = replace(t, cp=2)
    # a CP rank holds seq_len/CP tokens: activations (the fused kernel's log-sum-exp included) and the
    # logits of 2s tokens under CP2 are those of s tokens under CP1
    assert memory.activation_bytes_per_layer(Q30, cp2, 8192) == memory.activation_bytes_per_layer(Q30, t, 4096)
    assert memory.logits_memory(Q30, cp2, 8192) == memory.logits_memory(Q30, t, 4096)
    # off the NPU the keys and values of the other CP rank are gathered and kept: bf16, kv_dim / TP each
    gathered = memory.activation_bytes_per_layer(Q30, cp2, 8192, gathered_kv=True)
    assert gathered - memory.activation_bytes_per_layer(Q30, cp2, 8192) == 4096 * 2 * 2 * Q30.kv_dim // 2

    npu = load_layout("qwen3_30b_a3b_2x8_a2").with_cluster(device_memory_gb=64)
    with_cp = replace(npu, train=replace(npu.train, cp=2))  # same 16 devices: DP*CP, so the states, unchanged
    one, two = memory.longest_sequence(Q30, npu), memory.longest_sequence(Q30, with_cp)
    # everything that grows with the sequence is per CP rank on the NPU: twice the tokens fit
    assert two == 2 * one and two % with_cp.train.seq_multiple == 0 == two % 4
    assert not memory.estimate(Q30, with_cp, two + 4).train_fits
    cuda = replace(with_cp, cluster=replace(with_cp.cluster, device="cuda", npu_kind=None))
    gathered = memory.longest_sequence(Q30, cuda)
    assert one < gathered < two and gathered % 4 == 0
    four = replace(npu, train=replace(npu.train, cp=4))
    assert memory.longest_sequence(Q30, four) % 8 == 0 and memory.longest_sequence(Q30, four) > two


def test_mc2_for_the_seed_layout_on_a2():
    plan = mc2.plan_mc2(Q30, load_layout("qwen3_30b_a3b_4x8_a2"), max_num_seqs=1024)
    assert plan.method == "mc2" and plan.max_tokens_per_rank == 256
    # 2 * (256 tok * EP32 * 4 local experts * Align512(Align32(4096)+64)=4608 + 256 * top8 * Align512(4096))
    expected = 2 * (256 * 32 * 4 * 4608 + 256 * 8 * 4096)
    assert mc2.buffer_bytes(Q30, 32, 256) == expected == 318_767_104
    assert plan.needed_buffsize_mb == 304 and plan.hccl_buffsize_mb == 320


def test_mc2_not_picked_on_a2_with_small_ep_or_without_ep():
    layout = Layout("x", rollout=RolloutParallel(tp=1, dp=8, ep=8), cluster=Cluster(1, 8, "npu", "a2", 64))
    assert mc2.plan_mc2(Q30, layout, 256).method == "all-gather"  # EP 8 < 16, 16 experts per NPU
    pure_tp = Layout("x", rollout=RolloutParallel(tp=4, dp=2, ep=1), cluster=Cluster(1, 8, "npu", "a3", 64))
    assert not mc2.plan_mc2(Q30, pure_tp, 256).applies
    a3 = Layout("x", rollout=RolloutParallel(tp=1, dp=8, ep=8), cluster=Cluster(1, 8, "npu", "a3", 64))
    assert mc2.plan_mc2(Q30, a3, 256).method.startswith("mc2")


def test_layout_yaml_unknown_key_names_the_nearest_one():
    data = yaml.safe_load(open("configs/parallel/qwen3_30b_a3b_4x8_a2.yaml"))
    data["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_paralel_size"] = 2
    with pytest.raises(ConfigError, match="did you mean actor_rollout_ref.actor.megatron.tensor_model_parallel_size"):
        layout_from_dict(data, "typo")
    with pytest.raises(ConfigError, match="must be a positive integer"):
        layout_from_dict({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 0}}}, "zero")


def test_mindspeeds_context_parallel_algo_is_a_layout_key_and_no_part_of_the_shards():
    data = yaml.safe_load(open("configs/parallel/qwen3_30b_a3b_2x16_a3.yaml"))
    otc = data["actor_rollout_ref"]["actor"]["megatron"].setdefault("override_transformer_config", {})
    otc.update(context_parallel_algo="hybrid_cp_algo", ulysses_degree_in_cp=2)
    train = layout_from_dict(data, "hybrid").train
    assert (train.cp_algo, train.ulysses_degree_in_cp) == ("hybrid_cp_algo", 2)
    assert TrainParallel().cp_algo == "megatron_cp_algo" and TrainParallel().ulysses_degree_in_cp is None
    # a kernel choice: a checkpoint written under one algorithm is the same shards under another
    assert train.layout_only == replace(train, cp_algo="megatron_cp_algo", ulysses_degree_in_cp=None).layout_only
    assert "cp" in train.layout_only and "cp_algo" not in train.layout_only
    otc["context_parallel_algo"] = "ulysses"
    with pytest.raises(ConfigError, match=r"context_parallel_algo='ulysses': did you mean ulysses_cp_algo\? choose "
                                          "one of megatron_cp_algo, ulysses_cp_algo, hybrid_cp_algo, adaptive_cp_algo, "
                                          "hybrid_adaptive_cp_algo"):
        layout_from_dict(data, "typo")
    otc.update(context_parallel_algo="ulysses_cp_algo", ulysses_degree_in_cp=0)
    with pytest.raises(ConfigError, match="ulysses_degree_in_cp=0: must be a positive integer"):
        layout_from_dict(data, "zero")


def test_model_spec_reads_a_transformers5_checkpoint_config(tmp_path):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{k: v for k, v in yaml.safe_load(open("configs/model/tiny_qwen3_moe.yaml")).items()
                            if k not in ("architectures", "torch_dtype", "rope_theta", "rope_scaling")},
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in saved or "num_experts" in saved
    spec = load_model_spec(str(tmp_path))
    assert spec.rope_theta == 5e6 and spec.num_experts == 8 and spec.num_query_groups == 4 and spec.head_dim == 16


def test_model_spec_errors_name_the_input(tmp_path):
    with pytest.raises(ConfigError, match="shipped models: .*qwen3_30b_a3b"):
        load_model_spec("no_such_model")
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama' is not supported"):
        load_model_spec(str(bad))


def test_a_token_budget_plans_the_sequences_it_holds():
    """Dynamic batch size: a micro-batch is a token budget per device, so the plan holds as many
    sequences of the planned length as fit in it (CP x the budget), at most a DP rank's rows of an
    optimizer step; a budget that holds no sequence is a broken rule."""
    layout = load_layout("qwen3_30b_a3b_2x16_a3")  # TP2 PP2 on 32 devices: DP 8
    v = evaluate(Q30, layout, 10240, TokenBudget(20480, 512))
    assert v.valid and v.rows == 2
    assert v.memory.train_peak == memory.estimate(Q30, layout, 10240, 2).train_peak
    assert TokenBudget(30720, 512).rows(layout, 8192) == 3.75  # a size in sequences, not a count
    assert TokenBudget(10**6, 512).rows(layout, 4096) == 512 / 8  # all a DP rank trains on in a step
    cp2 = replace(layout, train=replace(layout.train, cp=2))  # DP 4: each CP rank holds half a sequence
    assert TokenBudget(20480, 512).rows(cp2, 10240) == 4 and TokenBudget(10**6, 512).rows(cp2, 4096) == 128

    short = evaluate(Q30, layout, 10240, TokenBudget(10239, 512))
    assert short.memory is None and [x.rule for x in short.violations] == ["batch.token_budget_holds_sequence"]
    assert "raise --max-token-len to at least 10240" in short.violations[0].message
    assert evaluate(Q30, cp2, 10240, TokenBudget(5120, 512)).valid  # 10240 tokens over CP2
    assert "at least 5120" in str(evaluate(Q30, cp2, 10240, TokenBudget(5119, 512)).violations[0])

    # the longest sequence under a budget: no longer than the budget holds, and what memory allows
    assert memory.longest_sequence(Q30, layout, TokenBudget(20480, 512)) == 20480
    assert memory.longest_sequence(Q30, cp2, TokenBudget(20480, 512)) == 40960
    tight = layout.with_cluster(device_memory_gb=24)
    budget = TokenBudget(65536, 512)
    longest = memory.longest_sequence(Q30, tight, budget)
    assert 0 < longest < 65536 and longest % 2 == 0
    assert memory.estimate(Q30, tight, longest, budget.rows(tight, longest)).train_fits
    assert not memory.estimate(Q30, tight, longest + 2, budget.rows(tight, longest + 2)).train_fits


def test_a_larger_log_prob_micro_batch_plans_its_forward_pass():
    """The log-prob passes run forward only: their logits and one layer at work. At the training
    micro-batch's size that is less than training; a log-prob budget twice or four times as large
    (verl scripts often give one) can be the peak."""
    layout = load_layout("qwen3_30b_a3b_2x16_a3")
    t, last = layout.train, layout.train.pp - 1
    forward = memory.log_prob_pass_memory(Q30, t, 10240, 4)
    assert forward == memory.logits_memory(Q30, t, 10240, 4) + memory.activation_bytes_per_layer(Q30, t, 10240, 4)
    plain = memory.estimate(Q30, layout, 10240, 2)
    same = memory.estimate(Q30, layout, 10240, 2, log_prob_rows=2)
    assert plain.log_prob_pass == 0 and "log-prob forward (if above those 3)" not in [n for n, _, _ in plain.terms]
    assert 0 < same.log_prob_pass < same.activations + same.logits and same.train_peak == plain.train_peak
    big = memory.estimate(Q30, layout, 10240, 2, log_prob_rows=4)
    assert big.pp_rank == last and big.log_prob_pass == forward > big.activations + big.logits + big.routing
    assert big.train_peak == big.static.total + forward > plain.train_peak

    args = ["check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_2x16_a3", "--seq-len", "10240",
            "--max-token-len", "20480", "--json"]
    out = json.loads(_cli(*args, "--log-prob-max-token-len", "40960").stdout)
    assert out["memory_bytes"]["log-prob forward (if above those 3)"] == forward
    assert out["memory_bytes"]["training_peak"] == big.train_peak
    short = _cli(*args[:-1], "--log-prob-max-token-len", "8192")
    assert short.returncode == 1 and "raise --log-prob-max-token-len to at least 10240" in short.stdout
    # the same micro-batches in rows (verl's log_prob_micro_batch_size_per_gpu without dynamic batch size)
    rows = ["check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_2x16_a3", "--seq-len", "10240",
            "--micro-batch-size", "2", "--json"]
    out = json.loads(_cli(*rows, "--log-prob-micro-batch-size", "4").stdout)
    assert out["memory_bytes"]["log-prob forward (if above those 3)"] == forward
    assert out["memory_bytes"]["training_peak"] == big.train_peak
    both = _cli(*rows, "--log-prob-micro-batch-size", "4", "--log-prob-max-token-len", "40960")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_check_and_search_take_a_token_budget(tmp_path):
    args = ["--model", "qwen3_30b_a3b", "--seq-len", "10240"]
    out = _cli("check", *args, "--parallel", "qwen3_30b_a3b_2x16_a3", "--max-token-len", "20480")
    assert out.returncode == 0, out.stderr
    assert "micro-batch: 20,480 tokens per device (dynamic batch size), planned as 2 sequence(s) of 10,240 tokens" \
        in out.stdout
    assert "longest sequence whose training fits: 20,480 tokens (as long as the token budget holds;" in out.stdout
    as_json = json.loads(_cli("check", *args, "--parallel", "qwen3_30b_a3b_2x16_a3", "--max-token-len", "20480",
                              "--json").stdout)
    rows = json.loads(_cli("check", *args, "--parallel", "qwen3_30b_a3b_2x16_a3", "--micro-batch-size", "2",
                           "--json").stdout)
    assert as_json["micro_batch_sequences"] == rows["micro_batch_sequences"] == 2
    assert as_json["memory_bytes"] == rows["memory_bytes"]
    short = _cli("check", *args, "--parallel", "qwen3_30b_a3b_2x16_a3", "--max-token-len", "8192")
    assert short.returncode == 1 and "batch.token_budget_holds_sequence" in short.stdout
    both = _cli("check", *args, "--parallel", "qwen3_30b_a3b_2x16_a3", "--max-token-len", "8192",
                "--micro-batch-size", "2")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr

    best = tmp_path / "best.yaml"
    search = ["search", *args, "--nnodes", "2", "--devices-per-node", "16", "--device-memory-gb", "64",
              "--max-token-len", "20480", "--top", "50"]
    assert plan_main([*search, "--write", str(best)]) == 0
    found = json.loads(_cli(*search, "--json").stdout)
    assert found and all(r["valid"] and r["micro_batch_sequences"] == 2 for r in found)
    assert _cli("check", *args, "--parallel", str(best), "--max-token-len", "20480").returncode == 0
    none = _cli(*search[:-4], "--max-token-len", "4096")
    assert none.returncode == 1 and "--max-token-len larger" in none.stderr


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_bridge.plan", *args], capture_output=True, text=True)


def test_cli_check_exit_codes():
    ok = _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "configs/parallel/qwen3_30b_a3b_4x8_a2.yaml")
    assert ok.returncode == 0 and "VALID" in ok.stdout and "HCCL_BUFFSIZE: 320 MB" in ok.stdout
    bad = _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "configs/parallel/qwen3_30b_a3b_4x8_a2.yaml",
               "--nnodes", "2", "--devices-per-node", "8")
    assert bad.returncode == 1 and "rollout.moe_pure_ep_or_tp" in bad.stdout
    assert _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "nope.yaml").returncode == 2
    assert _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "tiny_cpu", "--nnodes", "0").returncode == 2
    assert _cli("check", "--help").returncode == 0 and _cli("search", "--help").returncode == 0


def test_cli_check_rejects_a_layout_that_does_not_fit_in_memory():
    out = _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_4x8_a2", "--device-memory-gb", "16")
    assert out.returncode == 1 and "memory.train_fits" in out.stdout


def test_a_reference_model_adds_its_weights_under_the_param_offload_rule():
    layout = load_layout("qwen3_30b_a3b_2x16_a3")
    plain, ref = memory.estimate(Q30, layout, 4096), memory.estimate(Q30, layout, 4096, reference=True)
    weights = ref.static.weights  # the same layout and buffer as the actor's; no grads, no optimizer
    assert ref.reference == weights > 0 and plain.reference == 0
    assert ref.train_peak - plain.train_peak == weights
    assert ref.offload_host - plain.offload_host == weights  # param_offload is on in this layout
    assert ref.resident_during_rollout == plain.resident_during_rollout == 0
    kept = replace(layout, train=replace(layout.train, param_offload=False))
    plain, ref = memory.estimate(Q30, kept, 4096), memory.estimate(Q30, kept, 4096, reference=True)
    assert ref.resident_during_rollout - plain.resident_during_rollout == weights and ref.offload_host == plain.offload_host
    out = _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_2x16_a3", "--reference-model", "--json")
    terms = json.loads(out.stdout)["memory_bytes"]
    assert out.returncode == 0 and terms["reference model weights (bf16, KL)"] == weights
    # the checkpoint: bf16 weight, fp32 main parameter, Adam's two fp32 moments per parameter, over 32 ranks
    total = Q30.total_params * (2 + 4 + 4 + 4)
    assert json.loads(out.stdout)["checkpoint_bytes"] == {"total": total, "per_rank": -(-total // 32)}


def test_search_prints_only_valid_layouts_that_check_accepts(tmp_path):
    out = tmp_path / "best.yaml"
    assert plan_main(["search", "--model", "qwen3_30b_a3b", "--nnodes", "2", "--devices-per-node", "8",
                      "--device-memory-gb", "64", "--npu-kind", "a2", "--top", "50", "--write", str(out)]) == 0
    result = _cli("search", "--model", "qwen3_30b_a3b", "--nnodes", "2", "--devices-per-node", "8",
                  "--device-memory-gb", "64", "--npu-kind", "a2", "--top", "50", "--json")
    rows = json.loads(result.stdout)
    assert rows and all(r["valid"] and r["fits"] for r in rows)
    assert all(r["memory_bytes"]["training_peak"] <= 64 * memory.GIB for r in rows)
    best = load_layout(str(out))
    assert best.cluster.world_size == 16
    assert _cli("check", "--model", "qwen3_30b_a3b", "--parallel", str(out)).returncode == 0


def test_the_planner_does_not_import_megatron():
    """Planning runs before any process starts, on machines without megatron's runtime set up."""
    code = ("import sys; from megatron_bridge.plan.cli import main; main(['check', '--model', 'qwen3_30b_a3b', "
            "'--parallel', 'qwen3_30b_a3b_4x8_a2']); print(sorted(m for m in sys.modules if m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---- the rollout on a pool of its own (hybrid_engine=false) --------------------------------------

SPLIT = ("--rollout-nnodes", "2", "--rollout-devices-per-node", "16")


def test_rollout_pool_memory_is_the_engines_alone():
    """Its own pool: the rollout's weights over rollout TP (experts over TP*DP) and the KV cache in
    what the gpu_memory_utilization share leaves; the training devices keep their training peak."""
    colocated = load_layout("qwen3_30b_a3b_2x16_a3")
    split = colocated.with_rollout_pool(1, 16)
    split = replace(split, rollout=replace(split.rollout, ep=16))  # pure EP over the pool's 16 devices
    assert (split.rollout.tp, split.rollout.dp, split.rollout_world_size) == (2, 8, 16)  # DP derived from the pool
    report, same = memory.estimate(Q30, split, 4096), memory.estimate(Q30, colocated, 4096)
    experts = Q30.num_layers * Q30.num_experts * Q30.expert_params
    weights = int(2 * ((Q30.total_params - experts) / 2 + experts / 16))
    share = int(0.5 * 64 * memory.GIB)
    assert report.rollout_pool == memory.RolloutPoolMemory(weights, share)
    assert report.rollout_pool.kv_cache == share - weights and report.rollout_fits is True
    assert report.train_peak == same.train_peak and same.rollout_pool is None
    # A share too small for the weights fails on the rollout pool, whatever the training devices keep.
    tight = replace(split, rollout=replace(split.rollout, gpu_memory_utilization=0.05))
    assert memory.estimate(Q30, tight, 4096).rollout_fits is False
    # No offload, 40 GiB devices, 60 % for the engine: colocated, the 17.9 GiB of training state stay
    # beside the 24 GiB share and do not fit; on a pool of its own the engine has the device alone.
    kept = replace(colocated.train, param_offload=False, grad_offload=False, optimizer_offload=False)
    big_share = replace(colocated.rollout, gpu_memory_utilization=0.6)
    small = replace(colocated, train=kept, rollout=big_share).with_cluster(device_memory_gb=40)
    assert memory.estimate(Q30, small, 4096).fits is False
    assert memory.estimate(Q30, small.with_rollout_pool(2, 16), 4096).fits is True


def test_rollout_pool_too_small_for_its_weights_is_named():
    layout = replace(load_layout("qwen3_30b_a3b_4x8_a2"), rollout=RolloutParallel(tp=1, ep=1))
    report = memory.estimate(Q30, layout.with_rollout_pool(1, 1), 4096)
    # the whole model (61 GB in bf16) on one device of 64 GiB, half of it the engine's
    assert report.rollout_pool.weights == 2 * Q30.total_params and report.rollout_fits is False
    from megatron_bridge.plan.verdict import memory_violations

    (violation,) = memory_violations(report)
    assert violation.rule == "memory.rollout_pool_fits" and "56.87 GiB per device" in violation.message


def _without_step(lines: list[str]) -> tuple[list[str], list[str]]:
    """(the lines without the predicted step's block, the block)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("predicted RL step"))
    end = next(i for i, line in enumerate(lines) if line.startswith("  rollout decode:")) + 1
    return lines[:start] + lines[end:], lines[start:end]


def test_check_without_the_rollout_flags_is_unchanged_and_with_them_changes_only_the_rollout_lines():
    """The rollout's lines, and the predicted step's schedule (test_plan_step_time)."""
    args = ("check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_2x16_a3")
    (colocated, colocated_step), (split, split_step) = (_without_step(_cli(*a).stdout.splitlines())
                                                        for a in (args, (*args, *SPLIT)))
    assert "colocated" in colocated_step[-2] and "one step off" in split_step[-2]
    at = colocated.index(next(line for line in colocated if line.startswith("  rollout weights")))
    expected = (colocated[:3] + ["rollout pool: 2 x 16 npu = 32 devices of its own (hybrid_engine=false)"]
                + colocated[3:at]
                + ["memory per rollout device (TP2 DP16 EP32; no training state there):", colocated[at],
                   colocated[at + 1], "  KV cache budget (share - weights)           28.88 GiB"]
                + colocated[at + 4:])
    assert split == expected
    assert colocated[at + 2].startswith("  training state kept during rollout")
    plain, own = json.loads(_cli(*args, "--json").stdout), json.loads(_cli(*args, *SPLIT, "--json").stdout)
    assert "rollout_pool" not in plain and "kept_during_rollout" in plain["memory_bytes"]
    pool = own.pop("rollout_pool")
    assert "one step off" in own.pop("step_time_s")["schedule"] and plain.pop("step_time_s")
    for key in ("kept_during_rollout", "offload_host"):  # nothing of the rollout's on the training devices
        plain["memory_bytes"].pop(key)
    assert own == plain
    weights = pool["memory_bytes"]["weights"]
    assert pool == {"nnodes": 2, "devices_per_node": 16, "devices": 32, "tp": 2, "dp": 16, "ep": 32,
                    "gpu_memory_utilization": 0.5, "fits": True,
                    "memory_bytes": {"weights": weights, "share": 32 * memory.GIB, "kv_cache": 32 * memory.GIB - weights}}


@pytest.mark.parametrize("flags, says", [
    (("--rollout-nnodes", "2"), "--rollout-nnodes needs --rollout-devices-per-node too "
                                  "(the rollout's own pool: nodes and devices per node)"),
    (("--rollout-devices-per-node", "8"), "--rollout-devices-per-node needs --rollout-nnodes "
                                              "too (the rollout's own pool: nodes and devices per node)"),
    (("--rollout-nnodes", "0", "--rollout-devices-per-node", "8"), "argument --rollout-nnodes: 0 must be >= 1"),
    (("--rollout-nnodes", "1", "--rollout-devices-per-node", "two"), "argument --rollout-devices-per-node: 'two' is not an integer"),
])
def test_rollout_flags_refused_in_one_line(flags, says):
    out = _cli("check", "--model", "qwen3_30b_a3b", "--parallel", "qwen3_30b_a3b_2x16_a3", *flags)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == f"python -m megatron_bridge.plan check: error: {says}"


def test_the_optimizer_steps_temporaries_count_where_adam_is_not_known_to_run_fused():
    """A multi-tensor Adam's sqrt of the whole shard (4 bytes a main parameter) after the activations
    are freed: counted on the NPU, where MindSpeed picks the optimizer; none on CUDA and the CPU,
    where the actor's Adam runs fused. At 1k tokens on one device it sets the NPU's peak."""
    train = TrainParallel(recompute_granularity="full")
    npu, cuda = (memory.estimate(Q30, Layout("x", train=train, cluster=Cluster(nnodes=1, devices_per_node=1,
                                                                                 device=device)), 1024)
                 for device in ("npu", "cuda"))
    assert npu.optimizer_step == npu.static.main_params > 0 and cuda.optimizer_step == 0
    working = cuda.activations + cuda.logits + cuda.routing
    assert npu.static.main_params > working
    assert npu.train_peak - cuda.train_peak == npu.static.main_params - working
    assert "optimizer step (if above the 3 before)" in [name for name, _, _ in npu.terms]
    assert "optimizer step (if above the 3 before)" not in [name for name, _, _ in cuda.terms]
