"""The recipe config: composition order, overrides, typing, validation, the shipped recipes."""

import dataclasses
import json
import os

import pytest
import yaml

from megatron_bridge.runtime.optim import OptimConfig
from megatron_bridge.configs import CONFIGS_DIR, shipped
from megatron_bridge.errors import ConfigError
from recipe.config import RecipeConfig, config_from_dict, config_to_dict, load_config, parse_overrides, resolve_path

TINY = "tiny_gspo"
BIG = "qwen3_30b_a3b_gspo"
TWINS = [("tiny_gspo", "tiny_grpo"), ("qwen3_30b_a3b_gspo", "qwen3_30b_a3b_grpo")]


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def error(recipe: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    return str(info.value)


# ---- overrides -------------------------------------------------------------------------------


def test_parse_overrides_reads_yaml_values_including_bare_exponents():
    parsed = parse_overrides([
        "a.b=3", "a.c=1e-6", "a.d=-2.5E3", "e=true", "f=[console, jsonl]", "g=null", "h=text", "a.i=0x10",
    ])
    assert parsed == {
        "a": {"b": 3, "c": 1e-6, "d": -2500.0, "i": 16},
        "e": True, "f": ["console", "jsonl"], "g": None, "h": "text",
    }
    assert isinstance(parsed["a"]["c"], float)


def test_parse_overrides_later_wins_and_merges_siblings():
    assert parse_overrides(["a.b=1", "a.c=2", "a.b=3"]) == {"a": {"b": 3, "c": 2}}


@pytest.mark.parametrize("arg", ["data.train_batch_size", "=3", "a..b=1", ".a=1"])
def test_parse_overrides_rejects_malformed_args(arg):
    with pytest.raises(ConfigError, match=r"expected key\.sub=value") as info:
        parse_overrides([arg])
    assert repr(arg) in str(info.value)


def test_override_values_are_typed():
    cfg = load_config(TINY, [
        "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.logger=[console,jsonl]",
        "trainer.val_before_train=false", "data.val_batch_size=null", "actor_rollout_ref.actor.clip_ratio_c=4",
    ])
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.trainer.val_before_train is False
    assert cfg.data.val_batch_size is None
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 4.0 and isinstance(cfg.actor_rollout_ref.actor.clip_ratio_c, float)


# ---- composition -----------------------------------------------------------------------------


def test_composition_order_algo_parallel_recipe_overrides(tmp_path):
    algo = write(tmp_path / "algo.yaml", {
        "actor_rollout_ref": {"actor": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1, "entropy_coeff": 0.5}},
        "trainer": {"total_training_steps": 1},
    })
    parallel = yaml.safe_load(open(os.path.join(CONFIGS_DIR, "parallel", "tiny_cpu.yaml")))
    parallel["actor_rollout_ref"]["actor"]["clip_ratio_high"] = 0.3  # beats algo
    parallel["trainer"]["total_training_steps"] = 2  # beaten by the recipe
    parallel_path = write(tmp_path / "parallel.yaml", parallel)
    recipe = write(tmp_path / "recipe.yaml", {
        "algo": algo, "parallel": parallel_path,
        "data": {"train_files": "builtin:tiny", "train_batch_size": 4},
        "actor_rollout_ref": {"model": {"path": "builtin:tiny"}, "actor": {"ppo_mini_batch_size": 4},
                              "rollout": {"n": 2}},
        "trainer": {"total_training_steps": 3, "save_freq": 3},
    })
    cfg = load_config(recipe, ["trainer.save_freq=5"])
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.entropy_coeff) == (0.1, 0.5)  # algo only
    assert actor.clip_ratio_high == 0.3  # parallel over algo
    assert cfg.trainer.total_training_steps == 3  # recipe over parallel
    assert cfg.trainer.save_freq == 5  # override over recipe
    # Deep merge: the recipe's data keys and the parallel's layout keys all survive.
    assert cfg.data.train_files == ["builtin:tiny"] and cfg.data.train_batch_size == 4
    assert (cfg.layout.train.ep, cfg.layout.rollout.dp, cfg.layout.cluster.world_size) == (2, 2, 2)
    assert cfg.layout.name == "parallel" and cfg.parallel == parallel_path


