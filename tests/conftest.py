import importlib.util
import json
import os
import subprocess

import pytest
import torch

MAIN_JOB_S = 2400  # hang guard for the README's main job on a loaded 2-core machine (alone: ~2.5 min)

# torch.compile's C++ kernels (the fused log-prob kernels) under another CPU kernel path: torch's
# inductor cache reuses a precompiled header built for the machine's own ISA whatever
# ATEN_CPU_CAPABILITY says, and the kernels then fail to compile. One cache per kernel path; rank
# processes inherit it.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.environ['ATEN_CPU_CAPABILITY']}")


def pytest_collection_modifyitems(config, items):
    has_npu = importlib.util.find_spec("torch_npu") is not None
    for item in items:
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs torch_npu and an Ascend NPU"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "main_job" in getattr(item, "fixturenames", ()) and item.get_closest_marker("timeout") is None:
            # the timeout covers the fixture's set-up: the shared run, or the wait for another worker's
            item.add_marker(pytest.mark.timeout(MAIN_JOB_S + 900))


@pytest.fixture(scope="module")
def local_ray():
    """Ray started in this process by the first in-process trainer of a module, stopped after it."""
    import ray

    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """The README's main job (the tiny GSPO recipe as shipped: 50 steps, validation every 10,
    checkpoints every 20), run once for the whole session and read by the learning, resume,
    evaluation and export tests: ``(run directory, its CompletedProcess)``. Under pytest-xdist the
    workers share one run: the first to ask runs it, the others wait on the lock."""
    from filelock import FileLock

    from tests.recipe_runs import TINY, run_main

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the directory all workers' temporary folders share
    run, record = root / "main_job", root / "main_job.json"
    with FileLock(str(root / "main_job.lock")):
        if not record.exists():  # a failed run is recorded too: the other tests report it, not run it again
            try:
                out = run_main(["--config", TINY["gspo"], f"trainer.default_local_dir={run}"], timeout=MAIN_JOB_S)
                done = {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
            except subprocess.TimeoutExpired as e:
                done = {"returncode": -1, "stdout": str(e.stdout or ""),
                        "stderr": f"{e.stderr or ''}\nthe main job ran past {MAIN_JOB_S} s"}
            record.write_text(json.dumps(done))
    done = json.loads(record.read_text())
    out = subprocess.CompletedProcess(["recipe.main"], done["returncode"], done["stdout"], done["stderr"])
    assert out.returncode == 0, out.stderr[-3000:]
    return run, out
