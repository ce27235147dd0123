"""From files to a ``RecipeConfig``: YAML (with floats as YAML 1.2 reads them), ``key.sub=value``
overrides, the fragments' merge, ``${}`` references, and the typing of a dict into the schema's
dataclasses (unknown keys with the nearest known one, types, the rules). Then, in this order,
``recipe.config.checks`` normalises (fills what is decided from other keys) and checks."""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import fields
from typing import Any, Iterable, Mapping

import yaml

from megatron_bridge.configs import YamlLoader, find_config, read_yaml, shipped
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import layout_from_dict, layout_to_dict, nearest_key
from recipe.config.checks import engine_memory_between_rollouts, normalise, problems
from recipe.config.rules import RULES
from recipe.config.schema import DERIVED_FIELDS, LAYOUT_KEYS, RecipeConfig
from recipe.verl_compat import check_equal, translate

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
    spellings are translated first (``recipe.verl_compat``)."""
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


# ---- typing: dict -> dataclasses -------------------------------------------------------------


def _build(data: Mapping[str, Any], name: str, ignored: tuple[str, ...] = ()) -> RecipeConfig:
    unknown = _unknown_keys(data, RecipeConfig, LAYOUT_KEYS, "")
    if unknown:
        raise ConfigError(f"{name}: {len(unknown)} unknown key(s):\n" + "\n".join(f"  - {u}" for u in unknown))
    layout_part: dict = {}
    values = _typed_fields(RecipeConfig, data, "", LAYOUT_KEYS, layout_part, name)
    layout = layout_from_dict(layout_part, name)
    layout_name = os.path.basename(values.get("parallel", RecipeConfig.parallel)).removesuffix(".yaml")
    return RecipeConfig(**values, layout=dataclasses.replace(layout, name=layout_name), ignored=ignored)


def _unknown_keys(data: Any, cls, layout_keys: Any, key: str) -> list[str]:
    """Every unknown key under ``data`` (the schema ``cls`` and the layout keys), each with the
    nearest known one, so that one error lists them all."""
    if not isinstance(data, Mapping):
        return []  # a non-mapping section is a type error, reported when typing
    schema = {f.name: f for f in fields(cls) if f.name not in DERIVED_FIELDS} if cls is not None else {}
    layout_keys = layout_keys if isinstance(layout_keys, Mapping) else {}
    known = list(schema) + [k for k in layout_keys if k not in schema]
    hints = typing.get_type_hints(cls) if cls is not None else {}
    out = []
    for sub, value in data.items():
        if sub not in known:
            near = nearest_key(sub, known)
            out.append(f"{_join(key, str(sub))}: unknown key; "
                       + (f"did you mean {_join(key, near)}?" if near else f"known keys here: {', '.join(known)}"))
        else:
            nested = hints.get(sub) if dataclasses.is_dataclass(hints.get(sub)) else None
            if nested is not None or isinstance(layout_keys.get(sub), Mapping):
                out += _unknown_keys(value, nested, layout_keys.get(sub, {}), _join(key, sub))
    return out


def _join(key: str, sub: str) -> str:
    return f"{key}.{sub}" if key else sub


def _mapping(data: Any, key: str, name: str) -> Mapping:
    """A section's keys (an absent one has none); its unknown keys were listed before typing began
    (``_unknown_keys``)."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}: {key}={data!r}: expected a mapping of keys")
    return data


def _typed_fields(cls, data: Any, key: str, layout_keys: Mapping, layout_out: dict, name: str) -> dict:
    """The fields of ``cls`` from ``data``, typed and checked; layout keys go to ``layout_out``."""
    data = _mapping(data, key, name)
    schema = {f.name: f for f in fields(cls) if f.name not in DERIVED_FIELDS}
    hints = typing.get_type_hints(cls)
    for sub, value in data.items():
        if sub not in schema:
            layout_out[sub] = _layout_only(value, layout_keys[sub], _join(key, sub), name)
    values = {}
    for sub, f in schema.items():
        sub_key, hint = _join(key, sub), hints[sub]
        if sub in data:
            value = data[sub]
        elif dataclasses.is_dataclass(hint):
            value = {}  # an absent section: its defaults, or an error naming its first required key
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{name}: {sub_key} is required; set it in the recipe or override {sub_key}=...")
        else:
            continue
        if dataclasses.is_dataclass(hint):
            nested_layout = layout_out.setdefault(sub, {}) if sub in layout_keys else {}
            values[sub] = _construct(hint, value, sub_key, layout_keys.get(sub, {}), nested_layout, name)
        else:
            values[sub] = _coerce(value, hint, sub_key, name)
    return values


def _construct(cls, data: Any, key: str, layout_keys: Mapping, layout_out: dict, name: str):
    values = _typed_fields(cls, data, key, layout_keys, layout_out, name)
    try:
        return cls(**values)
    except ValueError as e:  # checks of classes owned elsewhere (OptimConfig, RolloutCorrectionConfig)
        raise ConfigError(f"{name}: {key}: {e}") from e


def _layout_only(value: Any, layout_keys: Any, key: str, name: str) -> Any:
    """A layout leaf as given, or a layout-only section checked key by key."""
    if not isinstance(layout_keys, Mapping):
        return value
    return {sub: _layout_only(v, layout_keys[sub], _join(key, sub), name) for sub, v in _mapping(value, key, name).items()}


def _type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a mapping of keys"
                                                                                             if typing.get_origin(tp) is dict else str(tp))


def _coerce(value: Any, tp: Any, key: str, name: str) -> Any:
    union = isinstance(tp, types.UnionType)
    members = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    expected = " or ".join(_type_name(a) for a in members)
    if value is None:
        if union and type(None) in typing.get_args(tp):
            return None
        raise ConfigError(f"{name}: {key}=null: expected {expected}; set a value or drop the key for the default")
    tp = members[0]
    if len(members) > 1:  # e.g. verl's thresholds: a number or a "lower_upper" string
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        tp = next((a for a in members if (number if a is float else isinstance(value, a))), None)
        if tp is None:
            raise ConfigError(f"{name}: {key}={value!r}: expected {expected}")
    if typing.get_origin(tp) is list:
        items = [value] if isinstance(value, str) else value  # a single file or logger name
        if not isinstance(items, list):
            raise ConfigError(f"{name}: {key}={value!r}: expected a list of strings, e.g. [a, b]")
        value = [_coerce(item, typing.get_args(tp)[0], f"{key}[{i}]", name) for i, item in enumerate(items)]
    elif typing.get_origin(tp) is dict:  # free-form, passed on as it is (engine arguments)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: {key}={value!r}: expected a mapping of keys")
        value = dict(value)
    elif tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: {key}={value!r}: expected {_type_name(tp)}")
    rule = RULES.get(key)
    problem = rule(value) if rule else None
    if problem:
        raise ConfigError(f"{name}: {key}={value!r}: {problem}")
    return value


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
            return {k: walk(v, _join(key, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        return resolve(node, (key,))

    return walk(data, "")
