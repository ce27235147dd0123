"""The variants a comparison runs, by name, and the recipe overrides each name stands for: what
``runs`` starts and what ``report`` reads back (which config differences a variant's name explains).

A variant is an algorithm (``grpo``, ``gspo``: ``configs/algo``) and optional parts joined by
``_``: ``r2`` / ``r3`` (routing replay), ``tis`` (token-level truncated IS rollout correction),
``asyncK`` (samples up to K policy versions behind the update, K from step K + 1 on: ``async1`` is
``async_training.mode=one_step_off``, K >= 2 ``fully_async`` pushing the weights after every step with
K batches allowed ahead; on a rollout pool of its own as large as the recipe's training pool,
``trainer.nnodes`` x ``n_gpus_per_node``), e.g. ``grpo_r2``, ``gspo_r3``, ``grpo_tis``,
``gspo_async1``, ``gspo_async2``. asyncK also turns the token-level IS correction on (the modes'
default unless the overrides set ``rollout_is``, docs/async.md), so ``gspo_tis`` is its
synchronous counterpart; r3 with asyncK replays the routes the engine chose at generation time, an
earlier policy version's (docs/async.md).

Each run directory of a comparison records its variant and seed in ``variant.json`` (``VARIANT_FILE``).
"""

from __future__ import annotations

import re

from megatron_bridge.errors import ConfigError

ALGOS = ("grpo", "gspo")
VARIANT_PARTS: dict[str, tuple[str, ...]] = {
    "r2": ("actor_rollout_ref.actor.megatron.router_replay.mode=R2",),
    "r3": ("actor_rollout_ref.actor.megatron.router_replay.mode=R3",
           "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"),
    "tis": ("algorithm.rollout_correction.rollout_is=token",),
}
ASYNC_PART = re.compile(r"async(\d+)")  # asyncK: samples up to K policy versions behind (async_overrides)
# the rollout pool an async part gives the variant: as large as the training pool (pool_overrides)
ROLLOUT_POOL_KEYS = ("actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node")
VARIANT_FILE = "variant.json"


def _parts(name: str) -> tuple[str, list[str]]:
    """Variant ``name``'s algorithm and parts, checked."""
    algo, *parts = name.split("_")
    if algo not in ALGOS:
        raise ConfigError(f"variant {name!r}: starts with {algo!r}, expected an algorithm: {', '.join(ALGOS)}")
    stale = [p for p in parts if ASYNC_PART.fullmatch(p)]
    unknown = [p for p in parts if p not in VARIANT_PARTS and p not in stale]
    if unknown or len(set(parts)) < len(parts) or {"r2", "r3"} <= set(parts) or len(stale) > 1:
        raise ConfigError(f"variant {name!r}: parts after the algorithm must be distinct ones of "
                          f"{', '.join(VARIANT_PARTS)}, asyncK (at most one of r2, r3 and one asyncK), e.g. grpo_r2, "
                          "gspo_async2")
    for part in stale:
        _staleness(name, part)
    return algo, parts


def variant_overrides(name: str, training_pool: tuple[int, int]) -> tuple[str, ...]:
    """The recipe overrides that make variant ``name``; ``training_pool`` is the recipe's
    (``trainer.nnodes``, ``trainer.n_gpus_per_node``), the size an async part gives the rollout pool."""
    algo, parts = _parts(name)
    overrides = (f"algo={algo}",)
    for part in parts:
        overrides += VARIANT_PARTS[part] if part in VARIANT_PARTS else async_overrides(_staleness(name, part))
    stale = any(p not in VARIANT_PARTS for p in parts)
    return overrides + (pool_overrides(training_pool) if stale else ())


def variant_keys(name: str | None = None) -> set[str]:
    """The config keys variant ``name``'s overrides set; without a name, those any variant may set
    (async2's set every key async1's do, and the fully asynchronous mode's own)."""
    names = [name] if name is not None else [f"{ALGOS[0]}_{part}" for part in (*VARIANT_PARTS, "async2")]
    return {o.split("=")[0] for n in names for o in variant_overrides(n, (1, 1))}


def _staleness(name: str, part: str) -> int:
    """K of an ``asyncK`` part, at least 1."""
    staleness = int(ASYNC_PART.fullmatch(part).group(1))
    if staleness == 0:
        raise ConfigError(f"variant {name!r}: {part} would be the synchronous run; leave the part out")
    return staleness


def async_overrides(staleness: int) -> tuple[str, ...]:
    """The mode of part ``async{staleness}``: samples up to K = ``staleness`` policy versions behind the
    update that uses them, exactly K from step K + 1 on. K = 1 is one_step_off; K >= 2 is fully_async
    pushing the weights after every step (T = 1) with K batches allowed ahead (staleness_threshold = K),
    whose bound T - 1 + floor(staleness_threshold x T) is K (docs/async.md)."""
    own_pool = "actor_rollout_ref.hybrid_engine=false"
    if staleness == 1:
        return ("async_training.mode=one_step_off", own_pool)
    return ("async_training.mode=fully_async", own_pool, "async_training.trigger_parameter_sync_step=1",
            f"async_training.staleness_threshold={staleness}")


def pool_overrides(training_pool: tuple[int, int]) -> tuple[str, ...]:
    """A rollout pool as large as the training pool: the rollout's TP x DP layout stays the
    synchronous run's, so both generate step 1 alike."""
    return tuple(f"{key}={size}" for key, size in zip(ROLLOUT_POOL_KEYS, training_pool))
