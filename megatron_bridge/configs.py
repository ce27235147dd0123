"""Where the shipped YAMLs live: ``configs/`` at the top of a source checkout (and of an editable
install), installed beside this module as ``megatron_bridge/shipped_configs`` by ``pip install .``
(setup.py maps the one folder onto the other), so a run finds them from any directory; and the
one YAML reader of every config (recipes, fragments, layouts, models, overrides)."""

import os
import re

import yaml

from megatron_bridge.errors import ConfigError

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


class YamlLoader(yaml.SafeLoader):
    """PyYAML (YAML 1.1) reads ``1e-6`` and ``1.0e6`` as strings; read them as floats (as YAML 1.2
    and verl's OmegaConf do)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str) -> dict:
    """A config file's mapping (empty for an empty file); anything else is a ``ConfigError`` naming the file."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=YamlLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data
