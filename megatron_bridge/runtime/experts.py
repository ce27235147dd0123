"""The local experts of an MoE layer as grouped GEMMs, for megatron's local spec (no Transformer
Engine, no ``grouped_gemm`` package).

megatron-core 0.12.1 without TE runs the experts as ``SequentialMLP``: a Python loop of two small
matmuls per local expert (23x slower than one grouped GEMM for 128 experts on an H100,
docs/kernels.md). Its grouped alternative without TE, the legacy ``GroupedMLP``, needs the
``grouped_gemm`` package and stores each expert transposed, so its optimizer state cannot be read
as ``SequentialMLP``'s. Here all local experts' weights are stacked in ``SequentialMLP``'s own
orientation and computed with ``torch._grouped_mm`` where the torch build and device run it, a
loop over the experts where they don't.

Parameters (``mlp.experts.`` in a decoder layer):

- ``fc1_weight`` [E_local, 2 x I / ETP, H]: expert e's ``linear_fc1.weight`` ([gate; up], this
  ETP rank's rows of each), as ``SequentialMLP``'s ``local_experts.{e}.linear_fc1.weight``;
- ``fc2_weight`` [E_local, H, I / ETP]: expert e's ``linear_fc2.weight``.

The numbers are ``SequentialMLP``'s: fc1, SwiGLU, times the router's probability (in the
activation's dtype, as megatron's ``MLP`` does), fc2; no communication (the token dispatcher
reduces over expert TP).

Checkpoints are ``SequentialMLP``'s too: ``sharded_state_dict`` gives exactly the sharded tensors
and objects it gives (per global expert, gate and up halves apart), through a factory on each
stacked parameter that megatron's distributed optimizer also calls with its flat shards of the
fp32 main parameter and Adam moments. A checkpoint written with either expert layout therefore
loads into the other under any parallel layout, optimizer state included.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import expert_dist_ckpt_decorator
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import divide, make_tp_sharded_tensor_for_checkpoint

from megatron_bridge.runtime.platform import to_device

# (device type, dtype) -> whether torch._grouped_mm ran forward and backward there
_GROUPED_MM_RUNS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_path() -> str:
    """What computes the grouped GEMMs with this torch, in words."""
    if hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm, a loop over experts where the device or dtype lacks it"
    return f"a loop over experts: torch {torch.__version__} has no torch._grouped_mm"


def _grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on this device and dtype (tried once
    on a small problem: support differs by torch release, GPU generation and dtype)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_RUNS:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
                w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
                torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(torch.ones(16, 16, device=device, dtype=dtype))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM_RUNS[key] = ok
    return _GROUPED_MM_RUNS[key]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``torch._grouped_mm``'s
    backward refuses other strides)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def expert_offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The groups' end rows (cumulative counts, int32) on ``device`` for ``torch._grouped_mm``.
    megatron's dispatchers hand the counts over in host memory: copied up without a wait."""
    return to_device(tokens_per_expert.cumsum(0).to(torch.int32), device)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int],
                   offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``x`` [T, K] in groups of ``tokens_per_expert`` (one per expert, in order), each
    times its expert's ``weight[e]`` [N, K] transposed: [T, N]. ``offsets``: the counts'
    ``expert_offsets`` on x's device, when the caller has them already."""
    aligned = all((n * weight.element_size()) % 16 == 0 for n in weight.shape[1:])
    if x.shape[0] and aligned and _grouped_mm_runs(x.device, x.dtype):
        if offsets is None:
            offsets = expert_offsets(torch.tensor(tokens_per_expert), x.device)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))
    if not x.shape[0]:  # no tokens: an empty product that still gives every weight a (zero) gradient
        return x @ weight.sum(0).t()
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(tokens_per_expert), weight)])


