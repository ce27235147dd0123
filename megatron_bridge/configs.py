"""Where the shipped YAMLs live: ``configs/`` at the top of a source checkout (and of an editable
install), installed beside this module as ``megatron_bridge/shipped_configs`` by ``pip install .``
(setup.py maps the one folder onto the other), so a run finds them from any directory."""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_INSTALLED = os.path.join(_HERE, "shipped_configs")
CONFIGS_DIR = _INSTALLED if os.path.isdir(_INSTALLED) else os.path.join(os.path.dirname(_HERE), "configs")


def shipped(kind: str) -> list[str]:
    """Names of the YAMLs in configs/<kind>/ (kind: recipe, algo, parallel, model, runtime_env)."""
    return sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(CONFIGS_DIR, kind)) if f.endswith(".yaml"))


def find_config(kind: str, ref: str) -> str | None:
    """The file ``ref`` names: a path (relative to the current directory first), a shipped name
    (``tiny_gspo``), or a shipped path as the docs write it (``configs/recipe/tiny_gspo.yaml``),
    which an installed package finds without the source checkout. None if none of these exists."""
    shipped_dir = os.path.join(CONFIGS_DIR, kind)
    as_written = ref.removeprefix(f"configs/{kind}/")
    for candidate in (ref, os.path.join(shipped_dir, as_written), os.path.join(shipped_dir, f"{as_written}.yaml")):
        if os.path.isfile(candidate):
            return candidate
    return None