def test_algo_switch_by_override():
    gspo, grpo = load_config(TINY), load_config(TINY, ["algo=grpo"])
    assert (gspo.algo, gspo.actor_rollout_ref.actor.policy_loss.loss_mode) == ("gspo", "gspo")
    assert (grpo.algo, grpo.actor_rollout_ref.actor.policy_loss.loss_mode) == ("grpo", "vanilla")
    assert (grpo.actor_rollout_ref.actor.clip_ratio_low, grpo.actor_rollout_ref.actor.clip_ratio_high) == (0.2, 0.28)
    assert grpo.actor_rollout_ref.actor.use_kl_loss and not gspo.actor_rollout_ref.actor.use_kl_loss
    # ${algo} in the experiment name keeps the two runs apart.
    assert (gspo.trainer.default_local_dir, grpo.trainer.default_local_dir) == ("runs/moe_rl/tiny_gspo", "runs/moe_rl/tiny_grpo")


def test_parallel_switch_by_override_and_cwd_first(tmp_path, monkeypatch):
    four = yaml.safe_load(open(os.path.join(CONFIGS_DIR, "parallel", "tiny_cpu.yaml")))
    four["trainer"]["n_gpus_per_node"] = 4
    four["actor_rollout_ref"]["actor"]["megatron"]["expert_model_parallel_size"] = 4
    four["actor_rollout_ref"]["rollout"]["data_parallel_size"] = 4
    write(tmp_path / "tiny_cpu.yaml", four)  # shadows the shipped one when named from this directory
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, ["parallel=tiny_cpu.yaml"])
    assert (cfg.layout.cluster.world_size, cfg.layout.train.ep, cfg.layout.rollout.dp) == (4, 4, 4)
    assert cfg.layout.name == "tiny_cpu" and cfg.parallel == "tiny_cpu.yaml"
    shipped_cfg = load_config(TINY, ["parallel=tiny_cpu"])  # no file "tiny_cpu" here: the shipped one
    assert shipped_cfg.layout.cluster.world_size == 2


def test_missing_fragment_lists_the_shipped_ones():
    message = error(TINY, ["parallel=no_such_layout"])
    assert "no_such_layout" in message and "qwen3_30b_a3b_2x16_a3" in message and "tiny_cpu" in message
    message = error(TINY, ["algo=dapo"])
    assert "'dapo'" in message and "shipped: grpo, gspo" in message


def test_missing_recipe_file():
    assert "no_such_recipe" in error("no_such_recipe.yaml", [])


# ---- unknown keys, types, choices ------------------------------------------------------------


@pytest.mark.parametrize("override, key, nearest", [
    ("tranier.seed=1", "tranier", "trainer"),
    ("data.train_batch_szie=4", "data.train_batch_szie", "data.train_batch_size"),
    ("actor_rollout_ref.actor.optim.lr_warmup=4", "actor_rollout_ref.actor.optim.lr_warmup",
     "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    ("actor_rollout_ref.rollout.val_kwargs.temprature=1", "actor_rollout_ref.rollout.val_kwargs.temprature",
     "actor_rollout_ref.rollout.val_kwargs.temperature"),
    ("actor_rollout_ref.actor.megatron.expert_model_paralel_size=2",
     "actor_rollout_ref.actor.megatron.expert_model_paralel_size",
     "actor_rollout_ref.actor.megatron.expert_model_parallel_size"),
    ("actor_rollout_ref.rollout.data_paralel_size=2", "actor_rollout_ref.rollout.data_paralel_size",
     "actor_rollout_ref.rollout.data_parallel_size"),
    ("actor_rollout_ref.actor.megatron.router_replay.mdoe=R2", "actor_rollout_ref.actor.megatron.router_replay.mdoe",
     "actor_rollout_ref.actor.megatron.router_replay.mode"),
])
def test_unknown_keys_name_the_nearest(override, key, nearest):
    message = error(TINY, [override])
    assert f"{key}: unknown key; did you mean {nearest}?" in message


