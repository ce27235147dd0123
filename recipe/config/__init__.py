"""The recipe config: YAML composition, command-line overrides, typed and validated.

A recipe (``configs/recipe/*.yaml``) names two fragments and adds its own keys::

    parallel: qwen3_30b_a3b_2x16_a3     # configs/parallel/<name>.yaml or a path
    algo: gspo                          # configs/algo/<name>.yaml or a path
    data: {...}
    actor_rollout_ref: {...}

Merge order, later wins (dicts merge deeply): the algo fragment, the parallel fragment, the
recipe's own keys, then ``key.sub=value`` overrides (``parallel=`` / ``algo=`` overrides switch
the fragment). Key names and meanings are verl's (``ppo_megatron_trainer.yaml``). The layout keys
(``actor_rollout_ref.actor.megatron``, the rollout's parallel sizes, ``trainer.nnodes`` ...) are
not duplicated here: they become ``RecipeConfig.layout`` through ``megatron_bridge.plan.layout``.

String values may refer to other keys as ``${trainer.project_name}`` (the run directory does).

This module owns loading and checking: unknown keys (with the nearest known key), types, choices,
verl's batch arithmetic, and the layout against the model with the planner's rules, each failure a
``ConfigError`` naming the key and the fix.

One concern a module: ``schema`` (the dataclasses), ``rules`` (each value's rule), ``load`` (YAML,
overrides, references, typing), ``checks`` (normalise, then check across keys), ``verl`` (verl's
key spellings, translated before the typing).
"""

from megatron_bridge.configs import read_yaml
from recipe.config.load import config_from_dict, config_to_dict, deep_merge, load_config, parse_overrides, resolve_path
from recipe.config.checks import actor_budget, layout_verdict, model_spec
from recipe.config.rules import seed_rule
from recipe.config.schema import (
    BUILTIN_TASKS,
    BUILTIN_TINY,
    ActorConfig,
    ActorRolloutRefConfig,
    AsyncTrainingConfig,
    DataConfig,
    FilterGroupsConfig,
    ModelConfig,
    RecipeConfig,
    TrainerConfig,
    builtin_task,
)

__all__ = [
    "BUILTIN_TASKS", "BUILTIN_TINY", "ActorConfig", "ActorRolloutRefConfig", "AsyncTrainingConfig", "DataConfig",
    "FilterGroupsConfig", "ModelConfig", "RecipeConfig", "TrainerConfig", "actor_budget", "builtin_task",
    "config_from_dict", "config_to_dict", "deep_merge", "layout_verdict", "load_config", "model_spec",
    "parse_overrides", "read_yaml", "resolve_path", "seed_rule",
]
