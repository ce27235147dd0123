"""Parallel layouts: ``configs/parallel/*.yaml``.

A layout YAML is a fragment of the recipe config with verl's key names, so it composes into a
full recipe unchanged and a verl user finds the same keys::

    trainer: {nnodes, n_gpus_per_node, device, npu_kind, device_memory_gb}
    actor_rollout_ref:
      actor:
        megatron: {tensor_model_parallel_size, pipeline_model_parallel_size, ...}
      rollout: {tensor_model_parallel_size, data_parallel_size, expert_parallel_size,
                gpu_memory_utilization, nnodes, n_gpus_per_node}

The rollout's ``nnodes`` / ``n_gpus_per_node`` give it devices of its own (verl's separate rollout
pool); left out, the rollout runs on the training devices.

Unknown keys are errors that name the nearest known key.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from megatron_bridge.errors import ConfigError
from megatron_bridge.configs import CONFIGS_DIR, find_config, read_yaml, shipped
from megatron_bridge.plan.platforms import PLATFORMS

NPU_KINDS = ("a2", "a3")


@dataclass(frozen=True)
class TrainParallel:
    """Megatron-core training parallelism (``actor_rollout_ref.actor.megatron``)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None  # megatron's default: the same as TP
    cp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    use_distributed_optimizer: bool = True
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    recompute_granularity: str | None = None  # full | selective | None
    recompute_method: str | None = None  # uniform | block (full only)
    recompute_num_layers: int | None = None
    # The compute paths (verl's override_transformer_config switches; docs/kernels.md): what runs
    # where is resolved on the device by megatron_bridge.runtime.kernels.
    flash_attn: bool = True  # fused attention linear in s (TE / MindSpeed / torch SDPA); false: megatron's local one
    grouped_gemm: bool = True  # the local experts as grouped GEMMs; false: megatron's SequentialMLP loop
    permute_fusion: bool = False  # fused token permutation (Transformer Engine >= 2.1 or MindSpeed only)

    @property
    def layout_only(self) -> dict[str, Any]:
        """The fields that say where each shard lives, not which kernels compute it (a checkpoint
        written with one set of kernels is the same shards for another)."""
        kernels = ("flash_attn", "grouped_gemm", "permute_fusion")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in kernels}

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


@dataclass(frozen=True)
class RolloutParallel:
    """Rollout engine parallelism (``actor_rollout_ref.rollout``), vLLM semantics: with expert
    parallel on, EP = TP x DP; off, experts are tensor-sharded over TP x DP."""

    tp: int = 1
    dp: int | None = None  # None: the rollout's device count / TP, as verl derives it
    ep: int = 1
    # the rollout's own pool (verl's actor_rollout_ref.hybrid_engine=false); None: the training devices
    nnodes: int | None = None
    devices_per_node: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1024  # sequences per engine step; sizes the MC2 buffer


@dataclass(frozen=True)
class Cluster:
    nnodes: int = 1
    devices_per_node: int = 1
    device: str = "cpu"
    npu_kind: str | None = None  # a2 | a3, decides MC2
    device_memory_gb: float | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.devices_per_node


@dataclass(frozen=True)
class Layout:
    name: str
    train: TrainParallel = field(default_factory=TrainParallel)
    rollout: RolloutParallel = field(default_factory=RolloutParallel)
    cluster: Cluster = field(default_factory=Cluster)
    _rollout_dp_derived: bool = field(default=False, repr=False, compare=False)

    @property
    def separate_rollout(self) -> bool:
        """The rollout runs on devices of its own, not on the training devices."""
        return self.rollout.devices_per_node is not None

    @property
    def rollout_world_size(self) -> int:
        """The rollout's devices: its own pool, or the training devices (colocated)."""
        r = self.rollout
        return (r.nnodes or 1) * r.devices_per_node if self.separate_rollout else self.cluster.world_size

    def __post_init__(self) -> None:
        if self.rollout.dp is None:  # derived from the device count; a TP that does not divide it fails validation
            dp = max(1, self.rollout_world_size // self.rollout.tp)
            object.__setattr__(self, "rollout", replace(self.rollout, dp=dp))
            object.__setattr__(self, "_rollout_dp_derived", True)

    def with_cluster(self, **overrides: Any) -> "Layout":
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, cluster=replace(self.cluster, **given), rollout=self._rollout_to_rederive())

    def with_rollout_pool(self, nnodes: int, devices_per_node: int) -> "Layout":
        """The rollout on a pool of its own, ``nnodes`` x ``devices_per_node`` devices."""
        rollout = replace(self._rollout_to_rederive(), nnodes=nnodes, devices_per_node=devices_per_node)
        return replace(self, rollout=rollout)

    def _rollout_to_rederive(self) -> RolloutParallel:
        """The rollout with a derived DP cleared, so that a new device count derives it again."""
        return replace(self.rollout, dp=None) if self._rollout_dp_derived else self.rollout


