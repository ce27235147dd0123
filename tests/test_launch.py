"""The shell launchers (launch/*.sh) for real: shellcheck, dry runs, validation before Ray starts, a
local Ray head running the tiny recipe through `ray job submit`, a missing node, SIGINT and SIGTERM at
each moment of a launch (paused there by LAUNCH_PAUSE_AT, so no test sleeps and hopes), and two hosts
in network namespaces joined into one cluster.

Time limits here guard against hangs only: each is generous (the machine may be busy with another
training run) and says what it waits for."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from recipe.config import load_config
from recipe.tracking.loggers import read_jsonl
from tests.distributed import free_port
from tests.recipe_runs import EP1, assert_same_step

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = sorted(str(p.relative_to(REPO)) for p in (REPO / "launch").glob("*.sh"))
GSPO_30B = "launch/qwen3_30b_a3b_gspo.sh"
TINY = "launch/tiny_gspo.sh"
# Short runs: 2 RL steps, no validation.
TINY_ARGS = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
HANG_S = 600  # the limit on anything a launcher test waits for: only a hang reaches it
TAG = "MOE_RL_TEST_LAUNCH"  # in a launcher's environment, so in that of everything it starts


def launcher_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "NNODES", "MASTER_ADDR", "PARALLEL")}
    # Ports of their own: another Ray on this machine (a training run, another test) must not answer.
    env.update({"LOG_DIR": str(tmp_path / "logs"), "CKPT_DIR": str(tmp_path / "run"), "RAY_PORT": str(free_port()),
                "DASHBOARD_PORT": str(free_port()), "DASHBOARD_AGENT_PORT": str(free_port()),
                "RAY_AUTH_TOKEN": secrets.token_hex(32), TAG: str(tmp_path)})
    env.update(extra)
    return env


@contextlib.contextmanager
def sigint_as_from_a_terminal():
    """A child started meanwhile gets SIGINT's default action, as from a terminal, even if this test
    run ignores SIGINT (started with & from a script): bash cannot trap a signal ignored at its start."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # handled here: default after exec
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def launch(script: str, tmp_path: Path, args=(), env: dict | None = None, **extra: str) -> subprocess.CompletedProcess:
    """Run a launcher to its end: its exit and the end of its output, at most HANG_S (past that it is
    stopped with SIGTERM, its own clean-up, and the test fails)."""
    with sigint_as_from_a_terminal():
        proc = subprocess.Popen(["bash", script, *args], cwd=REPO, env=env or launcher_env(tmp_path, **extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=HANG_S)
        pytest.fail(f"{script} did not end within {HANG_S}s (exit and end of output); stopped it")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def processes(tmp_path: Path) -> str:
    """What the launcher's processes are doing, one line each: pid, parent, state, kernel wait
    channel, command (for a hang's failure message)."""
    pids = ",".join(map(str, sorted(started_by(tmp_path))))
    if not pids:
        return "(none left)"
    return subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:20,args", "-p", pids], capture_output=True, text=True).stdout


def started_by(tmp_path: Path) -> set[int]:
    """The processes a launcher of this test started, Ray's and the job's included: those whose
    environment carries the test's tag (read from /proc; other Ray clusters on the machine have none)."""
    tag = f"{TAG}={tmp_path}".encode()
    out = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag in (entry / "environ").read_bytes().split(b"\0"):
                out.add(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return out


def assert_nothing_left(tmp_path: Path, within_s: float = 120) -> None:
    """Nothing the launcher started outlives it, so nothing can start anything afterwards either. Its
    last processes (its tee, Ray's, killed as it exits) may take a moment to end on a busy machine."""
    deadline = time.monotonic() + within_s
    while (left := started_by(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left behind: {[_cmdline(p)[:300] for p in left]}"


def local_address() -> str | None:
    """This machine's first non-loopback IPv4 address (the head's MASTER_ADDR for NNODES=2)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    ips = [line.split()[3].split("/")[0] for line in out.splitlines()]
    return next((ip for ip in ips if not ip.startswith("127.")), None)


class Launcher:
    """A launcher running in the background, in its own process group (so that a test can press
    Ctrl-C: SIGINT to the whole group), its output read by a thread so that every wait has a limit."""

    def __init__(self, script: str, tmp_path: Path, args=(), **extra: str):
        self.tmp_path = tmp_path
        self.env = launcher_env(tmp_path, **extra)
        with sigint_as_from_a_terminal():
            self.proc = subprocess.Popen(["bash", script, *args], cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, needle: str) -> str:
        """The first output line containing needle (at most HANG_S; fails if the launcher ends first)."""
        deadline = time.monotonic() + HANG_S
        with self._changed:
            while True:
                found = next((line for line in self.lines if needle in line), None)
                if found is not None:
                    return found
                if self._eof or time.monotonic() >= deadline:
                    pytest.fail(f"the launcher {'ended' if self._eof else f'ran {HANG_S}s'} without printing "
                                f"{needle!r}; {self._state(''.join(self.lines))}")
                self._changed.wait(deadline - time.monotonic())

    def _state(self, output: str) -> str:
        """For a hang's failure message: the launcher's processes and the end of its output."""
        return f"its processes (where each waits):\n{processes(self.tmp_path)}\nits output:\n{output[-3000:]}"

    def pause_point(self, point: str) -> None:
        """Wait until the launcher is paused at point (LAUNCH_PAUSE_AT)."""
        self.wait_for(f"paused at {point} (LAUNCH_PAUSE_AT)")

    def signal(self, sig: int, ctrl_c: bool = False) -> None:
        """Send sig to the launcher alone (as `kill` does) or, ctrl_c, to its whole process group (as a
        terminal's Ctrl-C does: every process of the foreground job gets it)."""
        if ctrl_c:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def exit_status(self) -> int:
        """Wait for the launcher process itself to exit (at most HANG_S), then for the rest of its output."""
        try:
            rc = self.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not exit within {HANG_S}s; {self._state(self.text)}")
        with self._changed:  # its output ends with its tee; a descendant holding the pipe must not hang the test
            self._changed.wait_for(lambda: self._eof, timeout=60)
        return rc

    def close(self) -> None:
        """After a failed test: stop a launcher still running (SIGTERM: its own clean-up), then its group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def start_launcher(tmp_path):
    """start_launcher(script, args=(), **env) -> Launcher; any still running at the end is stopped."""
    started = []

    def start(script: str, args=(), **extra: str) -> Launcher:
        started.append(Launcher(script, tmp_path, args, **extra))
        return started[-1]

    yield start
    for launcher in started:
        launcher.close()


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
    """mc2.yaml sets nothing removed, agrees with what the vLLM engine sets for itself on NPU, and
    passes the engine's own environment check (it set expandable_segments:True, which the colocated
    engine's sleep mode refuses: every NPU run stopped there)."""
    from recipe.rollout.vllm_setup import check_env, rollout_env

    env = yaml.safe_load((REPO / "configs/runtime_env/mc2.yaml").read_text())["env_vars"]
    assert "VLLM_ENABLE_MC2" not in env and "HCCL_BUFFSIZE" not in env  # removed / computed per layout
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0" and env["TASK_QUEUE_ENABLE"] in ("1", "2")
    for name, value in rollout_env("npu").items():
        if name in env:
            assert env[name] == value, name
    assert all(isinstance(v, str) for v in env.values())
    check = check_env("npu", env, enable_sleep_mode=True)
    assert check.errors == [] and check.warnings == []


# --- dry runs and validation: nothing starts --------------------------------------------------------


def test_dry_run_prints_layout_memory_env_and_each_nodes_commands(tmp_path):
    out = launch(GSPO_30B, tmp_path, ["--dry-run", "trainer.total_training_steps=5"], MASTER_ADDR="127.0.0.1",
                 NODE_ROLE="head")
    # The 30B recipe is a 2-node layout: MASTER_ADDR on loopback is refused even in a dry run.
    assert out.returncode == 2 and "loopback" in out.stderr
    ip = local_address()
    if ip is None:
        pytest.skip("no non-loopback address on this machine")
    out = launch(GSPO_30B, tmp_path, ["--dry-run", "trainer.total_training_steps=5"], MASTER_ADDR=ip)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "layout qwen3_30b_a3b_2x16_a3: train TP2 PP2 EP16" in text
    assert "training peak" in text and "VALID" in text
    # verl's dynamic batch size: the actor's 10,240 tokens hold one longest sequence (2k + 8k)
    assert "micro-batch: 10,240 tokens per device (dynamic batch size), planned as 1 sequence(s) of 10,240" in text
    assert "HCCL_BUFFSIZE: '608'" in text  # the planner's value for this layout, in the job's runtime env
    assert "VLLM_ASCEND_ENABLE_NZ: '0'" in text
    assert "ray start --head --block" in text and '{"NPU": 16}' in text.replace("\\", "")
    assert f"ray start --address {ip}:" in text  # what each worker node runs
    assert "ray job submit" in text and "recipe.main_gspo" in text and "trainer.total_training_steps=5" in text
    assert "does not exist on this node" in out.stderr  # placeholder paths: warned, not fatal, in a dry run
    assert not (tmp_path / "logs").exists()
    assert_nothing_left(tmp_path)


def test_worker_dry_run_names_the_head_and_whether_it_answers(tmp_path):
    """On a worker, the dry run prints the head's command with the head's address (not this node's) and
    says, within a few seconds, that the head does not answer; a signal ignored at the start is named."""
    env = launcher_env(tmp_path, NNODES="1", NODE_ROLE="worker", MASTER_ADDR="127.0.0.2")
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for a launcher started with & from a script
    try:
        start = time.monotonic()
        out = subprocess.run(["bash", TINY, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=HANG_S)
        elapsed = time.monotonic() - start
    finally:
        signal.signal(signal.SIGINT, handler)
    assert out.returncode == 0, out.stderr
    port = out.stdout.split("--port ")[1].split()[0]
    assert "--head --block --port" in out.stdout and "--node-ip-address 127.0.0.2 " in out.stdout
    assert f"the head 127.0.0.2:{port} does not answer (yet)" in out.stdout
    assert "note: SIGINT is ignored here" in out.stdout
    # the tiny recipe's dynamic batch size, planned as the budget's longest sequences (one rank's 64 rows)
    assert "micro-batch: 16,384 tokens per device (dynamic batch size), planned as 64 sequence(s) of 48 tokens" \
        in out.stdout
    assert elapsed < HANG_S


def test_unresolvable_master_addr_is_one_line_naming_it(tmp_path):
    out = launch(TINY, tmp_path, ["--dry-run"], MASTER_ADDR="no-such-head.invalid")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "MASTER_ADDR=no-such-head.invalid: cannot resolve it" in out.stderr


def test_parallel_swap_takes_the_layouts_cluster_and_user_buffsize(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    out = launch("launch/qwen3_30b_a3b_grpo.sh", tmp_path, ["--dry-run"], MASTER_ADDR=ip,
                 PARALLEL="qwen3_30b_a3b_2x8_a2", HCCL_BUFFSIZE="100")
    assert out.returncode == 0, out.stderr
    assert "cluster: 2 node(s) x 8 npu" in out.stdout and "recipe.main_grpo" in out.stdout
    assert "HCCL_BUFFSIZE: '100'" in out.stdout
    assert "below the" in out.stdout and "DDR address out of range" in out.stdout


def test_compare_launcher_submits_one_job_per_variant_then_the_report(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    out = launch("launch/qwen3_30b_a3b_compare.sh", tmp_path, ["--dry-run", "trainer.total_training_steps=5"],
                 MASTER_ADDR=ip, VARIANTS="grpo,grpo_r2,gspo", SEEDS="1,2", COMPARE_DIR=str(tmp_path / "cmp"))
    assert out.returncode == 0, out.stderr
    jobs = [line for line in out.stdout.splitlines() if "ray job submit" in line]
    assert len(jobs) == 3
    for job, variant in zip(jobs, ("grpo", "grpo_r2", "gspo")):
        assert f"-{variant} " in job and "recipe.compare --config" in job and f"--variants {variant} --seeds 1,2" in job
        assert f"--out {tmp_path / 'cmp'}" in job and "trainer.total_training_steps=5" in job
    report = [line for line in out.stdout.splitlines() if "recipe.compare" in line and "ray job submit" not in line]
    assert len(report) == 1 and "--variants grpo,grpo_r2,gspo --seeds 1,2" in report[0]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "cmp").exists()
    assert_nothing_left(tmp_path)


def test_invalid_parallel_fails_before_ray_starts(tmp_path):
    layout = yaml.safe_load((REPO / "configs/parallel/qwen3_30b_a3b_2x16_a3.yaml").read_text())
    layout["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] = 8
    (tmp_path / "tp8.yaml").write_text(yaml.safe_dump(layout))
    out = launch(GSPO_30B, tmp_path, PARALLEL=str(tmp_path / "tp8.yaml"), MASTER_ADDR="127.0.0.1")
    assert out.returncode == 2
    assert "num_query_groups (4) must be a multiple of it" in out.stderr
    assert "nothing was started" in out.stderr
    (run_log,) = (tmp_path / "logs").iterdir()
    assert not (run_log / "ray_head.log").exists()
    assert_nothing_left(tmp_path)


def test_bad_argument_and_bad_variable(tmp_path):
    out = launch(TINY, tmp_path, ["steps=3", "oops"])
    assert out.returncode == 2 and "argument 'oops'" in out.stderr
    out = launch(TINY, tmp_path, JOIN_TIMEOUT_S="ten")
    assert out.returncode == 2 and "JOIN_TIMEOUT_S=ten" in out.stderr
    out = launch(TINY, tmp_path, MAX_RESTARTS="-1")
    assert out.returncode == 2 and "MAX_RESTARTS=-1: expected a whole number" in out.stderr


def test_split_dry_run_gives_the_rollout_its_own_pool(tmp_path):
    """ROLLOUT_NNODES / ROLLOUT_NPUS_PER_NODE: the job gets the split's keys, the planner plans both
    pools, the head waits for the nodes of both (on the CPU both pools share the nodes' cores)."""
    out = launch(TINY, tmp_path, ["--dry-run", "trainer.total_training_steps=3"], ROLLOUT_NNODES="1",
                 ROLLOUT_NPUS_PER_NODE="2")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    (job,) = [line for line in text.splitlines() if "ray job submit" in line]
    assert job.endswith("actor_rollout_ref.hybrid_engine=false actor_rollout_ref.rollout.nnodes=1 "
                        "actor_rollout_ref.rollout.n_gpus_per_node=2 async_training.mode=one_step_off "
                        "trainer.total_training_steps=3")
    assert "pools (actor_rollout_ref.hybrid_engine=false, async_training.mode=one_step_off): 1 node(s)" in text
    assert "  training: 1 x 2 CPU ranks, rollout: 1 x 2 CPU ranks, on the same node(s)' cores" in text
    assert "rollout pool: 1 x 2 cpu = 2 devices of its own (hybrid_engine=false)" in text
    assert "memory per rollout device (TP1 DP2 EP1; no training state there):" in text
    assert "training state kept during rollout" not in text and "VALID" in text
    assert "cluster: 1 node(s) x 2 cpu training, 1 node(s) x 2 cpu rollout" in text
    assert "--expect 1 " in text and "--per-node 4 " in text  # 2 training + 2 rollout ranks on the one node
    assert not (tmp_path / "logs").exists()
    # the user's overrides choose the mode: the launcher adds none
    out = launch(TINY, tmp_path, ["--dry-run", "async_training.mode=one_step_off"], ROLLOUT_NNODES="1",
                 ROLLOUT_NPUS_PER_NODE="2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("async_training.mode=one_step_off") == 2  # the pools line and the job's own override


@pytest.mark.parametrize("env, args, says", [
    ({"ROLLOUT_NNODES": "1"}, [], "ROLLOUT_NNODES=1 ROLLOUT_NPUS_PER_NODE=: set both (the rollout's own nodes and "
                                  "devices per node), or neither for a rollout on the training devices"),
    ({"ROLLOUT_NPUS_PER_NODE": "2"}, [], "ROLLOUT_NNODES= ROLLOUT_NPUS_PER_NODE=2: set both"),
    ({"ROLLOUT_NNODES": "one", "ROLLOUT_NPUS_PER_NODE": "2"}, [],
     "ROLLOUT_NNODES=one: expected a whole number >= 1 (or leave it empty: no rollout pool of its own)"),
    ({"ROLLOUT_NNODES": "1", "ROLLOUT_NPUS_PER_NODE": "0"}, [], "ROLLOUT_NPUS_PER_NODE=0: expected a whole number >= 1"),
])
def test_inconsistent_rollout_pool_variables_are_one_line(tmp_path, env, args, says):
    out = launch(TINY, tmp_path, ["--dry-run", *args], **env)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr


def test_rollout_pool_refused_where_the_rollout_stays_colocated(tmp_path):
    out = launch(TINY, tmp_path, ["--dry-run", "actor_rollout_ref.hybrid_engine=true"], ROLLOUT_NNODES="1",
                 ROLLOUT_NPUS_PER_NODE="2")
    assert out.returncode == 2 and "nothing was started" in out.stderr
    assert "sets actor_rollout_ref.hybrid_engine=true (the rollout on the training devices): unset ROLLOUT_NNODES" in out.stderr
    assert_nothing_left(tmp_path)


def test_the_30b_launcher_splits_training_and_vllm_rollout_nodes(tmp_path):
    out = launch(GSPO_30B, tmp_path, ["--dry-run"], ROLLOUT_NNODES="2", ROLLOUT_NPUS_PER_NODE="16",
                 MASTER_ADDR="10.0.0.1", NODE_ROLE="head")
    assert out.returncode == 0, out.stderr
    assert "training: 2 x 16 npu, the head first; rollout: 2 x 16 npu on 2 other node(s)" in out.stdout
    assert "rollout pool: 2 x 16 npu = 32 devices of its own (hybrid_engine=false)" in out.stdout
    assert "--expect 4 " in out.stdout and "async_training.mode=one_step_off" in out.stdout
    out = launch(GSPO_30B, tmp_path, ["--dry-run", "async_training.mode=fully_async", "async_training.partial_rollout=true"],
                 ROLLOUT_NNODES="2", ROLLOUT_NPUS_PER_NODE="16", MASTER_ADDR="10.0.0.1", NODE_ROLE="head")
    assert out.returncode == 0, out.stderr
    assert "async_training.partial_rollout=true" in out.stdout


def test_port_in_use_fails_before_ray_starts(tmp_path):
    """Another Ray on the node holds the dashboard agent's port: said at once, instead of a job API with
    no agent ("No available agent to submit job") after Ray started."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = launch(TINY, tmp_path, NNODES="1", DASHBOARD_AGENT_PORT=str(port))
    assert out.returncode == 1
    assert f"port {port} (DASHBOARD_AGENT_PORT) is in use on this node" in out.stderr
    (run_log,) = (tmp_path / "logs").iterdir()
    assert not (run_log / "ray_head.log").exists()
    assert_nothing_left(tmp_path)


# --- real Ray ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The tiny recipe through the launcher on one machine (NNODES=1)."""
    tmp_path = tmp_path_factory.mktemp("local")
    env = launcher_env(tmp_path, NNODES="1")
    out = launch(TINY, tmp_path, TINY_ARGS, env=env)
    return tmp_path, out, env


@pytest.mark.slow
def test_local_launcher_runs_the_tiny_recipe_and_stops_its_ray(local_run):
    tmp_path, out, env = local_run
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUCCEEDED" in out.stdout
    steps = [m["step"] for m in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))]
    assert steps == [1, 2]
    (run_log,) = (tmp_path / "logs").iterdir()
    for name in ("ray_head.log", "job.log", "launcher.log", "runtime_env.yaml", "config.yaml"):
        assert (run_log / name).is_file(), name
    assert "critic/score/mean" in (run_log / "job.log").read_text()
    assert_nothing_left(tmp_path)
    # Nor the record of its cluster that a later plain ray.init() would try to join.
    current = Path(os.environ.get("RAY_TMPDIR", os.environ.get("TMPDIR", "/tmp"))) / "ray" / "ray_current_cluster"
    assert not current.exists() or not current.read_text().strip().endswith(f":{env['RAY_PORT']}")


@pytest.mark.slow
def test_failed_job_fails_the_launcher(tmp_path):
    out = launch(TINY, tmp_path, TINY_ARGS, NNODES="1", TRAIN_FILE=str(tmp_path / "missing.parquet"))
    # Missing data is found on the head before Ray starts ...
    assert out.returncode == 1 and "does not exist on this node" in out.stderr
    (run_log,) = (tmp_path / "logs").iterdir()
    assert not (run_log / "ray_head.log").exists()
    # ... a job that fails inside Ray makes the launcher fail with it.
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    out = launch(TINY, tmp_path, TINY_ARGS, NNODES="1", TRAIN_FILE=str(bad))
    assert out.returncode == 1
    assert "did not succeed (FAILED" in out.stderr
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_a_failed_job_is_resubmitted_and_resumes_from_its_checkpoint(tmp_path):
    """MAX_RESTARTS=1: the job fails once after its step-2 checkpoint (a planted reward error, as a
    lost node would end it), is resubmitted once the node is back, and resumes there. The job is the
    split one-step-off run (ROLLOUT_NNODES / ROLLOUT_NPUS_PER_NODE): it trains on one rank while a
    rollout rank of its own generates a step ahead (the CPU's two pools share the one node)."""
    run, marker = tmp_path / "run", tmp_path / "fail_once"
    marker.touch()
    reward = tmp_path / "reward.py"
    reward.write_text(
        "import os\n"
        "from recipe.reward.dispatch import default_compute_score\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    if os.path.isdir({str(run / 'checkpoints' / 'global_step_2')!r}) and os.path.exists({str(marker)!r}):\n"
        f"        os.remove({str(marker)!r})\n"
        "        raise RuntimeError('planted failure after the step-2 checkpoint')\n"
        "    return default_compute_score(data_source, solution_str, ground_truth, extra_info)\n")
    args = ["trainer.total_training_steps=3", "trainer.save_freq=2", "trainer.test_freq=-1",
            "trainer.val_before_train=false", f"custom_reward_function.path={reward}", EP1]
    out = launch(TINY, tmp_path, args, NNODES="1", NPUS_PER_NODE="1", MAX_RESTARTS="1", ROLLOUT_NNODES="1",
                 ROLLOUT_NPUS_PER_NODE="1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "restart 1 of 1: waiting up to" in out.stdout and "FAILED" in out.stdout
    assert "SUCCEEDED" in out.stdout and "--expect 1 " not in out.stdout  # not a dry run
    (run_log,) = (tmp_path / "logs").iterdir()
    config = yaml.safe_load((run_log / "config.yaml").read_text())
    assert config["actor_rollout_ref"]["hybrid_engine"] is False and config["async_training"]["mode"] == "one_step_off"
    assert "planted failure" in (run_log / "job.log").read_text()
    assert f"resumed from {run / 'checkpoints' / 'global_step_2'} (step 2)" in (run_log / "job-restart1.log").read_text()
    metrics = sorted(read_jsonl(str(run / "metrics.jsonl")), key=lambda m: m["step"])
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # step 2's batch was made a step ahead; the resumed job's first step generates on the spot
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 0]
    assert_nothing_left(tmp_path)


def _launch_time(line: str) -> int:
    h, m, s = (int(x) for x in re.search(r"\[launch (\d\d):(\d\d):(\d\d)\]", line).groups())
    return h * 3600 + m * 60 + s


@pytest.mark.slow
def test_head_alone_fails_naming_the_missing_node(tmp_path):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    out = launch(TINY, tmp_path, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=ip, JOIN_TIMEOUT_S="8",
                 NODE_IPS=f"{ip},10.254.254.254")
    assert out.returncode == 1
    assert f"only 1 of 2 nodes joined the Ray cluster at {ip}:" in out.stderr
    assert "missing: 10.254.254.254" in out.stderr and "nothing was submitted" in out.stderr
    # The join wait is bounded by JOIN_TIMEOUT_S: from its start to the error, 8 s and wait-nodes' own
    # start and last look (seconds on a busy machine; a minute is far more than that, 600 s is the default).
    began = _launch_time(next(line for line in out.stdout.splitlines() if "waiting up to 8s" in line))
    failed = _launch_time(next(line for line in out.stderr.splitlines() if "not all nodes joined" in line))
    assert (failed - began) % 86400 < 8 + 60
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_worker_without_a_head_gives_up_after_the_time_limit(tmp_path):
    out = launch(TINY, tmp_path, NNODES="1", NODE_ROLE="worker", MASTER_ADDR="127.0.0.2", JOIN_TIMEOUT_S="6")
    assert out.returncode == 1
    assert "could not join the Ray head at 127.0.0.2:" in out.stderr and "within 6s" in out.stderr
    assert "attempt 1: the head" in out.stdout
    assert_nothing_left(tmp_path)


# --- SIGINT and SIGTERM at each moment: exit 130 / 143, the job stopped, nothing left ------------------

SIGNALS = {signal.SIGINT: ("SIGINT", 130), signal.SIGTERM: ("SIGTERM", 143)}
# What a launcher may still say once it caught a signal: clean-up only, nothing new started.
CLEAN_UP = ("caught SIG", "paused at cleanup", "waiting for the submission of job", "stopping job", "job moe-rl-",
            "stopping this node's Ray", "logs: ")


def assert_stopped_by(launcher: Launcher, sig: int) -> str:
    """The launcher exits with sig's status, having said so, and after it said only clean-up things;
    nothing it started is left. Its output."""
    name, status = SIGNALS[sig]
    rc = launcher.exit_status()
    text = launcher.text
    assert rc == status, text[-3000:]
    caught = text.index(f"caught {name}: stopping what this launcher started")
    after = [line for line in text[caught:].splitlines() if line.startswith("[launch ")]
    assert all(any(what in line for what in CLEAN_UP) for line in after), after
    assert_nothing_left(launcher.tmp_path)
    return text


def await_child_log(launcher: Launcher, name: str) -> None:
    """Wait until the launcher's child opened its log ``name`` in the run's log directory: it has set
    Ctrl-C aside by then (``to_file`` in launch/common.sh). A Ctrl-C in the instant before would end
    that child before its command ran at all, leaving nothing to stop, which is not what a test of
    the command in flight is after."""
    (run_log,) = (launcher.tmp_path / "logs").iterdir()
    deadline = time.monotonic() + HANG_S
    while not (run_log / name).exists():
        assert time.monotonic() < deadline, f"the launcher's child never opened {name}; {launcher.text[-2000:]}"
        time.sleep(0.05)


def job_status(launcher: Launcher) -> str:
    """The job's status from the head's dashboard (while the launcher is paused in its clean-up)."""
    job_id = launcher.wait_for("submitting job ").split("submitting job ")[1].split(":")[0]
    out = subprocess.run(["python", "-m", "recipe.cluster", "job-status", "--id", job_id, "--dashboard",
                          f"http://127.0.0.1:{launcher.env['DASHBOARD_PORT']}"], cwd=REPO,
                         env={**launcher.env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=HANG_S)
    return out.stdout.strip() or out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig, ctrl_c", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"])
def test_signal_before_ray_starts(start_launcher, sig, ctrl_c):
    launcher = start_launcher(TINY, NNODES="1", LAUNCH_PAUSE_AT="before_ray")
    launcher.pause_point("before_ray")
    launcher.signal(sig, ctrl_c=ctrl_c)
    assert_stopped_by(launcher, sig)
    (run_log,) = (launcher.tmp_path / "logs").iterdir()
    assert not (run_log / "ray_head.log").exists()


@pytest.mark.slow
def test_ctrl_c_while_ray_starts_stops_it(start_launcher):
    launcher = start_launcher(TINY, NNODES="1", LAUNCH_PAUSE_AT="ray_starting")
    launcher.pause_point("ray_starting")
    await_child_log(launcher, "ray_head.log")  # `ray start` is on its way up
    launcher.signal(signal.SIGINT, ctrl_c=True)
    assert "stopping this node's Ray" in assert_stopped_by(launcher, signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_while_the_head_waits_for_nodes(start_launcher):
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    launcher = start_launcher(TINY, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=ip, LAUNCH_PAUSE_AT="joining")
    launcher.pause_point("joining")
    launcher.wait_for("nodes joined: 1/2")  # the head's Ray is up; the second node never comes
    launcher.signal(signal.SIGINT, ctrl_c=True)
    text = assert_stopped_by(launcher, signal.SIGINT)
    assert "stopping this node's Ray" in text and "submitting job" not in text


@pytest.mark.slow
def test_the_heads_ray_dying_while_it_waits_for_nodes_ends_the_launch(start_launcher):
    """The head's Ray gone during the join wait (killed, or out of Ray's own start-up window on a busy
    machine): the launcher says so within seconds, not when the join timeout runs out."""
    ip = local_address() or pytest.skip("no non-loopback address on this machine")
    launcher = start_launcher(TINY, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=ip, JOIN_TIMEOUT_S="600")
    launcher.wait_for("nodes joined: 1/2")
    head = [p for p in started_by(launcher.tmp_path) if " start --head --block " in _cmdline(p)]
    assert len(head) == 1, [_cmdline(p) for p in started_by(launcher.tmp_path)]
    os.kill(head[0], signal.SIGKILL)
    began = time.monotonic()
    assert launcher.exit_status() == 1
    assert time.monotonic() - began < 60
    assert "this node's Ray exited while it waited for the nodes; nothing was submitted" in launcher.text
    assert "submitting job" not in launcher.text
    # what the killed `ray start` had started (its GCS, raylet, agents) is stopped by the launcher, not
    # left to notice on its own (Ray's agents wait a minute for a GCS that is gone) holding the ports
    assert "is gone: stopping the" in launcher.text
    assert_nothing_left(launcher.tmp_path, within_s=30)


@pytest.mark.slow
def test_sigterm_while_a_worker_tries_to_join(start_launcher):
    launcher = start_launcher(TINY, NNODES="1", NODE_ROLE="worker", MASTER_ADDR="127.0.0.2", LAUNCH_PAUSE_AT="joining")
    launcher.pause_point("joining")  # after its first attempt: the head does not answer
    launcher.signal(signal.SIGTERM)
    assert "attempt 1: the head" in assert_stopped_by(launcher, signal.SIGTERM)


@pytest.mark.slow
def test_ctrl_c_during_the_submission_stops_the_job_it_submitted(start_launcher):
    """Ctrl-C while `ray job submit` is in flight: the submission is let finish, then the job is stopped by
    its id (it is STOPPED on the head's dashboard, not left to start); a second signal during the clean-up
    does not cut it short, and the exit status is the first signal's."""
    launcher = start_launcher(TINY, NNODES="1", LAUNCH_PAUSE_AT="submitting,cleanup")
    launcher.pause_point("submitting")
    await_child_log(launcher, "job.log")  # `ray job submit` is in flight
    launcher.signal(signal.SIGINT, ctrl_c=True)
    launcher.pause_point("cleanup")  # the job is stopped, this node's Ray still up
    assert job_status(launcher) == "STOPPED"
    launcher.signal(signal.SIGTERM)
    text = assert_stopped_by(launcher, signal.SIGINT)
    assert "caught SIGTERM: already stopping; the clean-up goes on" in text
    assert text.index("stopping this node's Ray") > text.index("caught SIGTERM")
    assert not (launcher.tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


@pytest.mark.slow
def test_sigterm_while_the_job_runs_stops_the_job_and_the_node(start_launcher):
    launcher = start_launcher(TINY, ["trainer.total_training_steps=500", EP1], NNODES="1", NPUS_PER_NODE="1",
                              LAUNCH_PAUSE_AT="job_running,cleanup")
    launcher.pause_point("job_running")
    launcher.wait_for("workers: node")  # the job's Ray workers are up
    launcher.signal(signal.SIGTERM)
    launcher.pause_point("cleanup")
    assert job_status(launcher) == "STOPPED"
    launcher.signal(signal.SIGINT, ctrl_c=True)
    text = assert_stopped_by(launcher, signal.SIGTERM)
    assert "caught SIGINT: already stopping" in text and "stopping job moe-rl-tiny_gspo-" in text
    metrics = launcher.tmp_path / "run" / "metrics.jsonl"
    assert len(read_jsonl(str(metrics)) if metrics.exists() else []) < 500  # stopped, not finished


@pytest.mark.slow
def test_signal_during_the_clean_up_of_a_failed_launch(start_launcher, tmp_path):
    """A first signal during the clean-up (here of a launch that failed its checks) still ends with that
    signal's exit status."""
    launcher = start_launcher(TINY, NNODES="1", TRAIN_FILE=str(tmp_path / "missing.parquet"), LAUNCH_PAUSE_AT="cleanup")
    launcher.pause_point("cleanup")
    launcher.signal(signal.SIGTERM)
    assert launcher.exit_status() == 143, launcher.text[-3000:]
    assert "nothing was started" in launcher.text and "caught SIGTERM: already stopping" in launcher.text
    assert_nothing_left(tmp_path)


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
    env = launcher_env(tmp_path, NNODES="2", NPUS_PER_NODE="1", MASTER_ADDR=head_ip, JOIN_TIMEOUT_S="120")
    run = lambda host: subprocess.Popen(["ip", "netns", "exec", host, "bash", TINY, *TINY_ARGS], cwd=REPO, env=env,  # noqa: E731
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head_proc = run(head)
    worker_proc = run(worker)  # retries until the head is up, then joins
    head_out, _ = head_proc.communicate(timeout=HANG_S)  # the job's end, then the head's clean-up
    worker_out, _ = worker_proc.communicate(timeout=HANG_S)  # the worker sees the head gone and stops
    assert head_proc.returncode == 0, head_out[-3000:]
    assert worker_proc.returncode == 0, worker_out[-3000:]
    assert f"joined the Ray cluster at {head_ip}:" in worker_out and "is gone" in worker_out
    assert f"workers: node {head_ip} rank 0; node {worker_ip} rank 1" in head_out
    # Same recipe, same seeds: the two-host run computes what the one-machine run computed.
    two = {m["step"]: m for m in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))}
    one = {m["step"]: m for m in read_jsonl(str(local_run[0] / "run" / "metrics.jsonl"))}
    assert sorted(two) == sorted(one) == [1, 2]
    cfg = load_config(str(REPO / "configs/recipe/tiny_gspo.yaml"), TINY_ARGS)
    for step in two:
        assert_same_step(one[step], two[step], cfg)
    assert_nothing_left(tmp_path)


def test_the_auth_token_file_is_its_owners_alone(tmp_path):
    """The head generates Ray's token when it has none; generated or given, the file is made 0600
    (Ray writes it 0644)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
    env.update(HOME=str(tmp_path), NODE_ROLE="head", RAY_AUTH_MODE="token")
    check = ["bash", "-c", "source launch/common.sh && check_auth_token"]
    out = subprocess.run(check, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    token = tmp_path / ".ray" / "auth_token"
    assert out.returncode == 0, out.stderr
    assert token.stat().st_size > 0 and oct(token.stat().st_mode & 0o777) == "0o600"
    assert f"generated Ray's auth token in {token}" in out.stdout
    token.chmod(0o644)  # a token copied from the head as many copy files
    out = subprocess.run(check, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and oct(token.stat().st_mode & 0o777) == "0o600"
    assert f"made {token} readable by its owner only" in out.stdout
