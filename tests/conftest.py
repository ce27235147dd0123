import importlib.util
import json
import os
import subprocess

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_npu = importlib.util.find_spec("torch_npu") is not None
    for item in items:
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs torch_npu and an Ascend NPU"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


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
        if not record.exists():
            out = run_main(["--config", TINY["gspo"], f"trainer.default_local_dir={run}"], timeout=1800)
            record.write_text(json.dumps({"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}))
    done = json.loads(record.read_text())
    out = subprocess.CompletedProcess(["recipe.main"], done["returncode"], done["stdout"], done["stderr"])
    assert out.returncode == 0, out.stderr[-3000:]
    return run, out
