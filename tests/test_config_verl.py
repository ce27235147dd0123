"""verl's spellings: a verl Megatron script's overrides load onto the recipes; renamed keys move,
mirrored keys must agree, FSDP-only keys are refused naming the Megatron equivalent, and every
unknown key is listed at once."""

from __future__ import annotations

import pytest

from megatron_bridge.errors import ConfigError
from recipe.config import load_config, parse_overrides
from recipe.config.verl import translate

BIG = "configs/recipe/qwen3_30b_a3b_gspo.yaml"
TINY = "configs/recipe/tiny_gspo.yaml"

# The overrides of verl's Ascend GSPO nightly for Qwen3-30B-A3B on Megatron
# (tests/special_npu/nightly_ci_ascend/run_gspo_qwen3_30b_megatron_npu.sh in verl-project/verl, 2026-08),
# with its shell defaults filled in and the paths of this recipe.
VERL_GSPO_NPU = [
    "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
    "data.train_files=['/data/dapo-math-17k.parquet']", "data.val_files=['/data/aime-2024.parquet']",
    "data.train_batch_size=32", "data.max_prompt_length=2048", "data.max_response_length=2048",
    "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.model.path=/data/models/Qwen3-30B-A3B", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=3e-4", "actor_rollout_ref.actor.clip_ratio_high=4e-4",
    "actor_rollout_ref.actor.clip_ratio_c=10.0", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30720", "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
    "actor_rollout_ref.actor.megatron.param_offload=True", "actor_rollout_ref.actor.megatron.grad_offload=True",
    "actor_rollout_ref.actor.megatron.optimizer_offload=True", "actor_rollout_ref.actor.megatron.use_mbridge=True",
    "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion=True",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=8",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.7", "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720", "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
    "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size=8",
    "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1", "actor_rollout_ref.ref.megatron.param_offload=True",
    "actor_rollout_ref.ref.megatron.use_mbridge=True", "actor_rollout_ref.ref.megatron.vanilla_mbridge=True",
    "trainer.balance_batch=True", "trainer.critic_warmup=0", "trainer.logger=['console']",
    "trainer.project_name=verl_gspo_qwen3_moe", "trainer.experiment_name=qwen3_30b_a3b_vllm_megatron",
    "trainer.n_gpus_per_node=16", "trainer.nnodes=2", "trainer.val_before_train=False", "trainer.save_freq=-1",
    "trainer.test_freq=-1", "trainer.total_epochs=10", "trainer.total_training_steps=15", "model_engine=megatron",
]


def test_a_verl_megatron_gspo_script_loads_onto_the_recipe():
    # the recipe's own DAPO overlong buffer (4096 tokens) does not fit the script's 2048-token responses
    with pytest.raises(ConfigError, match="overlong_buffer.len \\(4096\\).*overlong_buffer.enable=false") as e:
        load_config(BIG, VERL_GSPO_NPU)
    assert "unknown key" not in str(e.value)
    cfg = load_config(BIG, VERL_GSPO_NPU + ["reward_model.overlong_buffer.enable=false"])
    arr, layout = cfg.actor_rollout_ref, cfg.layout
    assert (layout.train.tp, layout.train.pp, layout.train.ep, layout.train.etp) == (2, 1, 8, 1)
    assert layout.train.recompute_granularity == "full" and layout.train.param_offload
    assert (layout.rollout.tp, layout.rollout.dp) == (8, 4)  # DP derived from the 32 devices, as verl does
    assert arr.actor.use_dynamic_bsz and arr.actor.ppo_max_token_len_per_gpu == 30720
    assert arr.rollout.log_prob_use_dynamic_bsz and arr.ref.log_prob_max_token_len_per_gpu == 30720
    assert cfg.trainer.total_epochs == 10 and cfg.trainer.total_training_steps == 15
    ignored = " ".join(cfg.ignored)
    for key in ("use_mbridge", "moe_router_dtype", "balance_batch"):
        assert key in ignored, key
    # the kernels' switches take effect (docs/kernels.md)
    assert "use_remove_padding" not in ignored and arr.model.use_remove_padding
    assert "moe_permute_fusion" not in ignored and layout.train.permute_fusion


