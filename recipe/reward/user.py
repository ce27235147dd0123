"""Loading a user's reward function from a Python file (verl's ``custom_reward_function.path/name``).

The file is imported once, before training, and the function's signature is checked then, so a
typo fails at start rather than at the first reward.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable

from .errors import RewardConfigError

# verl calls reward functions with these keywords; files written for verl work unchanged.
REWARD_FN_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
_MODULE_NAME = "custom_reward_module"  # registered in sys.modules, so dataclasses and pickling inside it work


def _setting(path: str, name: str) -> str:
    return f"custom_reward_function.path={path} custom_reward_function.name={name}"


def _import_file(path: str, name: str):
    if not os.path.isfile(path):
        raise RewardConfigError(f"{_setting(path, name)}: no such file; point path at the .py file that defines the function")
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise RewardConfigError(f"{_setting(path, name)}: not a Python source file; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise RewardConfigError(f"{_setting(path, name)}: importing the file failed: {type(err).__name__}: {err}") from err
    return module


def load_reward_function(path: str, name: str = "compute_score") -> Callable:
    """The callable ``name`` defined in the Python file ``path``, checked to accept
    ``(data_source, solution_str, ground_truth, extra_info)`` as keywords."""
    module = _import_file(path, name)
    if not hasattr(module, name):
        functions = sorted(
            attr
            for attr, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == _MODULE_NAME and not attr.startswith("_")
        )
        raise RewardConfigError(
            f"{_setting(path, name)}: the file has no {name!r} (its functions: {', '.join(functions) or 'none'}); fix the name"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardConfigError(f"{_setting(path, name)}: {name!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(REWARD_FN_PARAMETERS))
    except TypeError as err:
        raise RewardConfigError(
            f"{_setting(path, name)}: {name}{inspect.signature(fn)} cannot be called with the keywords "
            f"{', '.join(REWARD_FN_PARAMETERS)} ({err}); give it those parameters"
        ) from err
    return fn