@pytest.mark.parametrize("override, expected", [
    ("data.train_batch_size=eight", "data.train_batch_size='eight': expected an integer"),
    ("data.train_batch_size=-4", "data.train_batch_size=-4: must be >= 1"),
    ("data.train_batch_size=true", "data.train_batch_size=True: expected an integer"),
    ("data.shuffle=yes please", "data.shuffle='yes please': expected true or false"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr='fast': expected a number"),
    ("actor_rollout_ref.model.path=null", "actor_rollout_ref.model.path=null: expected a string"),
    ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p=1.5: must be in (0, 1]"),
    ("trainer.save_freq=0", "trainer.save_freq=0: must be -1 (never) or >= 1"),
    ("data=[1, 2]", "data=[1, 2]: expected a mapping of keys"),
])
def test_type_errors_name_key_value_and_type(override, expected):
    assert expected in error(TINY, [override])


@pytest.mark.parametrize("key, value, valid", [
    ("data.truncation", "middle", "error, left, right"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "ppo", "vanilla"),
    ("actor_rollout_ref.actor.loss_agg_mode", "mean", "seq-mean-token-mean"),
    ("actor_rollout_ref.actor.kl_loss_type", "k4", "low_var_kl"),
    ("actor_rollout_ref.actor.optim.lr_decay_style", "linear", "constant, cosine"),
    ("actor_rollout_ref.rollout.name", "sglang", "auto, vllm, hf"),
    ("trainer.resume_mode", "maybe", "auto, disable, resume_path"),
    ("trainer.logger", "[console, mlflow]", "console, jsonl, tensorboard, swanlab, wandb"),
    ("actor_rollout_ref.model.dtype", "float16", "bfloat16, float32"),
    ("algorithm.adv_estimator", "gae", "grpo"),
    ("actor_rollout_ref.actor.megatron.router_replay.mode", "R1", "disabled, R2, R3"),
])
def test_choice_errors_list_the_choices(key, value, valid):
    message = error(TINY, [f"{key}={value}"])
    assert key in message and "is not a valid choice" in message and valid in message


def test_checks_of_reused_classes_become_config_errors():
    message = error(TINY, ["actor_rollout_ref.actor.optim.lr_decay_style=cosine"])
    assert "actor_rollout_ref.actor.optim" in message and "lr_decay_steps" in message


def test_required_keys():
    with pytest.raises(ConfigError, match="data.train_files is required"):
        config_from_dict({}, "x.yaml")
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path is required"):
        config_from_dict({"data": {"train_files": "builtin:tiny"}}, "x.yaml")


# ---- checks across keys ----------------------------------------------------------------------


def test_batch_arithmetic_errors_name_the_numbers():
    # tiny_cpu: train DP = 2 / (1*1*1) = 2, rollout DP = 2.
    message = error(TINY, ["data.train_batch_size=12"])
    assert "data.train_batch_size (12) must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size (16)" in message
    assert "1, 2, 3, 4, 6, 12" in message
    message = error(TINY, ["data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                           "actor_rollout_ref.rollout.n=1"])
    assert "3 x 1 = 3 rows per optimizer step must split over the training DP" in message and "= 2 ranks" in message
    assert "3 x 1 = 3 responses per generation batch must split over the rollout's data_parallel_size (2)" in message
    message = error(TINY, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"])
    assert "128 / 2 = 64 rows" in message and "ppo_micro_batch_size_per_gpu (5)" in message
    assert "1, 2, 4, 8, 16, 32, 64" in message


def test_router_replay_keys_have_verl_spellings():
    cfg = load_config(TINY, ["actor_rollout_ref.actor.megatron.router_replay.mode=R3",
                             "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])
    assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    assert cfg.layout.train.ep == 2  # the layout keys beside router_replay are still the layout's
    assert config_to_dict(cfg)["actor_rollout_ref"]["actor"]["megatron"]["router_replay"] == {"mode": "R3"}
    message = error(TINY, ["actor_rollout_ref.actor.megatron.router_replay.mode=R3",
                           "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"])
    assert "mode=R3 replays the rollout engine's routing" in message and "enable_rollout_routing_replay=true" in message
    assert "trainer.routing_drift_freq=0: must be -1 (never) or >= 1" in error(TINY, ["trainer.routing_drift_freq=0"])


def test_builtin_tiny_builds_only_tiny_shapes():
    cfg = load_config(TINY, ["actor_rollout_ref.model.config=tiny_qwen3_moe_32e"])
    assert cfg.actor_rollout_ref.model.config == "tiny_qwen3_moe_32e"
    message = error(TINY, ["actor_rollout_ref.model.config=qwen3_30b_a3b"])
    assert "builds a tiny model" in message and "tiny_qwen3_moe" in message


def test_rollout_correction_keys_are_verls():
    cfg = load_config(TINY, ["algorithm.rollout_correction.rollout_is=sequence",
                             "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
                             "algorithm.rollout_correction.rollout_rs=token_k3",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.1"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs, rc.rollout_rs_threshold) == ("sequence", "0.5_2.0", "token_k3", 0.1)
    assert "expected a number or a string" in error(TINY, ["algorithm.rollout_correction.rollout_is_threshold=[1]"])
    assert "bypass_mode=True" in error(TINY, ["algorithm.rollout_correction.bypass_mode=true"])
    message = error(TINY, ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"])
    assert "calculate_log_probs=true" in message


def test_resume_path_needs_a_path_and_the_path_needs_resume_path():
    assert "trainer.resume_from_path" in error(TINY, ["trainer.resume_mode=resume_path"])
    cfg = load_config(TINY, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/step_10"])
    assert cfg.trainer.resume_from_path == "/ckpt/step_10"
    for mode in ("auto", "disable"):  # verl reads the path in resume_path mode only; here that is said, not ignored
        message = error(TINY, [f"trainer.resume_mode={mode}", "trainer.resume_from_path=/ckpt/step_10"])
        assert message.splitlines()[-1] == (
            f"  - trainer.resume_from_path is read only with trainer.resume_mode=resume_path (as in verl), not {mode}: "
            "add trainer.resume_mode=resume_path, or drop resume_from_path")


def test_sigterm_grace_period_is_seconds_from_zero():
    assert load_config(TINY).trainer.save_on_sigterm_grace_s == 0  # off
    assert load_config(TINY, ["trainer.save_on_sigterm_grace_s=90"]).trainer.save_on_sigterm_grace_s == 90
    assert "trainer.save_on_sigterm_grace_s=-1.0: must be >= 0" in error(TINY, ["trainer.save_on_sigterm_grace_s=-1"])


def test_rollout_engine_follows_the_device():
    assert load_config(TINY).actor_rollout_ref.rollout.name == "hf"
    message = error(TINY, ["actor_rollout_ref.rollout.name=vllm"])
    assert "rollout.name='vllm'" in message and "trainer.device='cpu'" in message and "'hf'" in message


@pytest.mark.parametrize("installed", [True, False])
def test_auto_takes_vllm_where_installed_else_transformers(monkeypatch, installed):
    """``auto`` on an accelerator: vLLM where its packages import, the transformers engine otherwise;
    the start-up note says which and why. An explicit name is kept as given."""
    from recipe import rollout

    present = "json" if installed else "no_such_package_here"
    monkeypatch.setitem(rollout.ENGINES, "vllm", dataclasses.replace(
        rollout.ENGINES["vllm"], requires={"cuda": (present,), "npu": (present, "json")}))
    for device in ("cuda", "npu"):
        auto = ["actor_rollout_ref.rollout.name=auto"]  # the 30B recipes name vLLM
        cfg = load_config(BIG, auto + (["trainer.device=cuda", "trainer.npu_kind=null"] if device == "cuda" else []))
        assert cfg.actor_rollout_ref.rollout.name == ("vllm" if installed else "hf"), device
        note = next(n for n in cfg.notes if n.startswith("rollout engine: "))
        assert ("needs no_such_package_here, not installed" in note) is not installed, note
    assert load_config(BIG, ["actor_rollout_ref.rollout.name=hf"]).actor_rollout_ref.rollout.name == "hf"
    assert load_config(BIG).actor_rollout_ref.rollout.name == "vllm"  # named: no fallback for a 30B model


ONE_GPU = ["trainer.device=cuda", "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1"]


def test_the_transformers_engine_keeps_its_weights_where_both_fit():
    """The tiny job on one GPU: training peak (72.2 MiB, planned for one micro-batch of the rank's 128
    rows: dynamic batch size) + engine (14.4 MiB) fit 4 GB, so the engine stays; in 0.08 GiB (81.9 MiB)
    training alone fits, both do not, so it moves to the host each step."""
    def engine(cfg):
        return cfg.actor_rollout_ref.rollout.free_cache_engine, [n for n in cfg.notes if "free_cache_engine" in n]

    keep, notes = engine(load_config(TINY, ONE_GPU))
    assert keep is False and "keeps its weights on the device" in notes[0] and "fit trainer.device_memory_gb=4" in notes[0]
    free, notes = engine(load_config(TINY, [*ONE_GPU, "trainer.device_memory_gb=0.08"]))
    assert free is True and "moves its weights to the host" in notes[0] and "exceed" in notes[0]
    assert engine(load_config(TINY, [*ONE_GPU, "actor_rollout_ref.rollout.free_cache_engine=true"])) == (True, [])
    assert engine(load_config(TINY)) == (True, [])  # the CPU engine: nothing to move, verl's default
    assert "free_cache_engine=false with rollout.name=vllm" in error(BIG, ["actor_rollout_ref.rollout.name=vllm",
                                                                          "actor_rollout_ref.rollout.free_cache_engine=false"])


def test_overlong_buffer_must_fit_in_the_response():
    message = error(TINY, ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=16"])
    assert "reward_model.overlong_buffer.len (16)" in message and "max_response_length (16)" in message


def test_invalid_layout_lists_the_planner_rules():
    message = error(BIG, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8"])
    assert "[train.tp_divides_num_query_groups] tensor_model_parallel_size=8: num_query_groups (4)" in message
    assert "valid TP for this model: 1, 2, 4" in message
    # Several rules at once: every one is listed.
    message = error(BIG, ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=3",
                          "actor_rollout_ref.rollout.data_parallel_size=4"])
    assert message.count("\n  - ") >= 2
    assert "[rollout.tp_dp_equals_world]" in message


def test_sequence_longer_than_the_model():
    message = error(TINY, ["data.max_response_length=1000"])
    assert "= 1032 exceeds the model's max_position_embeddings (1024)" in message


def test_model_shape_from_the_checkpoint_dir(tmp_path):
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    message = error(BIG, ["actor_rollout_ref.model.config=null", f"actor_rollout_ref.model.path={tmp_path}/nowhere"])
    assert f"{tmp_path}/nowhere" in message and "model.config" in message
    # A local dir is read for its config.json (here: the 30B shape, a tiny one would break EP16).
    shape = yaml.safe_load(open(os.path.join(CONFIGS_DIR, "model", "qwen3_30b_a3b.yaml")))
    (model_dir / "config.json").write_text(json.dumps(shape))
    cfg = load_config(BIG, ["actor_rollout_ref.model.config=null", f"actor_rollout_ref.model.path={model_dir}"])
    assert cfg.actor_rollout_ref.model.path == str(model_dir)
    shape["num_experts"] = 8
    (model_dir / "config.json").write_text(json.dumps(shape))
    assert "expert" in error(BIG, ["actor_rollout_ref.model.config=null", f"actor_rollout_ref.model.path={model_dir}"])


def test_interpolation_errors():
    assert "${nope.key} names no config key" in error(TINY, ["trainer.experiment_name=${nope.key}"])
    message = error(TINY, ["trainer.experiment_name=${trainer.project_name}",
                           "trainer.project_name=${trainer.experiment_name}"])
    assert "refers back to itself" in message


# ---- shipped recipes and the round trip ------------------------------------------------------


@pytest.mark.parametrize("name", shipped("recipe"))
def test_every_shipped_recipe_loads_and_round_trips(name, tmp_path):
    cfg = load_config(name)
    assert isinstance(cfg, RecipeConfig) and isinstance(cfg.actor_rollout_ref.actor.optim, OptimConfig)
    data = config_to_dict(cfg)
    assert config_from_dict(data, name) == cfg
    # The dump the trainer writes to the run dir loads back to the same config.
    dump = tmp_path / "config.yaml"
    dump.write_text(yaml.safe_dump(data))
    assert load_config(str(dump)) == cfg


def test_shipped_recipes_are_the_four_twins_and_the_presets():
    presets = ["tiny_stability", "tiny_stability_offpolicy", "tiny_stability_gap", "tiny_long"]
    assert sorted(shipped("recipe")) == sorted([n for pair in TWINS for n in pair] + presets)
    assert sorted(shipped("algo")) == ["grpo", "gspo"]


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    """By name or by their path in the repository, wherever the command runs (an installed copy has
    no configs/ in the current directory); a file there is read first."""
    monkeypatch.chdir(tmp_path)
    shipped_file = os.path.join(CONFIGS_DIR, "recipe", "tiny_gspo.yaml")
    assert resolve_path("recipe", "tiny_gspo") == resolve_path("recipe", "configs/recipe/tiny_gspo.yaml") == shipped_file
    by_path = load_config("configs/recipe/tiny_gspo.yaml", ["parallel=configs/parallel/tiny_cpu.yaml"])
    assert dataclasses.replace(by_path, parallel="tiny_cpu") == load_config(TINY)
    mine = tmp_path / "configs" / "recipe" / "tiny_gspo.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text(open(shipped_file).read().replace("total_training_steps: 50", "total_training_steps: 7"))
    assert load_config("configs/recipe/tiny_gspo.yaml").trainer.total_training_steps == 7
    with pytest.raises(ConfigError, match="recipe 'tiny_gpso': no such file or shipped recipe; shipped: .*tiny_gspo"):
        resolve_path("recipe", "tiny_gpso")


@pytest.mark.parametrize("gspo, grpo", TWINS)
def test_twins_differ_only_in_algo(gspo, grpo):
    def without_algo(name):
        data = yaml.safe_load(open(os.path.join(CONFIGS_DIR, "recipe", f"{name}.yaml")))
        return data.pop("algo"), data

    (algo_a, a), (algo_b, b) = without_algo(gspo), without_algo(grpo)
    assert (algo_a, algo_b) == ("gspo", "grpo") and a == b


def test_qwen3_30b_recipe_numbers():
    cfg = load_config(BIG)
    d, arr = cfg.data, cfg.actor_rollout_ref
    assert (d.max_prompt_length, d.max_response_length, d.train_batch_size) == (2048, 8192, 256)
    assert (arr.rollout.n, arr.actor.ppo_mini_batch_size, arr.actor.optim.lr) == (16, 32, 1e-6)
    assert cfg.reward_model.overlong_buffer == dataclasses.replace(cfg.reward_model.overlong_buffer, enable=True, len=4096)
    assert (cfg.layout.name, cfg.layout.cluster.world_size, arr.model.dtype) == ("qwen3_30b_a3b_2x16_a3", 32, "bfloat16")
    assert arr.actor.loss_agg_mode == "seq-mean-token-mean" and arr.actor.clip_ratio_high == 4e-4
    assert cfg.trainer.default_local_dir == "runs/moe_rl/qwen3_30b_a3b_gspo"


def test_default_local_dir_substitutes_the_names():
    cfg = load_config(TINY, ["trainer.project_name=p", "trainer.experiment_name=e"])
    assert cfg.trainer.default_local_dir == "runs/p/e"
    cfg = load_config(TINY, ["trainer.default_local_dir=/scratch/${trainer.experiment_name}/ckpt"])
    assert cfg.trainer.default_local_dir == "/scratch/tiny_gspo/ckpt"


def test_hybrid_engine_with_the_trainers_pool_spelt_out_stays_colocated():
    """verl's recipes spell the rollout pool out as the trainer's: with hybrid_engine=true that is the
    training devices, one pool, not a second pool of the same size."""
    from recipe.workers.group import pools
    from recipe.workers.rank import Roles

    spelt = load_config(TINY, ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2"])
    plain = load_config(TINY)
    assert spelt.actor_rollout_ref.hybrid_engine and not spelt.layout.separate_rollout
    assert spelt.layout == plain.layout and spelt.layout.rollout_world_size == 2
    training, rollout = pools(spelt.layout)
    assert training.roles == Roles.BOTH and rollout is None
    # hybrid_engine=false with the same numbers: a pool of its own, as large as the training one
    split = load_config(TINY, ["actor_rollout_ref.hybrid_engine=false", "async_training.mode=one_step_off",
                               "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2"])
    assert split.layout.separate_rollout and pools(split.layout)[1].size == 2


def test_the_documented_one_gpu_commands_load():
    """The one-GPU commands of the README and docs/recipe.md, as written there, give a valid config on
    one CUDA device with the transformers engine (vLLM is not installed here), and one micro-batch
    a pass (dynamic batch size: a GPU pays a launch per operation of every micro-batch)."""
    import re
    import shlex

    commands = []
    for doc in ("README.md", "docs/recipe.md"):
        text = open(os.path.join(os.path.dirname(CONFIGS_DIR), doc)).read().replace("\\\n", " ")
        commands += [c for c in re.findall(r"python -m recipe\.main\w* (--config [^\n`]+)", text) if "trainer.device=cuda" in c]
    assert len(commands) == 3, commands  # README's, and docs/recipe.md's main job and long-response task
    for command in commands:
        _, config, *overrides = shlex.split(command)
        cfg = load_config(config, overrides)
        assert (cfg.layout.cluster.device, cfg.layout.cluster.world_size, cfg.actor_rollout_ref.rollout.name) == ("cuda", 1, "hf")
        arr = cfg.actor_rollout_ref
        widest = cfg.data.train_batch_size * arr.rollout.n * (cfg.data.max_prompt_length + cfg.data.max_response_length)
        assert arr.actor.use_dynamic_bsz and arr.rollout.log_prob_use_dynamic_bsz, command
        assert widest <= min(arr.actor.ppo_max_token_len_per_gpu, arr.rollout.log_prob_max_token_len_per_gpu), command


def test_npu_context_parallel_with_packing_is_refused_at_load():
    cp2 = "actor_rollout_ref.actor.megatron.context_parallel_size=2"
    with pytest.raises(ConfigError, match="context_parallel_size=2 with packed micro-batches has not run on an NPU.*"
                                          "use_remove_padding=false"):
        load_config(BIG, [cp2])
    cfg = load_config(BIG, [cp2, "actor_rollout_ref.model.use_remove_padding=false"])
    assert cfg.layout.train.cp == 2 and cfg.layout.train.seq_multiple == 4  # lcm(2 x CP, CP x TP) = lcm(4, 4) with SP
