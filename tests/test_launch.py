"""The shell launchers (launch/*.sh) for real: shellcheck, dry runs, validation before Ray starts, a
local Ray head running the tiny recipe through `ray job submit`, a missing node, Ctrl-C, and two
hosts in network namespaces joined into one cluster."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from recipe.tracking.loggers import read_jsonl
from tests.distributed import free_port
from tests.test_recipe_e2e import stable

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sh"))
GSPO_30B = "launch/qwen3_30b_a3b_gspo.sh"
TINY = "launch/tiny_gspo.sh"
# Short runs: 2 RL steps, no validation.
TINY_ARGS = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
RAY_DAEMONS = {"raylet", "gcs_server"}


def launcher_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "NNODES", "MASTER_ADDR", "PARALLEL")}
    env.update(LOG_DIR=str(tmp_path / "logs"), CKPT_DIR=str(tmp_path / "run"), RAY_PORT=str(free_port()),
               DASHBOARD_PORT=str(free_port()), RAY_AUTH_TOKEN=secrets.token_hex(32), **extra)
    return env


def launch(script: str, tmp_path: Path, args=(), timeout: int = 300, env: dict | None = None,
           **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", script, *args], cwd=REPO, env=env or launcher_env(tmp_path, **extra),
                          capture_output=True, text=True, timeout=timeout)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def ray_daemons() -> set[int]:
    """Ray's processes on this machine (read from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        cmd = _cmdline(int(entry.name))
        if name in RAY_DAEMONS or "ray start" in cmd or "ray/_private/workers" in cmd:
            out.add(int(entry.name))
    return out