# YAML key -> dataclass field, per section. verl's names where verl has the setting.
_TRAIN_KEYS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "virtual_pipeline_model_parallel_size": "vpp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "context_parallel_size": "cp",
    "sequence_parallel": "sequence_parallel",
    "num_layers_in_first_pipeline_stage": "first_stage_layers",
    "num_layers_in_last_pipeline_stage": "last_stage_layers",
    "account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "param_offload": "param_offload",
    "grad_offload": "grad_offload",
    "optimizer_offload": "optimizer_offload",
}
# actor.megatron.override_transformer_config: megatron TransformerConfig settings that are not layout
_TRANSFORMER_KEYS = {
    "recompute_granularity": "recompute_granularity",
    "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
    "use_flash_attn": "flash_attn",
    "moe_grouped_gemm": "grouped_gemm",
    "moe_permute_fusion": "permute_fusion",
}
_ROLLOUT_KEYS = {
    "tensor_model_parallel_size": "tp",
    "data_parallel_size": "dp",
    "expert_parallel_size": "ep",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_num_seqs": "max_num_seqs",
    "nnodes": "nnodes",
    "n_gpus_per_node": "devices_per_node",
}
_CLUSTER_KEYS = {
    "nnodes": "nnodes",
    "n_gpus_per_node": "devices_per_node",
    "device": "device",
    "npu_kind": "npu_kind",
    "device_memory_gb": "device_memory_gb",
}


def nearest_key(key: str, known: list[str]) -> str | None:
    """The known key a misspelt ``key`` most likely meant, if any is close."""
    near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
    return near[0] if near else None


def check_keys(section: Mapping[str, Any], known: list[str], where: str) -> None:
    """Raise for the first unknown key, naming the nearest known one."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(section).__name__}")
    for key in section:
        if key not in known:
            near = nearest_key(key, known)
            hint = f"; did you mean {near!r}?" if near else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"{where}.{key}: unknown key{hint}")


def _typed(cls, values: Mapping[str, Any], where: str):
    types = {f.name: f.type for f in fields(cls)}
    out = {}
    for name, value in values.items():
        kind = types[name]
        if value is None:
            if "None" not in kind:
                raise ConfigError(f"{where}: {name} must be set")
        elif kind.startswith("int"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {name}={value!r} must be a positive integer")
        elif kind.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{where}: {name}={value!r} must be a positive number")
            value = float(value)
        elif kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{where}: {name}={value!r} must be true or false")
        out[name] = value
    return cls(**out)


def _section(data: Mapping[str, Any], path: list[str], where: str) -> Mapping[str, Any]:
    node: Any = data
    for key in path:
        node = node.get(key) or {} if isinstance(node, Mapping) else {}
        where = f"{where}.{key}" if where else key
        check_keys(node, list(_CHILDREN.get(key, ())) or list(node), where)
    return node


# Which keys each nesting level may hold.
_CHILDREN = {
    "trainer": list(_CLUSTER_KEYS),
    "actor_rollout_ref": ["actor", "rollout"],
    "actor": ["megatron"],
    "megatron": list(_TRAIN_KEYS) + ["override_transformer_config"],
    "override_transformer_config": list(_TRANSFORMER_KEYS),
    "rollout": list(_ROLLOUT_KEYS),
}


def _pick(section: Mapping[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    return {mapping[k]: v for k, v in section.items() if k in mapping}


def layout_from_dict(data: Mapping[str, Any], name: str) -> Layout:
    check_keys(data, ["trainer", "actor_rollout_ref"], name)
    megatron = _section(data, ["actor_rollout_ref", "actor", "megatron"], name)
    transformer = _section(megatron, ["override_transformer_config"], f"{name}.actor_rollout_ref.actor.megatron")
    rollout = _section(data, ["actor_rollout_ref", "rollout"], name)
    cluster = _section(data, ["trainer"], name)
    train_values = {**_pick(megatron, _TRAIN_KEYS), **_pick(transformer, _TRANSFORMER_KEYS)}
    layout = Layout(
        name=name,
        train=_typed(TrainParallel, train_values, f"{name}: actor_rollout_ref.actor.megatron"),
        rollout=_typed(RolloutParallel, _pick(rollout, _ROLLOUT_KEYS), f"{name}: actor_rollout_ref.rollout"),
        cluster=_typed(Cluster, _pick(cluster, _CLUSTER_KEYS), f"{name}: trainer"),
    )
    if layout.cluster.device not in PLATFORMS:
        raise ConfigError(f"{name}: trainer.device={layout.cluster.device!r}; choose one of {', '.join(PLATFORMS)}")
    if layout.cluster.npu_kind not in (None, *NPU_KINDS):
        raise ConfigError(f"{name}: trainer.npu_kind={layout.cluster.npu_kind!r}; choose one of {', '.join(NPU_KINDS)}")
    if not 0 < layout.rollout.gpu_memory_utilization < 1:
        raise ConfigError(f"{name}: actor_rollout_ref.rollout.gpu_memory_utilization must be in (0, 1)")
    return layout


def shipped_layouts() -> list[str]:
    return [os.path.join(CONFIGS_DIR, "parallel", f"{name}.yaml") for name in shipped("parallel")]


def load_layout(path: str) -> Layout:
    found = find_config("parallel", path)
    if found is None:
        raise ConfigError(f"parallel layout {path!r}: no such file; shipped layouts: {', '.join(shipped('parallel'))}")
    return layout_from_dict(read_yaml(found), name=os.path.basename(found).removesuffix(".yaml"))


def layout_to_dict(layout: Layout) -> dict[str, Any]:
    """The YAML form of a layout (inverse of layout_from_dict)."""
    t, r, c = layout.train, layout.rollout, layout.cluster
    inv = lambda mapping, obj: {k: getattr(obj, v) for k, v in mapping.items()}  # noqa: E731
    megatron = inv(_TRAIN_KEYS, t)
    megatron["override_transformer_config"] = inv(_TRANSFORMER_KEYS, t)
    return {
        "trainer": inv(_CLUSTER_KEYS, c),
        "actor_rollout_ref": {"actor": {"megatron": megatron}, "rollout": inv(_ROLLOUT_KEYS, r)},
    }
