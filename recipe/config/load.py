"""From files to a ``RecipeConfig``: YAML (with floats as YAML 1.2 reads them), ``key.sub=value``
overrides, the fragments' merge, ``${}`` references, and the typing of a dict into the schema's
dataclasses (``megatron_bridge.configs``'s, which the layout loader uses too: unknown keys with the
nearest known one, types, and the rules of ``recipe.config.rules``). Then, in this order,
``recipe.config.checks`` normalises (fills what is decided from other keys) and checks."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import fields
from typing import Any, Iterable, Mapping

import yaml

from megatron_bridge.configs import (YamlLoader, check_keys, dotted, find_config, key_tree, read_yaml, shipped,
                                    typed_fields)
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import LAYOUT_KEYS, layout_from_dict, layout_to_dict
from recipe.config.checks import engine_memory_between_rollouts, normalise, problems
from recipe.config.rules import RULES
from recipe.config.schema import DERIVED_FIELDS, RecipeConfig
from recipe.config.verl import check_equal, translate

# ---- YAML and overrides ----------------------------------------------------------------------


def parse_overrides(args: Iterable[str]) -> dict:
    """``["a.b=c", ...]`` -> ``{"a": {"b": c}}``, values read as YAML (``1e-6``, ``[a,b]``, ``null``).
    Hydra's ``+key`` / ``++key`` (add or force a key), as verl's scripts write them, mean ``key``."""
    out: dict = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        if key.startswith("~"):
            raise ConfigError(f"override {arg!r}: deleting a key (~key) is not supported; leave the key out or set "
                              "it to its default")
        parts = key.strip().lstrip("+").split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {arg!r}: expected key.sub=value, e.g. data.train_batch_size=16")
        try:
            value = yaml.load(text, Loader=YamlLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {arg!r}: the value is not valid YAML: {e}") from e
        for part in reversed(parts):
            value = {part: value}
        out = deep_merge(out, value)
    return out


def deep_merge(base: Mapping, top: Mapping) -> dict:
    """``top`` over ``base``; mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_path(kind: str, ref: str) -> str:
    """A config file named by a path (relative to the current directory first) or a shipped name."""
    found = find_config(kind, ref)
    if found is None:
        raise ConfigError(f"{kind} {ref!r}: no such file or shipped {kind}; shipped: {', '.join(shipped(kind))}")
    return found


# ---- loading ---------------------------------------------------------------------------------


def load_config(path: str, overrides: Iterable[str] = ()) -> RecipeConfig:
    """Compose a recipe with its fragments and overrides, then type and validate it."""
    path = resolve_path("recipe", path)
    recipe = read_yaml(path)
    rest = parse_overrides(overrides)
    refs = {}
    for kind, default in (("algo", RecipeConfig.algo), ("parallel", RecipeConfig.parallel)):
        ref = rest.pop(kind, recipe.pop(kind, default))
        if not isinstance(ref, str):
            raise ConfigError(f"{path}: {kind}={ref!r}: expected a shipped {kind} name or a path")
        refs[kind] = ref
    merged: dict = {}
    for layer in (read_yaml(resolve_path("algo", refs["algo"])),
                  read_yaml(resolve_path("parallel", refs["parallel"])), recipe, rest):
        merged = deep_merge(merged, layer)
    return config_from_dict({**merged, **refs}, name=path)


def config_from_dict(data: Mapping[str, Any], name: str) -> RecipeConfig:
    """Type and validate an already composed config (``name`` labels the errors: the file). verl's
    spellings are translated first (``recipe.config.verl``)."""
    verl = translate(data)
    if verl.errors:
        raise ConfigError(f"{name}: verl keys that do not apply here:\n" + "\n".join(f"  - {e}" for e in verl.errors))
    cfg = _build(verl.data, name, tuple(verl.ignored))
    plain = config_to_dict(cfg)  # defaults filled in, so references to them resolve too
    resolved = _interpolate(plain, name)
    if resolved != plain:
        cfg = _build(resolved, name, tuple(verl.ignored))
    cfg = normalise(cfg, verl.data, name)  # first: the checks read the decided values
    found = check_equal(verl.equal_checks, config_to_dict(cfg)) + problems(cfg, name)
    if found:
        raise ConfigError(f"{name}: invalid config:\n" + "\n".join(f"  - {p}" for p in found))
    return engine_memory_between_rollouts(cfg, name)


def config_to_dict(cfg: RecipeConfig) -> dict:
    """The config in YAML key form, layout keys included (inverse of ``config_from_dict``)."""
    data = {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg) if f.name not in DERIVED_FIELDS}
    return deep_merge(data, layout_to_dict(cfg.layout))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    return list(value) if isinstance(value, list) else value


# ---- typing: dict -> dataclasses (megatron_bridge.configs), the layout keys to the layout -----

_KEYS = key_tree(RecipeConfig, LAYOUT_KEYS, DERIVED_FIELDS)  # every key of a recipe, the layout's included


def _build(data: Mapping[str, Any], name: str, ignored: tuple[str, ...] = ()) -> RecipeConfig:
    check_keys(data, _KEYS, name)
    layout_part: dict = {}
    values = typed_fields(RecipeConfig, data, "", name, RULES, DERIVED_FIELDS, LAYOUT_KEYS, layout_part)
    layout = layout_from_dict(layout_part, name)
    layout_name = os.path.basename(values.get("parallel", RecipeConfig.parallel)).removesuffix(".yaml")
    return RecipeConfig(**values, layout=dataclasses.replace(layout, name=layout_name), ignored=ignored)


# ---- interpolation: ${dotted.key} in string values -------------------------------------------

_REFERENCE = re.compile(r"\$\{([^}]*)\}")


def _interpolate(data: dict, name: str) -> dict:
    """``data`` with every ``${dotted.key}`` in a string replaced by that key's value."""

    def lookup(ref: str, chain: tuple[str, ...]) -> Any:
        if ref in chain:
            raise ConfigError(f"{name}: {chain[0]}: ${{{ref}}} refers back to itself ({' -> '.join(chain + (ref,))})")
        node: Any = data
        for part in ref.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ConfigError(f"{name}: {chain[-1]}: ${{{ref}}} names no config key; write a dotted key such as "
                                  "${trainer.project_name}")
            node = node[part]
        if isinstance(node, (Mapping, list)):
            raise ConfigError(f"{name}: {chain[-1]}: ${{{ref}}} is a section or list; refer to a single value")
        return resolve(node, chain + (ref,))

    def resolve(value: Any, chain: tuple[str, ...]) -> Any:
        if not isinstance(value, str):
            return value
        return _REFERENCE.sub(lambda m: str(lookup(m.group(1), chain)), value)

    def walk(node: Any, key: str) -> Any:
        if isinstance(node, Mapping):
            return {k: walk(v, dotted(key, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        return resolve(node, (key,))

    return walk(data, "")