def assert_no_new_ray(before: set[int], grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    while (left := ray_daemons() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left behind: {[_cmdline(p) for p in left]}"


def local_address() -> str | None:
    """This machine's first non-loopback IPv4 address (the head's MASTER_ADDR for NNODES=2)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    ips = [line.split()[3].split("/")[0] for line in out.splitlines()]
    return next((ip for ip in ips if not ip.startswith("127.")), None)


# --- static ---------------------------------------------------------------------------------------


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        if os.environ.get("MOE_RL_CI"):
            pytest.fail("shellcheck is not installed; .ci/run installs it from the OS packages")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", "-x", *LAUNCHERS], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_launchers_never_kill_by_pattern():
    for script in LAUNCHERS:
        text = (REPO / script).read_text()
        for word in ("pkill", "killall", "ray stop"):
            assert word not in text.replace("`ray stop`", ""), f"{script} uses {word}"


def test_runtime_env_agrees_with_the_rollout_engine():
    """mc2.yaml sets nothing removed and agrees with what the vLLM engine sets for itself on NPU."""
    from recipe.rollout.vllm_setup import rollout_env

    env = yaml.safe_load((REPO / "configs/runtime_env/mc2.yaml").read_text())["env_vars"]
    assert "VLLM_ENABLE_MC2" not in env and "HCCL_BUFFSIZE" not in env  # removed / computed per layout
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0" and env["TASK_QUEUE_ENABLE"] in ("1", "2")
    for name, value in rollout_env("npu").items():
        if name in env:
            assert env[name] == value, name
    assert all(isinstance(v, str) for v in env.values())


# --- dry runs and validation: nothing starts --------------------------------------------------------


def test_dry_run_prints_layout_memory_env_and_each_nodes_commands(tmp_path):
    before = ray_daemons()
    out = launch(GSPO_30B, tmp_path, ["--dry-run", "trainer.total_training_steps=5"], timeout=120, MASTER_ADDR="127.0.0.1",
                 NODE_ROLE="head")
    # The 30B recipe is a 2-node layout: MASTER_ADDR on loopback is refused even in a dry run.
    assert out.returncode == 2 and "loopback" in out.stderr
    ip = local_address()
    if ip is None:
        pytest.skip("no non-loopback address on this machine")
    out = launch(GSPO_30B, tmp_path, ["--dry-run", "trainer.total_training_steps=5"], timeout=120, MASTER_ADDR=ip)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "layout qwen3_30b_a3b_2x16_a3: train TP2 PP2 EP16" in text
    assert "training peak" in text and "VALID" in text
    assert "HCCL_BUFFSIZE: '608'" in text  # the planner's value for this layout, in the job's runtime env
    assert "VLLM_ASCEND_ENABLE_NZ: '0'" in text
    assert "ray start --head --block" in text and '{"NPU": 16}' in text.replace("\\", "")
    assert f"ray start --address {ip}:" in text  # what each worker node runs
    assert "ray job submit" in text and "recipe.main_gspo" in text and "trainer.total_training_steps=5" in text
    assert "does not exist on this node" in out.stderr  # placeholder paths: warned, not fatal, in a dry run
    assert not (tmp_path / "logs").exists()
    assert_no_new_ray(before, grace_s=0)


def test_parallel_swap_takes_the_layouts_cluster_and_user_buffsize(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    out = launch("launch/qwen3_30b_a3b_grpo.sh", tmp_path, ["--dry-run"], timeout=120, MASTER_ADDR=ip,
                 PARALLEL="qwen3_30b_a3b_2x8_a2", HCCL_BUFFSIZE="100")
    assert out.returncode == 0, out.stderr
    assert "cluster: 2 node(s) x 8 npu" in out.stdout and "recipe.main_grpo" in out.stdout
    assert "HCCL_BUFFSIZE: '100'" in out.stdout
    assert "below the" in out.stdout and "DDR address out of range" in out.stdout


def test_compare_launcher_submits_one_job_per_variant_then_the_report(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    before = ray_daemons()
    out = launch("launch/qwen3_30b_a3b_compare.sh", tmp_path, ["--dry-run", "trainer.total_training_steps=5"],
                 timeout=120, MASTER_ADDR=ip, VARIANTS="grpo,grpo_r2,gspo", SEEDS="1,2",
                 COMPARE_DIR=str(tmp_path / "cmp"))
    assert out.returncode == 0, out.stderr
    jobs = [line for line in out.stdout.splitlines() if "ray job submit" in line]
    assert len(jobs) == 3
    for job, variant in zip(jobs, ("grpo", "grpo_r2", "gspo")):
        assert f"-{variant} " in job and f"recipe.compare --config" in job and f"--variants {variant} --seeds 1,2" in job
        assert f"--out {tmp_path / 'cmp'}" in job and "trainer.total_training_steps=5" in job
    report = [line for line in out.stdout.splitlines() if "recipe.compare" in line and "ray job submit" not in line]
    assert len(report) == 1 and "--variants grpo,grpo_r2,gspo --seeds 1,2" in report[0]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "cmp").exists()
    assert_no_new_ray(before, grace_s=0)


def test_invalid_parallel_fails_before_ray_starts(tmp_path):
    layout = yaml.safe_load((REPO / "configs/parallel/qwen3_30b_a3b_2x16_a3.yaml").read_text())
    layout["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] = 8
    (tmp_path / "tp8.yaml").write_text(yaml.safe_dump(layout))
    before = ray_daemons()
    out = launch(GSPO_30B, tmp_path, timeout=120, PARALLEL=str(tmp_path / "tp8.yaml"), MASTER_ADDR="127.0.0.1")
    assert out.returncode == 2
    assert "num_query_groups (4) must be a multiple of it" in out.stderr
    assert "nothing was started" in out.stderr
    (run_log,) = (tmp_path / "logs").iterdir()
    assert not (run_log / "ray_head.log").exists()
    assert_no_new_ray(before, grace_s=0)


def test_bad_argument_and_bad_variable(tmp_path):
    out = launch(TINY, tmp_path, ["steps=3", "oops"], timeout=60)
    assert out.returncode == 2 and "argument 'oops'" in out.stderr
    out = launch(TINY, tmp_path, timeout=60, JOIN_TIMEOUT_S="ten")
    assert out.returncode == 2 and "JOIN_TIMEOUT_S=ten" in out.stderr


# --- real Ray ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The tiny recipe through the launcher on one machine (NNODES=1)."""
    tmp_path = tmp_path_factory.mktemp("local")
    before = ray_daemons()
    env = launcher_env(tmp_path, NNODES="1")
    out = launch(TINY, tmp_path, TINY_ARGS, timeout=600, env=env)
    return tmp_path, out, before, env


@pytest.mark.slow
def test_local_launcher_runs_the_tiny_recipe_and_stops_its_ray(local_run):
    tmp_path, out, before, env = local_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED" in out.stdout
    steps = [m["step"] for m in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))]
    assert steps == [1, 2]
    (run_log,) = (tmp_path / "logs").iterdir()
    for name in ("ray_head.log", "job.log", "launcher.log", "runtime_env.yaml", "config.yaml"):
        assert (run_log / name).is_file(), name
    assert "critic/score/mean" in (run_log / "job.log").read_text()
    assert_no_new_ray(before)
    # Nor the record of its cluster that a later plain ray.init() would try to join.
    current = Path(os.environ.get("RAY_TMPDIR", os.environ.get("TMPDIR", "/tmp"))) / "ray" / "ray_current_cluster"
    assert not current.exists() or not current.read_text().strip().endswith(f":{env['RAY_PORT']}")


@pytest.mark.slow
def test_failed_job_fails_the_launcher(tmp_path):
    before = ray_daemons()
    out = launch(TINY, tmp_path, TINY_ARGS, timeout=600, NNODES="1", TRAIN_FILE=str(tmp_path / "missing.parquet"))
    # Missing data is found on the head before Ray starts ...
    assert out.returncode == 1 and "does not exist on this node" in out.stderr
    (run_log,) = (tmp_path / "logs").iterdir()
    assert not (run_log / "ray_head.log").exists()
    # ... a job that fails inside Ray makes the launcher fail with it.
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    out = launch(TINY, tmp_path, TINY_ARGS, timeout=600, NNODES="1", TRAIN_FILE=str(bad))
    assert out.returncode == 1
    assert "did not succeed (FAILED" in out.stderr
    assert_no_new_ray(before)


