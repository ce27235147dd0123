"""Where the shipped YAMLs live: ``configs/`` at the top of a source checkout (and of an editable
install), installed beside this module as ``megatron_bridge/shipped_configs`` by ``pip install .``
(setup.py maps the one folder onto the other), so a run finds them from any directory; the one
YAML reader of every config (recipes, fragments, layouts, models, overrides); and the one typing of
a config's mapping into frozen dataclasses, which the recipe's loader (``recipe.config.load``) and
the layout loader (``megatron_bridge.plan.layout``) both use, each with its own value rules."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Callable, Iterable, Mapping

import yaml

from megatron_bridge.errors import ConfigError

_HERE = os.path.dirname(os.path.abspath(__file__))
_INSTALLED = os.path.join(_HERE, "shipped_configs")
CONFIGS_DIR = _INSTALLED if os.path.isdir(_INSTALLED) else os.path.join(os.path.dirname(_HERE), "configs")


def shipped(kind: str) -> list[str]:
    """Names of the YAMLs in configs/<kind>/ (kind: recipe, algo, parallel, model, runtime_env, hardware)."""
    return sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(CONFIGS_DIR, kind)) if f.endswith(".yaml"))


def shipped_paths(kind: str) -> list[str]:
    """The paths of the YAMLs in configs/<kind>/."""
    return [os.path.join(CONFIGS_DIR, kind, f"{name}.yaml") for name in shipped(kind)]


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


# ---- typing: a mapping -> dataclasses --------------------------------------------------------
# Keys first (every unknown one listed at once, with the nearest known key), then each value typed
# by its field's annotation and checked by the loader's rule for its dotted key, so that an error
# names the key. Call the typing after check_keys: it reads only known keys.

Rules = Mapping[str, Callable[[Any], "str | None"]]  # dotted key -> the requirement a bad value misses, or None


def nearest_key(key: Any, known: Iterable[str]) -> str | None:
    """The known key a misspelt ``key`` most likely meant, if any is close."""
    near = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.5)
    return near[0] if near else None


def dotted(key: str, sub: Any) -> str:
    return f"{key}.{sub}" if key else str(sub)


def key_tree(cls, other: Any = None, skip: tuple[str, ...] = ()) -> dict:
    """The keys of the dataclass ``cls`` as a tree (a section: a dict of its keys; a leaf: anything
    else), with ``other``'s keys (another loader's tree) merged in under the same sections; the
    fields named in ``skip`` are built while loading, not keys."""
    other = other if isinstance(other, Mapping) else {}
    hints = typing.get_type_hints(cls)
    tree = {f.name: key_tree(hints[f.name], other.get(f.name), skip) if dataclasses.is_dataclass(hints[f.name])
            else other.get(f.name) for f in dataclasses.fields(cls) if f.name not in skip}
    return {**tree, **{k: v for k, v in other.items() if k not in tree}}


def unknown_keys(data: Any, known: Mapping, key: str = "") -> list[str]:
    """Every key under ``data`` that the tree ``known`` lacks, each with the nearest known one."""
    if not isinstance(data, Mapping):
        return []  # a section that is not a mapping is a type error, reported when typing
    out = []
    for sub, value in data.items():
        if sub not in known:
            near = nearest_key(sub, known)
            out.append(f"{dotted(key, sub)}: unknown key; "
                       + (f"did you mean {dotted(key, near)}?" if near else f"known keys here: {', '.join(known)}"))
        elif isinstance(known[sub], Mapping):
            out += unknown_keys(value, known[sub], dotted(key, sub))
    return out


def check_keys(data: Any, known: Mapping, name: str) -> None:
    """A ``ConfigError`` listing every unknown key under ``data`` (``name`` labels it: the file)."""
    unknown = unknown_keys(data, known)
    if unknown:
        raise ConfigError(f"{name}: {len(unknown)} unknown key(s):\n" + "\n".join(f"  - {u}" for u in unknown))


def section(data: Any, key: str, name: str) -> Mapping:
    """A section's keys (an absent or null one has none)."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}: {key}={data!r}: expected a mapping of keys")
    return data


def typed_fields(cls, data: Any, key: str, name: str, rules: Rules, skip: tuple[str, ...] = (),
                 other: Mapping | None = None, other_out: dict | None = None) -> dict:
    """The fields of the dataclass ``cls`` from the section ``data`` at ``key``: nested sections
    built into their dataclasses, values typed and checked by ``rules``; a required field left out
    is an error. The keys in ``other`` (another loader's tree, e.g. the layout's keys in a recipe)
    are copied into ``other_out`` as given, for that loader to type."""
    data = section(data, key, name)
    other = other if isinstance(other, Mapping) else {}
    schema = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    hints = typing.get_type_hints(cls)
    for sub, value in data.items():
        if sub not in schema:
            other_out[sub] = _as_given(value, other[sub], dotted(key, sub), name)
    values = {}
    for sub, f in schema.items():
        sub_key, hint = dotted(key, sub), hints[sub]
        if sub in data:
            value = data[sub]
        elif dataclasses.is_dataclass(hint):
            value = {}  # an absent section: its defaults, or an error naming its first required key
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{name}: {sub_key} is required; set it in the recipe or override {sub_key}=...")
        else:
            continue
        if dataclasses.is_dataclass(hint):
            nested_out = other_out.setdefault(sub, {}) if sub in other else {}
            nested = typed_fields(hint, value, sub_key, name, rules, skip, other.get(sub), nested_out)
            try:
                values[sub] = hint(**nested)
            except ValueError as e:  # the dataclass's own checks that no rule names (OptimConfig's across fields)
                raise ConfigError(f"{name}: {sub_key}: {e}") from e
        else:
            values[sub] = typed_value(value, hint, sub_key, name, rules)
    return values


def _as_given(value: Any, other: Any, key: str, name: str) -> Any:
    """Another loader's leaf as given, or its section checked to be one, key by key."""
    if not isinstance(other, Mapping):
        return value
    return {sub: _as_given(v, other[sub], dotted(key, sub), name) for sub, v in section(value, key, name).items()}


def type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a mapping of keys"
                                                                                             if typing.get_origin(tp) is dict else str(tp))


def typed_value(value: Any, tp: Any, key: str, name: str, rules: Rules) -> Any:
    """``value`` as the annotation ``tp`` says (an int where a float is wanted becomes a float),
    then checked by the rule for ``key`` (a null, where allowed, is checked by none)."""
    union = isinstance(tp, types.UnionType)
    members = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    expected = " or ".join(type_name(a) for a in members)
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
        value = [typed_value(item, typing.get_args(tp)[0], f"{key}[{i}]", name, rules) for i, item in enumerate(items)]
    elif typing.get_origin(tp) is dict:  # free-form, passed on as it is (engine arguments)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: {key}={value!r}: expected a mapping of keys")
        value = dict(value)
    elif tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: {key}={value!r}: expected {type_name(tp)}")
    rule = rules.get(key)
    problem = rule(value) if rule else None
    if problem:
        raise ConfigError(f"{name}: {key}={value!r}: {problem}")
    return value
