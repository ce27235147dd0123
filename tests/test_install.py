"""A non-editable install (``pip install .``) runs the README's main job from any directory: the
shipped configs travel inside the package (setup.py's ``megatron_bridge.shipped_configs``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def source_copy(target: Path) -> Path:
    """The files git tracks (the working tree's versions), so the build sees what a clean clone has."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    return target


@pytest.mark.slow
def test_installed_package_runs_the_main_job_from_another_directory(tmp_path):
    # the venv sees this interpreter's packages (torch, megatron-core, Ray) but installs its own
    # copy of this one, which comes first on its path, before any editable install of the checkout;
    # this interpreter's pip and setuptools build it (a venv's bundled ones may be too old to)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    src = source_copy(tmp_path / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                          "--no-build-isolation", str(src)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    shutil.rmtree(src)  # nothing may come from the source tree

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([python, "-c", "import json, recipe, megatron_bridge.configs as c; "
                            "print(json.dumps([recipe.__file__, c.CONFIGS_DIR]))"],
                           cwd=elsewhere, capture_output=True, text=True, check=True)
    package, configs = json.loads(where.stdout)
    site = str(venv / "lib")
    assert package.startswith(site) and configs.startswith(site), (package, configs)

    run = elsewhere / "run"
    out = subprocess.run([python, "-m", "recipe.main_gspo", "--config", "configs/recipe/tiny_gspo.yaml",
                          "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                          f"trainer.default_local_dir={run}"], cwd=elsewhere, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 0] == [1, 2]
    assert json.loads((run / "config.json").read_text())["parallel"] == "tiny_cpu"