class GroupedExperts(MegatronModule):
    """``num_local_experts`` SwiGLU experts as two grouped GEMMs; a stand-in for megatron's
    ``SequentialMLP`` / ``GroupedMLP`` in an ``MoELayer`` (``MoESubmodules.experts``)."""

    def __init__(self, num_local_experts: int, config, submodules=None):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.add_bias_linear or config.moe_apply_probs_on_input:
            raise ValueError("GroupedExperts computes gated experts without bias, the router's probabilities "
                             "applied to their output (Qwen3-MoE's SwiGLU experts)")
        self.num_local_experts = num_local_experts
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        ffn = divide(config.moe_ffn_hidden_size, etp)
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        shape1, shape2 = (num_local_experts, 2 * ffn, config.hidden_size), (num_local_experts, config.hidden_size, ffn)
        self.fc1_weight = torch.nn.Parameter(torch.empty(shape1, device=device, dtype=config.params_dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(shape2, device=device, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                for e in range(num_local_experts):
                    config.init_method(self.fc1_weight[e])
                    config.output_layer_init_method(self.fc2_weight[e])
        expert_parallel = config.expert_model_parallel_size > 1
        # the attributes SequentialMLP's expert linears carry (column- and row-parallel over expert TP)
        for weight, dim in ((self.fc1_weight, 1), (self.fc2_weight, 2)):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
            weight.allreduce = not expert_parallel
        self.register_load_state_dict_post_hook(_accept_sequential_extra_state)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        counts = tokens_per_expert.tolist()
        offsets = expert_offsets(tokens_per_expert, hidden.device)  # once for both products
        fc1 = grouped_linear(hidden, self.fc1_weight, counts, offsets)
        gate, up = torch.chunk(fc1, 2, dim=-1)
        activated = self.config.activation_func(gate) * up
        activated = (activated * probs.unsqueeze(-1)).to(activated.dtype)
        return grouped_linear(activated, self.fc2_weight, counts, offsets), None

    @expert_dist_ckpt_decorator  # megatron's TP rank and size read as expert TP's while it runs
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """``SequentialMLP.sharded_state_dict``'s sharded tensors and objects, exactly: for each local
        expert e (global ``first + e``) its ``linear_fc1.weight`` (split into gate and up halves
        by ``apply_swiglu_sharded_factory``) and ``linear_fc2.weight`` under the keys
        ``{prefix}experts.linear_fc{1,2}.weight`` with the global expert as a prepended axis, and
        the linears' (empty) ``_extra_state`` objects, which ``SequentialMLP`` reads back."""
        first = parallel_state.get_expert_model_parallel_rank() * self.num_local_experts
        total = parallel_state.get_expert_model_parallel_world_size() * self.num_local_experts
        offsets = [(*sharded_offsets, (len(sharded_offsets), first + e, total)) for e in range(self.num_local_experts)]
        expert_dp = parallel_state.get_expert_data_parallel_rank()
        # SequentialMLP's replica ids: weights replicated over expert DP only, extra states over expert TP too
        replica_id = (0, 0, expert_dp)
        extra_replica_id = (0, parallel_state.get_tensor_model_parallel_rank(), expert_dp)
        state = {}
        for name, fc, tp_axis in (("fc1_weight", "linear_fc1", 0), ("fc2_weight", "linear_fc2", 1)):
            weight = getattr(self, name)
            key = f"{prefix}experts.{fc}.weight"
            # made now, while the TP state reads as expert TP's: the factory builds at save and load
            experts = [make_tp_sharded_tensor_for_checkpoint(weight[e], key, tp_axis, replica_id, prepend_offsets=o)
                       for e, o in enumerate(offsets)]
            build = partial(_build_expert_shards, experts, offsets if fc == "linear_fc1" else None)
            state[f"{prefix}{name}"] = ShardedTensorFactory(key, weight, build, _merge_expert_shards, replica_id)
            for e, o in enumerate(offsets):
                state[f"{prefix}local_experts.{e}.{fc}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{fc}._extra_state", o, extra_replica_id)
        return state


def _build_expert_shards(experts: list[ShardedTensor], swiglu_offsets: list[tuple] | None, key: str,
                         stacked: torch.Tensor, replica_id, flattened_range: slice | None) -> list[list[ShardedTensor]]:
    """A stacked parameter's (or its optimizer state's) sharded tensors, per local expert: each
    expert's as ``SequentialMLP`` gives it (``experts``), holding that expert's part of ``stacked``
    (the whole [E, out, in] tensor, or a flat range of it, as the distributed optimizer's shard may
    cover parts of several experts); fc1's split in gate and up halves (``swiglu_offsets``: the
    expert's sharded offsets)."""
    per_expert = experts[0].data.numel()
    out = []
    for e, expert in enumerate(experts):
        if flattened_range is None:
            data, local_range = stacked[e], None
        else:
            start = max(flattened_range.start, e * per_expert)
            stop = min(flattened_range.stop, (e + 1) * per_expert)
            if start >= stop:
                continue
            data = stacked[start - flattened_range.start : stop - flattened_range.start]
            local_range = slice(start - e * per_expert, stop - e * per_expert)
        shard = replace(expert, key=key, data=data, dtype=data.dtype, replica_id=replica_id,
                        flattened_range=local_range)
        out.append(apply_swiglu_sharded_factory(shard, swiglu_offsets[e]).build() if swiglu_offsets else [shard])
    return out


@torch.no_grad()
def _merge_expert_shards(per_expert: list[list[torch.Tensor]]) -> torch.Tensor:
    """Inverse of ``_build_expert_shards``: the stacked tensor, or the flat range, back in one piece."""
    experts = [torch.cat(halves) for halves in per_expert]
    return torch.cat(experts) if experts[0].dim() == 1 else torch.stack(experts)


_SEQUENTIAL_EXTRA_STATE = re.compile(r"(^|\.)local_experts\.\d+\.linear_fc[12]\._extra_state$")


def _accept_sequential_extra_state(module: torch.nn.Module, incompatible_keys) -> None:
    """A loaded checkpoint holds the ``_extra_state`` objects ``sharded_state_dict`` gives for
    ``SequentialMLP``'s linears; they hold nothing and have no counterpart here."""
    unexpected = incompatible_keys.unexpected_keys
    unexpected[:] = [k for k in unexpected if not _SEQUENTIAL_EXTRA_STATE.search(k)]
