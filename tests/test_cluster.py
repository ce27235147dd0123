"""recipe.cluster (what the launchers ask Python for) and the worker group's node choice, without Ray."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.mc2 import Mc2Plan
from megatron_bridge.plan.layout import load_layout
from recipe.cluster import check_rollout_pool_inputs, describe_pools, join_report, launcher_overrides, main, runtime_env
from recipe.config import load_config
from recipe.workers.group import ClusterError, pick_nodes

REPO = Path(__file__).resolve().parents[1]
MC2 = REPO / "configs/runtime_env/mc2.yaml"
PLAN = Mc2Plan(True, "mc2", "A2 with EP=16", 64, 300, 320)
NO_MC2 = Mc2Plan(False, "n/a", "not an NPU cluster", 32, 0, 200)


def inputs(**given) -> argparse.Namespace:
    keys = ("nnodes", "devices_per_node", "parallel", "model_path", "train_file", "val_file", "ckpt_dir",
            "rollout_nnodes", "rollout_devices_per_node")
    return argparse.Namespace(**{k: given.get(k, "") for k in keys}, overrides=given.get("overrides", []))


def test_launcher_inputs_become_overrides_the_recipe_accepts(tmp_path):
    (tmp_path / "a b.parquet").touch()
    args = inputs(nnodes="2", devices_per_node="8", parallel="qwen3_30b_a3b_2x8_a2", model_path="rel/model",
                  train_file=f"{tmp_path}/a b.parquet,builtin:tiny", ckpt_dir="runs/x")
    out = launcher_overrides(args)
    assert out[:3] == ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", 'parallel="qwen3_30b_a3b_2x8_a2"']
    cfg = load_config("qwen3_30b_a3b_gspo", out)
    assert cfg.layout.cluster.nnodes == 2 and cfg.layout.cluster.devices_per_node == 8
    assert cfg.layout.name == "qwen3_30b_a3b_2x8_a2"
    assert cfg.actor_rollout_ref.model.path == str(Path("rel/model").resolve())  # absolute for the job
    assert cfg.data.train_files == [f"{tmp_path}/a b.parquet", "builtin:tiny"]  # spaces survive, builtin kept
    assert cfg.trainer.default_local_dir == str(Path("runs/x").resolve())
    assert launcher_overrides(inputs()) == []  # nothing given: the recipe's own values


def test_rollout_pool_inputs_become_the_split_overrides():
    args = inputs(rollout_nnodes="2", rollout_devices_per_node="8")
    split = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=2",
             "actor_rollout_ref.rollout.n_gpus_per_node=8"]
    assert launcher_overrides(args) == split + ["async_training.mode=one_step_off"]
    # the user's overrides choose the mode: the launcher adds none (theirs come after its own)
    chosen = inputs(rollout_nnodes="2", rollout_devices_per_node="8", overrides=["async_training.mode=sync"])
    assert launcher_overrides(chosen) == split
    cfg = load_config("tiny_gspo", launcher_overrides(inputs(rollout_nnodes="1", rollout_devices_per_node="2")))
    assert cfg.layout.separate_rollout and cfg.async_training.mode == "one_step_off"
    assert (cfg.layout.rollout.nnodes, cfg.layout.rollout.devices_per_node) == (1, 2)


def test_rollout_pool_inputs_refused_with_a_recipe_that_keeps_the_rollout_colocated(tmp_path):
    recipe = tmp_path / "colocated.yaml"
    recipe.write_text(yaml.safe_dump({"actor_rollout_ref": {"hybrid_engine": True}}))
    with pytest.raises(ConfigError, match=r"ROLLOUT_NNODES=1 / ROLLOUT_NPUS_PER_NODE=2 give the rollout nodes of its "
                                          r"own, but the recipe .*colocated.yaml or an override sets "
                                          r"actor_rollout_ref.hybrid_engine=true .*: unset ROLLOUT_NNODES"):
        check_rollout_pool_inputs(str(recipe), inputs(rollout_nnodes="1", rollout_devices_per_node="2"))
    overridden = inputs(rollout_nnodes="1", rollout_devices_per_node="2", overrides=["actor_rollout_ref.hybrid_engine=false"])
    check_rollout_pool_inputs(str(recipe), overridden)  # the override has the last word
    check_rollout_pool_inputs(str(recipe), inputs())  # no rollout pool asked for: nothing to contradict
    with pytest.raises(ConfigError, match="or an override sets actor_rollout_ref.hybrid_engine=true"):
        check_rollout_pool_inputs(str(REPO / "configs/recipe/tiny_gspo.yaml"),
                                  inputs(rollout_nnodes="1", rollout_devices_per_node="2",
                                         overrides=["actor_rollout_ref.hybrid_engine=true"]))


def test_the_split_names_which_nodes_train_and_which_generate():
    layout = load_layout("qwen3_30b_a3b_2x16_a3").with_rollout_pool(2, 16)
    cfg = SimpleNamespace(layout=layout, async_training=SimpleNamespace(mode="one_step_off"))
    head = "10.0.0.9"
    lines = describe_pools(cfg, head, "10.0.0.3,10.0.0.10,10.0.0.2,10.0.0.9")
    assert lines == ["pools (actor_rollout_ref.hybrid_engine=false, async_training.mode=one_step_off): 4 node(s)",
                     "  training: 2 x 16 npu on 10.0.0.9, 10.0.0.10",  # the head, then by address (as text)
                     "  rollout:  2 x 16 npu on 10.0.0.2, 10.0.0.3"]
    unnamed = describe_pools(cfg, head, "")
    assert unnamed[1] == ("  training: 2 x 16 npu, the head first; rollout: 2 x 16 npu on 2 other node(s) "
                          "(set NODE_IPS=ip1,ip2,... to have them named)")
    colocated = SimpleNamespace(layout=load_layout("qwen3_30b_a3b_2x16_a3"), async_training=cfg.async_training)
    assert describe_pools(colocated, head, "10.0.0.3") == []


def test_runtime_env_takes_the_planners_buffer_unless_the_user_sets_one(tmp_path):
    env, notes = runtime_env(str(MC2), PLAN, None)
    assert env["env_vars"]["HCCL_BUFFSIZE"] == "320" and "planner" in notes[0]
    assert env["env_vars"]["VLLM_ASCEND_ENABLE_NZ"] == "0"
    env, notes = runtime_env(str(MC2), PLAN, "640")
    assert env["env_vars"]["HCCL_BUFFSIZE"] == "640" and "yours" in notes[0]
    env, notes = runtime_env(str(MC2), PLAN, "256")
    assert env["env_vars"]["HCCL_BUFFSIZE"] == "256" and "below the 300 MB" in notes[0]
    env, notes = runtime_env(str(REPO / "configs/runtime_env/base.yaml"), NO_MC2, None)
    assert "HCCL_BUFFSIZE" not in env["env_vars"] and notes == []
    # A value in the template counts as the user's.
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({"env_vars": {"HCCL_BUFFSIZE": 512, "X": 1}, "pip": ["foo"]}))
    env, _ = runtime_env(str(own), PLAN, None)
    assert env == {"env_vars": {"HCCL_BUFFSIZE": "512", "X": "1"}, "pip": ["foo"]}


def test_runtime_env_errors_name_the_input(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("env_vars: [a, b]\n")
    with pytest.raises(ConfigError, match="bad.yaml: expected a mapping with an env_vars mapping"):
        runtime_env(str(bad), PLAN, None)
    with pytest.raises(ConfigError, match="HCCL_BUFFSIZE='lots'"):
        runtime_env(str(MC2), PLAN, "lots")


def node(ip: str, npu: int = 0, head: bool = False, alive: bool = True) -> dict:
    resources = {"CPU": 4.0, f"node:{ip}": 1.0, **({"NPU": float(npu)} if npu else {})}
    if head:
        resources["node:__internal_head__"] = 1.0
    return {"NodeManagerAddress": ip, "Alive": alive, "Resources": resources}


def test_pick_nodes_takes_whole_nodes_head_first():
    nodes = [node("10.0.0.3", 16), node("10.0.0.2", 8), node("10.0.0.9", 16, head=True), node("10.0.0.1", 16, alive=False)]
    picked = pick_nodes(nodes, 2, 16, "NPU")
    assert [n["NodeManagerAddress"] for n in picked] == ["10.0.0.9", "10.0.0.3"]
    with pytest.raises(ClusterError, match=r"has 2 such node\(s\).*10.0.0.2 \(8 NPU\)"):
        pick_nodes(nodes, 3, 16, "NPU")
    assert len(pick_nodes([node("a"), node("b", head=True)], 2, 1, None)) == 2  # CPU: any alive node


def test_the_rollout_pool_takes_nodes_the_training_pool_does_not_hold():
    nodes = [node("10.0.0.4", 16), node("10.0.0.3", 16), node("10.0.0.2", 16), node("10.0.0.9", 16, head=True)]
    training = pick_nodes(nodes, 2, 16, "NPU")
    held = [n["NodeManagerAddress"] for n in training]
    rollout = pick_nodes(nodes, 2, 16, "NPU", taken=held)
    assert held == ["10.0.0.9", "10.0.0.2"] and [n["NodeManagerAddress"] for n in rollout] == ["10.0.0.3", "10.0.0.4"]
    with pytest.raises(ClusterError, match=r"needs 3 node\(s\) with 16 NPU each besides the 2 node\(s\) of the other "
                                           r"pool \(10.0.0.2, 10.0.0.9\); the Ray cluster has 2 such node\(s\)"):
        pick_nodes(nodes, 3, 16, "NPU", taken=held)
    # CPU ranks are processes on a node's cores: both pools share the one machine
    cpu = [node("10.0.0.1", head=True)]
    assert pick_nodes(cpu, 1, 2, None, taken=["10.0.0.1"]) == cpu


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"], ids=lambda d: f"on_{d}")  # not the npu marker
def test_ray_accepts_the_rank_options_of_every_device(device):
    # Ray refuses "GPU" in an actor's resources (num_gpus only): a CUDA run never started its workers
    import ray

    from recipe.workers.group import DEVICE_RESOURCE, device_options
    from recipe.workers.rank import Rank

    options = device_options(device)
    ray.remote(Rank).options(num_cpus=1, **options)  # raises ValueError on options Ray refuses
    resource = DEVICE_RESOURCE[device]
    asked = {"GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    assert asked.get(resource, 0) == (1 if resource else 0) and sum(asked.values()) == (1 if resource else 0)


def test_nodes_needed_adds_the_rollout_pools_nodes_on_devices_only():
    from dataclasses import replace

    from megatron_bridge.plan.layout import load_layout
    from recipe.workers.group import nodes_needed

    layout = load_layout("qwen3_30b_a3b_2x16_a3")
    assert nodes_needed(layout) == 2
    assert nodes_needed(layout.with_rollout_pool(3, 16)) == 5
    cpu = replace(layout, cluster=replace(layout.cluster, device="cpu", npu_kind=None))
    assert nodes_needed(cpu.with_rollout_pool(1, 2)) == 2 and nodes_needed(cpu.with_rollout_pool(3, 2)) == 3


def test_join_report_names_joined_and_missing_nodes():
    joined = [SimpleNamespace(node_ip="10.0.0.1", resources_total={"NPU": 16.0})]
    text = join_report(joined, 3, ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "NPU", 16, "10.0.0.1:6379", 30)
    assert "only 1 of 3 nodes joined" in text and "joined: 10.0.0.1, 16 NPU" in text
    assert "missing: 10.0.0.2, 10.0.0.3" in text
    assert "missing: 2 node(s) (set NODE_IPS" in join_report(joined, 3, [], "NPU", 16, "h:1", 30)
    short = joined + [SimpleNamespace(node_ip="10.0.0.2", resources_total={"NPU": 8.0})]
    assert "10.0.0.2 offer fewer than the 16 NPU" in join_report(short, 2, [], "NPU", 16, "h:1", 30)
    assert join_report(joined, 1, [], "NPU", 16, "h:1", 30) is None


def test_prepare_writes_the_jobs_inputs_and_fails_cleanly(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["prepare", "--recipe", "qwen3_30b_a3b_grpo", "--algo", "grpo", "--out-dir", str(out), "--dry-run",
               "--parallel", "qwen3_30b_a3b_4x8_a2", "--", "trainer.total_training_steps=7"])
    assert rc == 0
    env = dict(line.split("=", 1) for line in (out / "cluster.env").read_text().splitlines())
    assert env["NNODES"] == "4" and env["NPUS_PER_NODE"] == "8" and env["DEVICE_RESOURCE"] == "NPU"
    assert (env["ALL_NODES"], env["NODE_DEVICES"], env["ROLLOUT_NNODES"], env["ROLLOUT_NPUS_PER_NODE"]) == ("4", "8", "''", "''")
    assert env["HCCL_BUFFSIZE_MB"] == "320"  # the 4 x 8 A2 layout: MC2 needs 304 MB, rounded up to 32
    args = (out / "job_args").read_text().splitlines()
    assert args[:2] == ["--config", str(REPO / "configs/recipe/qwen3_30b_a3b_grpo.yaml")]
    assert args[-1] == "trainer.total_training_steps=7"
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["total_training_steps"] == 7
    # A real run (not --dry-run) refuses inputs that are not on this node, before writing anything.
    rc = main(["prepare", "--recipe", "qwen3_30b_a3b_grpo", "--out-dir", str(tmp_path / "real")])
    assert rc == 1 and not (tmp_path / "real").exists()
    assert "data.train_files='/data/dapo-math-17k.parquet' does not exist on this node" in capsys.readouterr().err
    rc = main(["prepare", "--recipe", "tiny_gspo", "--out-dir", str(tmp_path / "x"), "--", "trainer.nnodes=3"])
    assert rc == 2 and "invalid config" in capsys.readouterr().err


def test_wait_nodes_follows_the_joins_and_survives_a_slow_dashboard(monkeypatch, capsys):
    import recipe.cluster as cluster

    a = SimpleNamespace(node_ip="10.0.0.1", resources_total={"NPU": 8.0})
    b = SimpleNamespace(node_ip="10.0.0.2", resources_total={"NPU": 8.0})
    answers = iter([ConnectionError("starting"), [a], [a], [a, b]])

    def alive(_):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(cluster, "alive_nodes", alive)
    args = ["wait-nodes", "--dashboard", "http://h:8265", "--address", "h:6379", "--expect", "2", "--timeout", "30",
            "--resource", "NPU", "--per-node", "8", "--poll", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nodes joined: 1/2 (10.0.0.1)" in out and "all 2 node(s) joined: 10.0.0.1, 8 NPU, 10.0.0.2, 8 NPU" in out
    monkeypatch.setattr(cluster, "alive_nodes", lambda _: (_ for _ in ()).throw(ConnectionError("refused")))
    assert main(args[:8] + ["0"] + args[9:]) == 1
    assert "the Ray dashboard at http://h:8265 did not answer within 0 s: refused" in capsys.readouterr().err


def test_a_local_ray_that_times_out_starting_is_ended_and_started_once_more(monkeypatch, capsys):
    """Ray's raylet has a fixed 30 s to register; on a busy machine that passes and Ray raises with
    its processes still running. They are ended, and the second start is a real Ray."""
    import subprocess

    import ray

    from recipe.workers import group

    real_init, calls, left = ray.init, [], []

    def init_once_too_slow(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # what a timed-out start leaves: a process of ours, and Ray's message
            left.append(subprocess.Popen(["sleep", "600"]))
            raise Exception("The current node timed out during startup. This could happen because some of "
                            "the raylet failed to startup or the GCS has become overloaded.")
        return real_init(**kwargs)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", init_once_too_slow)
    try:
        assert group.init_ray("cpu", 2) is True
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] >= 2
    finally:
        ray.shutdown()
    assert len(calls) == 2 and calls[0] == calls[1]
    assert left[0].wait(timeout=10) == -9  # killed, not left running
    assert "local Ray did not come up within 120 s (a busy machine?): starting it once more" in capsys.readouterr().err


def test_a_slow_raylet_registration_is_waited_for_past_rays_30_s(monkeypatch):
    """Within a local start, Ray's lookup of the new node waits for it (a raylet registers late on a
    busy machine) rather than raising at once into Ray's fixed 30 s loop; past its own time it raises
    Ray's error as before, and Ray's function is back in place afterwards."""
    import ray

    from recipe.workers import group

    services = ray._private.services
    asked = []

    def registers_on_the_fourth_ask(gcs_address, node_id):
        asked.append((gcs_address, node_id))
        if len(asked) < 4:
            raise RuntimeError(f"node {node_id} not found")
        return {"node_id": node_id}

    monkeypatch.setattr(services, "get_node", registers_on_the_fourth_ask)
    with group.patient_node_lookup(seconds=30):
        assert services.get_node("gcs:1", "abc") == {"node_id": "abc"}
    assert asked == [("gcs:1", "abc")] * 4
    assert services.get_node is registers_on_the_fourth_ask

    def never(gcs_address, node_id):
        raise RuntimeError("node abc not found")

    monkeypatch.setattr(services, "get_node", never)
    with group.patient_node_lookup(seconds=0.5):
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="not found"):
            services.get_node("gcs:1", "abc")
        assert 0.5 <= time.monotonic() - began < 5


def test_other_local_ray_start_errors_are_not_retried(monkeypatch):
    import ray

    from recipe.workers import group

    calls = []

    def init_fails(**kwargs):
        calls.append(kwargs)
        raise ValueError("bad option")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", init_fails)
    with pytest.raises(ValueError, match="bad option"):
        group.init_ray("cpu", 1)
    assert len(calls) == 1


@pytest.mark.parametrize("head, node_ips, says", [
    ("127.0.0.1", "10.0.0.1,10.0.0.2", "does not list the head 127.0.0.1 (MASTER_ADDR, resolved): set MASTER_ADDR"),
    ("10.0.0.1", "10.0.0.1,10.0.0.2,10.0.0.3", "lists 3 address(es) but the run takes 2 node(s)"),
    ("10.0.0.1", "10.0.0.1", "lists 1 address(es) but the run takes 2 node(s)"),
    ("10.0.0.1", "10.0.0.1,10.0.0.1", "an address is listed twice"),
], ids=["no_master_addr", "too_many", "too_few", "twice"])
def test_node_addresses_that_disagree_are_refused_in_a_dry_run(tmp_path, capsys, head, node_ips, says):
    args = ["prepare", "--recipe", "qwen3_30b_a3b_grpo", "--out-dir", str(tmp_path / "out"), "--dry-run",
            "--parallel", "qwen3_30b_a3b_4x8_a2", "--nnodes", "2", "--devices-per-node", "16", "--head-ip", head]
    assert main(args + ["--node-ips", node_ips]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(args + ["--node-ips", "10.0.0.2,10.0.0.1"] if head == "10.0.0.1" else args) == 0


def test_a_local_rays_auth_token_is_its_owners_alone(tmp_path, monkeypatch):
    """Ray turns token auth on for a local Ray and would write a new token readable by everyone: the
    driver writes it first (0600), makes an existing one 0600, and leaves it alone when token auth is
    off or the token comes from the environment. A real local Ray then starts with that token."""
    from recipe.workers import group

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    # a process of its own: Ray's token loader keeps the first token a process read
    start = "import ray; from recipe.workers.group import init_ray; assert init_ray('cpu', 1); ray.shutdown()"
    out = subprocess.run([sys.executable, "-c", start], cwd=Path(__file__).parents[1], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert oct(token.stat().st_mode & 0o777) == "0o600" and len(token.read_text()) == 64
    assert [p.name for p in token.parent.iterdir()] == ["auth_token"]  # written whole, nothing left beside
    first = token.read_text()
    int(first, 16)  # hex, as Ray's generator makes it

    token.chmod(0o644)
    group.private_auth_token()
    assert oct(token.stat().st_mode & 0o777) == "0o600" and token.read_text() == first

    token.unlink()
    for env in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN": "given"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            group.private_auth_token()
        assert not token.exists()
