"""The planner's exact memory terms equal what megatron-core 0.12.1 really allocates: build the tiny
Qwen3-MoE with megatron on CPU gloo ranks, wrap it in megatron's DDP and distributed optimizer,
take one optimizer step (which creates the Adam states), and sum the bytes of every storage."""

import pytest
import torch

from megatron_bridge.plan import memory
from megatron_bridge.plan.layout import Cluster, Layout, TrainParallel
from megatron_bridge.plan.model_spec import load_model_spec
from tests.distributed import run_ranks


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _measure(rank, world_size, train_kwargs):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions, build_model_chunks

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    spec = load_model_spec("tiny_qwen3_moe")
    config, chunks = build_model_chunks(spec, train, BuildOptions(params_dtype=torch.bfloat16), "cpu")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    models = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True), models)
    optimizer.zero_grad()
    optimizer.step()  # creates exp_avg / exp_avg_sq
    params = [p for m in models for p in m.parameters()]
    states = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.shard_fp32_from_float16_groups:
            states += group
        for state in opt.optimizer.state.values():
            states += [v for v in state.values() if torch.is_tensor(v)]
    layout = Layout("measured", train=train, cluster=Cluster(nnodes=1, devices_per_node=world_size))
    estimate = memory.static_memory(
        spec, layout, ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank(),
    )
    return {
        "actual": [_storage_bytes(params), _storage_bytes([p.main_grad for p in params]), _storage_bytes(states)],
        "estimate": [estimate.weights, estimate.grads, estimate.optimizer],
        "worst_of_stage": memory.static_memory(spec, layout, ps.get_pipeline_model_parallel_rank()).total,
    }


LAYOUTS = {  # grouped experts (the default: two stacked parameters per layer) unless named sequential
    "dp2": (2, dict()),
    "ep2": (2, dict(ep=2, etp=1)),
    "tp2_sp_ep2_etp1": (4, dict(tp=2, ep=2, etp=1, sequence_parallel=True)),
    "pp2_vpp2": (4, dict(pp=2, vpp=2)),
    "tp2_pp2_etp2": (4, dict(tp=2, pp=2, etp=2, sequence_parallel=True)),
    "ep4": (4, dict(ep=4, etp=1)),
    # megatron's SequentialMLP: two parameters per expert
    "dp2_sequential": (2, dict(grouped_gemm=False)),
    "ep2_sequential": (2, dict(ep=2, etp=1, grouped_gemm=False)),
    "tp2_pp2_etp2_sequential": (4, dict(tp=2, pp=2, etp=2, sequence_parallel=True, grouped_gemm=False)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_static_memory_equals_megatron_allocation(name, tmp_path):
    world_size, train_kwargs = LAYOUTS[name]
    results = run_ranks(_measure, world_size, tmp_path, train_kwargs)
    for rank, r in enumerate(results):
        assert r["actual"] == r["estimate"], f"rank {rank}: allocated {r['actual']} != estimated {r['estimate']}"
        assert r["actual"][2] > 0 and r["actual"][0] > 0
        assert sum(r["actual"]) <= r["worst_of_stage"]