@pytest.mark.slow
def test_head_alone_fails_naming_the_missing_node(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    before = ray_daemons()
    start = time.monotonic()
    out = launch(TINY, tmp_path, timeout=300, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=ip, JOIN_TIMEOUT_S="8",
                 NODE_IPS=f"{ip},10.254.254.254")
    elapsed = time.monotonic() - start
    assert out.returncode == 1
    assert f"only 1 of 2 nodes joined the Ray cluster at {ip}:" in out.stderr
    assert "missing: 10.254.254.254" in out.stderr and "nothing was submitted" in out.stderr
    assert elapsed < 8 + 150  # the join wait is bounded: Ray start-up and shut-down come on top
    assert_no_new_ray(before)


@pytest.mark.slow
def test_worker_without_a_head_gives_up_after_the_time_limit(tmp_path):
    before = ray_daemons()
    out = launch(TINY, tmp_path, timeout=120, NNODES="1", NODE_ROLE="worker", MASTER_ADDR="127.0.0.2",
                 JOIN_TIMEOUT_S="6")
    assert out.returncode == 1
    assert "could not join the Ray head at 127.0.0.2:" in out.stderr and "within 6s" in out.stderr
    assert "attempt 1: the head" in out.stdout
    assert_no_new_ray(before, grace_s=0)


@pytest.mark.slow
def test_ctrl_c_stops_what_the_launcher_started(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    before = ray_daemons()
    proc = subprocess.Popen(["bash", TINY], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=launcher_env(tmp_path, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=ip, JOIN_TIMEOUT_S="300"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "nodes joined: 1/2" in line:
            break
    assert ray_daemons() - before, "the head's Ray should be up"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 130, text[-2000:]
    assert "caught SIGINT" in text and "stopping this node's Ray" in text
    assert_no_new_ray(before)


@pytest.mark.slow
def test_sigterm_during_the_job_stops_the_job_and_the_node(tmp_path):
    before = ray_daemons()
    proc = subprocess.Popen(["bash", TINY, "trainer.total_training_steps=500"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=launcher_env(tmp_path, NNODES="1"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "workers: node" in line:  # the job's Ray workers are up
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=180)
    text = "".join(lines) + rest
    assert proc.returncode == 143, text[-2000:]
    assert "caught SIGTERM" in text and "stopping job moe-rl-tiny_gspo-" in text
    steps = read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert len(steps) < 500  # stopped, not finished
    assert_no_new_ray(before)


# --- two hosts in network namespaces ------------------------------------------------------------------


def _netns_possible() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"moe-rl-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, with the test's own addresses."""
    if not _netns_possible():
        pytest.skip("needs root and `ip netns` to make two hosts")
    tag = os.getpid() % 10000
    hosts = [f"moe-rl-h{i}-{tag}" for i in (1, 2)]
    links = [f"mrl{i}-{tag}" for i in (1, 2)]
    net = f"10.213.{tag % 250}"
    ips = [f"{net}.1", f"{net}.2"]
    cmds = [["ip", "netns", "add", hosts[0]], ["ip", "netns", "add", hosts[1]],
            ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]]]
    for host, link, ip in zip(hosts, links, ips):
        cmds += [["ip", "link", "set", link, "netns", host], ["ip", "-n", host, "addr", "add", f"{ip}/24", "dev", link],
                 ["ip", "-n", host, "link", "set", link, "up"], ["ip", "-n", host, "link", "set", "lo", "up"]]
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)
        yield hosts, ips
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True)


@pytest.mark.slow
def test_two_hosts_join_through_the_launcher_and_train(two_hosts, tmp_path, local_run):
    (head, worker), (head_ip, worker_ip) = two_hosts
    before = ray_daemons()
    env = launcher_env(tmp_path, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=head_ip, JOIN_TIMEOUT_S="120")
    run = lambda host: subprocess.Popen(["ip", "netns", "exec", host, "bash", TINY, *TINY_ARGS], cwd=REPO, env=env,  # noqa: E731
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head_proc = run(head)
    time.sleep(2)
    worker_proc = run(worker)  # joins while the head waits for it
    head_out, _ = head_proc.communicate(timeout=600)
    worker_out, _ = worker_proc.communicate(timeout=120)
    assert head_proc.returncode == 0, head_out[-3000:]
    assert worker_proc.returncode == 0, worker_out[-3000:]
    assert f"joined the Ray cluster at {head_ip}:" in worker_out and "is gone" in worker_out
    assert f"workers: node {head_ip} rank 0; node {worker_ip} rank 1" in head_out
    # Same recipe, same seeds: the two-host run computes what the one-machine run computed.
    two = {m["step"]: stable(m) for m in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))}
    one = {m["step"]: stable(m) for m in read_jsonl(str(local_run[0] / "run" / "metrics.jsonl"))}
    assert sorted(two) == [1, 2]
    for step in two:
        for key, value in one[step].items():
            assert two[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert_no_new_ray(before)
