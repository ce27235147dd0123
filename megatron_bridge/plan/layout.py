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

import math
import os
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from megatron_bridge.errors import ConfigError
from megatron_bridge.configs import check_keys, find_config, nearest_key, read_yaml, section, shipped, typed_value
from megatron_bridge.plan.platforms import PLATFORMS

NPU_KINDS = ("a2", "a3")
# MindSpeed's context-parallel algorithms (``context_parallel_algo``, branch 2.2.0_core_r0.12.1; the
# names and the files they are declared in: megatron_bridge/runtime/mindspeed.py). Off the NPU the
# package's own CP attention runs, which is megatron_cp_algo's split (megatron's load-balanced chunks).
CP_ALGOS = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo", "adaptive_cp_algo", "hybrid_adaptive_cp_algo")


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
    # How the CP ranks split and attend a sequence (MindSpeed's context_parallel_algo, NPU only; one of
    # CP_ALGOS) and, for hybrid_cp_algo, the Ulysses degree within CP (the ring degree is CP / it).
    cp_algo: str = "megatron_cp_algo"
    ulysses_degree_in_cp: int | None = None

    @property
    def layout_only(self) -> dict[str, Any]:
        """The fields that say where each shard lives, not which kernels compute it (a checkpoint
        written with one set of kernels is the same shards for another; CP splits sequences, not
        weights, so its algorithm is a kernel choice too)."""
        kernels = ("flash_attn", "grouped_gemm", "permute_fusion", "cp_algo", "ulysses_degree_in_cp")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in kernels}

    @property
    def seq_multiple(self) -> int:
        """What a sequence's length must be a multiple of for CP and sequence parallel to split it:
        CP cuts it into 2*CP load-balanced chunks (megatron_cp_algo, hybrid_cp_algo: MindSpeed asks
        2*CP for both) or CP contiguous slices (the Ulysses and adaptive algorithms), and sequence
        parallel cuts each rank's seq_len/CP over TP, so lcm(that, CP*TP) with it."""
        if self.cp == 1:
            chunks = 1
        elif self.cp_algo in ("megatron_cp_algo", "hybrid_cp_algo"):
            chunks = 2 * self.cp
        else:
            chunks = self.cp
        return math.lcm(chunks, self.cp * self.tp if self.sequence_parallel else 1)

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
    # MindSpeed's names: verl hands override_transformer_config to MindSpeed's repatch as it is
    "context_parallel_algo": "cp_algo",
    "ulysses_degree_in_cp": "ulysses_degree_in_cp",
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


# Each YAML section of a layout: its keys -> the fields of its dataclass.
_SECTIONS = {
    "actor_rollout_ref.actor.megatron": (_TRAIN_KEYS, TrainParallel),
    "actor_rollout_ref.actor.megatron.override_transformer_config": (_TRANSFORMER_KEYS, TrainParallel),
    "actor_rollout_ref.rollout": (_ROLLOUT_KEYS, RolloutParallel),
    "trainer": (_CLUSTER_KEYS, Cluster),
}


def _base_type(hint: Any) -> Any:
    return next(a for a in typing.get_args(hint) or (hint,) if a is not type(None))


def _choice(value: str, choices: tuple[str, ...]) -> str | None:
    if value in choices:
        return None
    near = nearest_key(value, choices)
    return (f"did you mean {near}? " if near else "") + f"choose one of {', '.join(choices)}"


# The layout's value rules, by YAML key: every count (sizes, nodes, layers, sequences) at least 1 and
# every number above 0, and the choices.
_BY_TYPE = {
    int: lambda v: None if v >= 1 else "must be a positive integer",
    float: lambda v: None if v > 0 else "must be a positive number",
}
_RULES = {
    **{f"{path}.{key}": _BY_TYPE[tp] for path, (keys, cls) in _SECTIONS.items() for key, f in keys.items()
       if (tp := _base_type(typing.get_type_hints(cls)[f])) in _BY_TYPE},
    "trainer.device": lambda v: None if v in PLATFORMS else f"choose one of {', '.join(PLATFORMS)}",
    "trainer.npu_kind": lambda v: None if v in NPU_KINDS else f"choose one of {', '.join(NPU_KINDS)}",
    "actor_rollout_ref.actor.megatron.override_transformer_config.context_parallel_algo": lambda v: _choice(v, CP_ALGOS),
    "actor_rollout_ref.rollout.gpu_memory_utilization": lambda v: None if 0 < v < 1 else "must be in (0, 1)",
}


def layout_from_dict(data: Mapping[str, Any], name: str) -> Layout:
    check_keys(data, LAYOUT_KEYS, name)
    values: dict[type, dict[str, Any]] = {TrainParallel: {}, RolloutParallel: {}, Cluster: {}}
    for path, (keys, cls) in _SECTIONS.items():
        node, parts = data, path.split(".")
        for i, part in enumerate(parts):
            node = section(node.get(part), ".".join(parts[: i + 1]), name)
        hints = typing.get_type_hints(cls)
        for key, value in node.items():
            if key in keys:  # not override_transformer_config, a section of its own
                values[cls][keys[key]] = typed_value(value, hints[keys[key]], f"{path}.{key}", name, _RULES)
    return Layout(name=name, train=TrainParallel(**values[TrainParallel]),
                  rollout=RolloutParallel(**values[RolloutParallel]), cluster=Cluster(**values[Cluster]))


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


LAYOUT_KEYS = layout_to_dict(Layout(name="keys"))  # the tree of a layout's keys