def test_mindspeeds_context_parallel_algo_reaches_the_layout_as_verl_hands_it_to_mindspeed():
    # verl's megatron workers pass override_transformer_config to mindspeed.megatron_adaptor.repatch as it
    # is, so MindSpeed's context_parallel_algo is written there
    cfg = load_config(BIG, VERL_GSPO_NPU + [
        "reward_model.overlong_buffer.enable=false", "actor_rollout_ref.actor.megatron.context_parallel_size=4",
        "actor_rollout_ref.model.use_remove_padding=false",  # packed CP has not run on the NPU
        "+actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo=hybrid_cp_algo",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.ulysses_degree_in_cp=2"])
    train = cfg.layout.train
    assert (train.cp, train.cp_algo, train.ulysses_degree_in_cp) == (4, "hybrid_cp_algo", 2)
    assert not any("context_parallel_algo" in i or "ulysses_degree_in_cp" in i for i in cfg.ignored)
    # the planner checks it as MindSpeed would (a ring of CP / 4 = 1 is none)
    with pytest.raises(ConfigError, match=r"\[train.cp_hybrid_ulysses_degree\].*ulysses_degree_in_cp=4.*valid: 1, 2"):
        load_config(BIG, VERL_GSPO_NPU + [
            "reward_model.overlong_buffer.enable=false", "actor_rollout_ref.actor.megatron.context_parallel_size=4",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo=hybrid_cp_algo",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.ulysses_degree_in_cp=4"])
    # off the NPU the package's own CP attention runs: MindSpeed's algorithms are refused naming the fix
    with pytest.raises(ConfigError, match=r"\[train.cp_algo_needs_npu\].*set context_parallel_algo: megatron_cp_algo"):
        load_config(TINY, ["actor_rollout_ref.actor.megatron.context_parallel_size=2",
                           "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
                           "+actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo=ulysses_cp_algo"])
    # verl's Ulysses key (its FSDP engine's) names both Megatron counterparts
    with pytest.raises(ConfigError, match="context_parallel_size here .*context_parallel_algo=ulysses_cp_algo"):
        load_config(TINY, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])


def _with(args: list[str], changes: dict[str, str], drop: tuple[str, ...] = ()) -> list[str]:
    keys = [a.split("=", 1)[0].lstrip("+") for a in args]
    assert set(changes) <= set(keys) and set(drop) <= set(keys)
    return [f"{key}={changes[key]}" if key in changes else a for a, key in zip(args, keys) if key not in drop]


# verl's GPU GSPO example for Qwen3-30B-A3B on Megatron (examples/gspo_trainer/run_qwen3_30b_a3b_megatron.sh,
# 2026-08) with its defaults, on the 2 x 16 devices of the recipe's layout (NNODES=2 NGPUS_PER_NODE=16)
VERL_GSPO_GPU = _with(VERL_GSPO_NPU, {
    "data.train_batch_size": "256", "data.max_response_length": "8192", "actor_rollout_ref.actor.ppo_mini_batch_size": "32",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "4", "actor_rollout_ref.rollout.gpu_memory_utilization": "0.8",
    "actor_rollout_ref.rollout.n": "16", "trainer.save_freq": "50", "trainer.test_freq": "10",
}, drop=("actor_rollout_ref.actor.megatron.vanilla_mbridge", "actor_rollout_ref.ref.megatron.vanilla_mbridge",
         "trainer.total_training_steps"))


def test_verls_gpu_gspo_example_loads_onto_the_recipe_unchanged():
    cfg = load_config(BIG, VERL_GSPO_GPU)
    assert (cfg.layout.rollout.tp, cfg.layout.rollout.dp, cfg.layout.rollout.ep) == (4, 8, 32)
    assert cfg.trainer.total_training_steps == 300 and cfg.trainer.total_epochs == 10  # the recipe's steps win
    assert cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.overlong_buffer.enable


def test_fused_kernels_run_where_torch_compile_does_and_are_listed_elsewhere():
    fused = ["actor_rollout_ref.model.use_fused_kernels=True", "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"]
    cpu = load_config(TINY, fused)
    assert cpu.actor_rollout_ref.model.use_fused_kernels and cpu.actor_loss.fused_kernels
    assert any(k.startswith("actor_rollout_ref.model.fused_kernel_options.impl_backend") for k in cpu.ignored)
    npu = load_config(BIG, fused)  # a verl script that sets it runs as it is, with the chunked kernels
    assert not npu.actor_loss.fused_kernels
    assert any(k.startswith("actor_rollout_ref.model.use_fused_kernels=True (torch.compile has no NPU backend")
               for k in npu.ignored)
    assert not load_config(TINY, []).actor_loss.fused_kernels  # verl's default


def test_reward_manager():
    with pytest.raises(ConfigError, match="applied by the dapo reward manager.*reward_manager=dapo"):
        load_config(TINY, ["reward.reward_manager.name=naive", "reward_model.overlong_buffer.enable=true",
                           "reward_model.overlong_buffer.len=4"])
    with pytest.raises(ConfigError, match="'prime' is not a valid choice; choose from naive, dapo"):
        load_config(TINY, ["reward_model.reward_manager=prime"])
    assert load_config(TINY, ["reward.reward_manager.name=dapo"]).reward_model.reward_manager == "dapo"


def test_log_prob_passes_take_the_actors_dynamic_batch_size_unless_set():
    arr = load_config(TINY, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512"]).actor_rollout_ref
    for section in (arr.rollout, arr.ref):  # verl's defaults: ${oc.select:actor_rollout_ref.actor...}
        assert section.log_prob_use_dynamic_bsz is True and section.log_prob_max_token_len_per_gpu == 512
    arr = load_config(TINY, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
                             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024"]).actor_rollout_ref
    assert arr.ref.log_prob_use_dynamic_bsz is False and arr.ref.log_prob_max_token_len_per_gpu == 16384
    assert arr.rollout.log_prob_use_dynamic_bsz is True and arr.rollout.log_prob_max_token_len_per_gpu == 1024
    plain = load_config(TINY, ["actor_rollout_ref.actor.use_dynamic_bsz=false"]).actor_rollout_ref
    assert plain.rollout.log_prob_use_dynamic_bsz is False and plain.ref.log_prob_use_dynamic_bsz is False
    tiny = load_config(TINY).actor_rollout_ref  # the tiny recipe's own: one micro-batch a pass
    assert tiny.actor.use_dynamic_bsz and tiny.rollout.log_prob_use_dynamic_bsz and tiny.ref.log_prob_use_dynamic_bsz


def test_a_token_budget_must_hold_the_longest_sequence():
    """Tiny recipe: prompts up to 32 and responses up to 16 tokens, 48 in all; a budget below that is
    refused at load, naming each pass's key that falls short, rather than at the first long batch."""
    def refused(overrides):
        with pytest.raises(ConfigError) as e:
            load_config(TINY, overrides)
        return str(e.value)

    budget = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    message = refused([f"{budget}=40"])  # the old-log-prob pass follows the actor's budget (verl)
    assert (f"{budget} (40) and actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (40) must hold the longest "
            "sequence, data.max_prompt_length + data.max_response_length = 48 tokens: raise each to at least 48") in message
    message = refused([f"{budget}=40", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096"])
    assert f"{budget} (40) must hold" in message and "raise it to at least 48" in message
    # CP2 on 4 ranks: megatron's CP algorithm cuts a sequence into 4 chunks, each rank holds half
    cp2 = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    assert "over context parallel 2: raise each to at least 24" in refused([*cp2, f"{budget}=23"])
    assert load_config(TINY, [*cp2, f"{budget}=24"]).actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 24
    assert not load_config(TINY, ["actor_rollout_ref.actor.use_dynamic_bsz=false", f"{budget}=40"]).actor_rollout_ref.actor.use_dynamic_bsz


def test_the_memory_plan_takes_a_token_budgets_micro_batch():
    """With dynamic batch size the planned micro-batch is the actor's budget of longest sequences, no
    more than the rows a rank trains on in an optimizer step (16 x 8 on one device here); without it,
    ppo_micro_batch_size_per_gpu rows."""
    from megatron_bridge.plan.memory import estimate, log_prob_pass_memory
    from recipe.config import layout_verdict, model_spec

    one = ["trainer.device=cuda", "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1"]

    def planned(overrides):
        cfg = load_config(TINY, one + overrides)
        spec = model_spec(cfg, TINY)
        return layout_verdict(cfg, spec).memory.train_peak, lambda rows: estimate(spec, cfg.layout, 48, rows).train_peak

    peak, at = planned([])
    assert peak == at(128) > at(127)  # the rank's whole mini-batch: the budget holds 341 rows of 48
    peak, at = planned(["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=960"])
    assert peak == at(20)  # 960 tokens: 20 rows of 48
    peak, at = planned(["actor_rollout_ref.actor.use_dynamic_bsz=false"])
    assert peak == at(8)
    # the old-log-prob pass's own larger budget: its forward (logits of an RL step's 128 rows, one layer) is planned
    # as well, and is the peak where it needs more than the training micro-batch of 20 rows
    cfg = load_config(TINY, one + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=960",
                                   "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=65536"])
    report = layout_verdict(cfg, model_spec(cfg, TINY)).memory
    spec, t = model_spec(cfg, TINY), cfg.layout.train
    assert report.log_prob_pass == log_prob_pass_memory(spec, t, 48, 128) > report.activations + report.logits
    assert report.train_peak == report.static.total + report.log_prob_pass
    assert ("log-prob forward (if above those 3)", report.log_prob_pass, False) in report.terms
    # a layout the planner refuses (TP4 on 2 ranks: no DP) is refused by its rule, not divided by its zero DP
    with pytest.raises(ConfigError, match=r"train\.world_divisible_by_tp_pp_cp"):
        load_config(TINY, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])


def test_gradient_checkpointing_turns_on_full_recompute_where_the_layout_has_none():
    train = load_config(TINY, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"]).layout.train
    assert (train.recompute_granularity, train.recompute_method, train.recompute_num_layers) == ("full", "uniform", 1)
    assert load_config(TINY, ["actor_rollout_ref.model.enable_gradient_checkpointing=false"]).layout.train.recompute_granularity is None
    big = load_config(BIG, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert any("enable_gradient_checkpointing=True (the layout's recompute applies)" in n for n in big.ignored)


def test_renamed_keys_move_and_must_not_disagree():
    cfg = load_config(TINY, ["actor_rollout_ref.actor.grad_clip=0.5",
                             "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                             "reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
                             "+actor_rollout_ref.actor.megatron.override_transformer_config.account_for_loss_in_pipeline_split=true",
                             "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64"])
    assert cfg.actor_rollout_ref.actor.optim.clip_grad == 0.5
    assert cfg.reward_model.overlong_buffer.enable and cfg.reward_model.overlong_buffer.len == 4
    assert cfg.layout.train.account_for_loss_in_pipeline_split
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 64
    with pytest.raises(ConfigError, match="actor.grad_clip=0.5 .* actor_rollout_ref.actor.optim.clip_grad=0.25 disagree"):
        load_config(TINY, ["actor_rollout_ref.actor.grad_clip=0.5", "actor_rollout_ref.actor.optim.clip_grad=0.25"])


def test_vllm_engine_arguments_go_to_the_engine():
    cfg = load_config(BIG, ["actor_rollout_ref.rollout.enforce_eager=true",
                            "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
                            "+actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs == {"vllm": {
        "enforce_eager": True, "max_num_batched_tokens": 8192, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}}
    tiny = load_config(TINY, ["actor_rollout_ref.rollout.enforce_eager=true"])  # the CPU engine takes none
    assert any("engine_kwargs.vllm (the hf engine" in note for note in tiny.ignored)


def test_mirrored_keys_must_agree():
    load_config(TINY, ["actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
                       "actor_rollout_ref.rollout.response_length=16"])
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["actor_rollout_ref.ref.megatron.expert_model_parallel_size=1",
                           "actor_rollout_ref.rollout.prompt_length=99"])
    text = str(e.value)
    assert "ref.megatron.expert_model_parallel_size=1 must equal actor_rollout_ref.actor.megatron.expert_model_parallel_size (2)" in text
    assert "rollout.prompt_length=99 must equal data.max_prompt_length (32)" in text


@pytest.mark.parametrize("override, says", [
    ("actor_rollout_ref.actor.fsdp_config.param_offload=true", "FSDP backend; .* use actor_rollout_ref.actor.megatron.param_offload"),
    ("actor_rollout_ref.actor.fsdp_config.fsdp_size=8", "FSDP backend; .* actor_rollout_ref.actor.megatron"),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "use actor_rollout_ref.actor.optim.lr_decay_style"),
    ("actor_rollout_ref.actor.strategy=fsdp2", "strategy='fsdp2' is not supported: the actor is Megatron-Core"),
    ("trainer.critic_warmup=5", "critic_warmup=5 is not supported: GRPO and GSPO have no critic"),
    ("async_training.use_rollout_log_probs=true", "fully asynchronous trainer, not implemented here: the old "
                                                  "log-probs are always recomputed"),
])
def test_what_does_not_apply_is_refused_with_the_reason(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY, [override])


def test_every_unknown_key_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["trainer.totl_epochs=3", "data.train_batch_szie=4", "actor_rollout_ref.actor.clip_ratio_hihg=1"])
    text = str(e.value)
    assert "3 unknown key(s)" in text
    for key, near in (("trainer.totl_epochs", "trainer.total_epochs"), ("data.train_batch_szie", "data.train_batch_size"),
                      ("actor_rollout_ref.actor.clip_ratio_hihg", "actor_rollout_ref.actor.clip_ratio_high")):
        assert f"{key}: unknown key; did you mean {near}?" in text


def test_hydra_prefixes():
    assert parse_overrides(["+a.b=1", "++c=2"]) == {"a": {"b": 1}, "c": 2}
    with pytest.raises(ConfigError, match="deleting a key .* not supported"):
        parse_overrides(["~trainer.logger"])


def test_translate_leaves_this_packages_own_keys_alone():
    ours = {"data": {"train_batch_size": 4}, "actor_rollout_ref": {"actor": {"optim": {"clip_grad": 1.0}}}}
    out = translate(ours)
    assert out.data == ours and not (out.ignored or out.errors or out.equal_checks)
