"""The vLLM / vLLM-Ascend rollout engine (recipe.rollout.vllm_engine).

Most tests check our side of the boundary without vLLM: the engine arguments built from a layout,
the environment, the sampling-parameter mapping, the conversion of vLLM's outputs (stand-in objects
with the attribute names of vLLM's RequestOutput / CompletionOutput / Logprob; vLLM does not run
there), the weight-stream checks and the error when vLLM is missing. The tests at the end run a
real single-rank engine on the tiny model, colocated and as in a rollout pool of its own; they need
vLLM and a GPU (or vLLM-Ascend and an NPU).
"""

import glob
import importlib.util
import os
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import RolloutParallel, load_layout
from megatron_bridge.plan.model_spec import load_hf_config
from megatron_bridge.tiny_model import save_tiny_checkpoint, tiny_hf_model
from recipe.rollout import vllm_engine as ve
from recipe.rollout import vllm_setup as vs
from recipe.rollout import vllm_weights as vw
from recipe.rollout.base import Generation, SamplingParams, WeightLoadError, check_prompts, request_seed
from tests.distributed import free_port, run_ranks

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = [[5, 17, 300, 41], [9, 88, 7, 130, 250, 3, 61, 11, 400], [77]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), 0)


@pytest.fixture(scope="module")
def hub_tensors(tiny_dir):
    tensors = {}
    for path in sorted(glob.glob(f"{tiny_dir}/*.safetensors")):
        tensors.update(load_file(path))
    return tensors


# -- engine arguments from the layout -----------------------------------------------------------


def test_engine_args_default_layout(tiny_dir):
    args = vs.engine_args(tiny_dir, RolloutParallel(dp=1))
    assert args == {
        "model": tiny_dir,
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": 1,
        "data_parallel_size": 1,
        "enable_expert_parallel": False,
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "max_num_seqs": 1024,
        "seed": 0,
        "enable_sleep_mode": True,
        "enforce_eager": False,
        "load_format": "dummy",
        "logprobs_mode": "processed_logprobs",
        "skip_tokenizer_init": True,
        "disable_custom_all_reduce": True,
        "disable_log_stats": True,
    }


@pytest.mark.parametrize(
    "rollout, tp, dp, expert_parallel",
    [
        (RolloutParallel(tp=4, dp=8, ep=32), 4, 8, True),  # pure EP: EP = TP x DP
        (RolloutParallel(tp=4, dp=2, ep=1), 4, 2, False),  # pure TP: experts sharded over TP x DP = 8
        (RolloutParallel(tp=8, dp=1, ep=8), 8, 1, True),
        (RolloutParallel(tp=1, dp=16, ep=16), 1, 16, True),
    ],
)
def test_engine_args_map_tp_dp_ep(rollout, tp, dp, expert_parallel):
    args = vs.engine_args("/m", rollout)
    assert (args["tensor_parallel_size"], args["data_parallel_size"], args["enable_expert_parallel"]) == (tp, dp, expert_parallel)


def test_engine_args_from_a_shipped_layout_and_overrides():
    rollout = load_layout("qwen3_30b_a3b_4x8_a2").rollout
    args = vs.engine_args(
        "/m", rollout, dtype=torch.float16, max_model_len=4096, seed=7, gpu_memory_utilization=0.6,
        extra={"max_num_batched_tokens": 8192, "enforce_eager": True, "swap_space": None},
    )
    assert (args["tensor_parallel_size"], args["data_parallel_size"], args["enable_expert_parallel"]) == (4, 8, True)
    assert (args["gpu_memory_utilization"], args["max_num_seqs"]) == (0.6, 1024)
    assert (args["dtype"], args["max_model_len"], args["seed"]) == ("float16", 4096, 7)
    assert args["max_num_batched_tokens"] == 8192 and args["enforce_eager"] is True
    assert "swap_space" not in args


def test_mixed_expert_parallel_is_an_error_naming_the_yaml_keys():
    with pytest.raises(ConfigError) as err:
        vs.engine_args("/m", RolloutParallel(tp=4, dp=2, ep=4))
    msg = str(err.value)
    assert "actor_rollout_ref.rollout.expert_parallel_size=4" in msg
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size x actor_rollout_ref.rollout.data_parallel_size = 4 x 2 = 8" in msg
    assert "set expert_parallel_size to 8 or 1" in msg


def test_rollout_must_cover_the_world_and_be_positive():
    vs.check_rollout_parallel(RolloutParallel(tp=2, dp=8, ep=16), world_size=16)
    with pytest.raises(ConfigError, match=r"= 4 x 1 = 4 must equal the rollout ranks' world size 8"):
        vs.check_rollout_parallel(RolloutParallel(tp=4, dp=1), world_size=8)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.data_parallel_size=0 must be a positive integer"):
        vs.check_rollout_parallel(RolloutParallel(dp=0))
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1\.5 must be in \(0, 1\)"):
        vs.check_rollout_parallel(RolloutParallel(dp=1, gpu_memory_utilization=1.5))


# -- environment --------------------------------------------------------------------------------


def test_ascend_env_values():
    env = vs.ascend_env()
    assert env == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_USE_V1": "1",
        "VLLM_ASCEND_ENABLE_NZ": "0",
        "HCCL_HOST_SOCKET_PORT_RANGE": "auto",
        "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
    }
    assert "VLLM_ENABLE_MC2" not in env
    assert vs.rollout_env("cuda") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_apply_env_keeps_and_reports_user_values():
    environ = {"HCCL_HOST_SOCKET_PORT_RANGE": "60000-60050", "VLLM_USE_V1": "1", "PATH": "/bin"}
    report = vs.apply_env(vs.ascend_env(), environ)
    assert report.kept == {"HCCL_HOST_SOCKET_PORT_RANGE": ("60000-60050", "auto")}
    assert report.set == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_ASCEND_ENABLE_NZ": "0",
        "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
    }
    assert environ["HCCL_HOST_SOCKET_PORT_RANGE"] == "60000-60050"
    assert environ["VLLM_ASCEND_ENABLE_NZ"] == "0" and environ["PATH"] == "/bin"


def test_check_env_errors_and_warnings():
    assert vs.check_env("npu", {}) == vs.EnvCheck()
    check = vs.check_env("npu", {"VLLM_ASCEND_ENABLE_NZ": "1", "VLLM_ENABLE_MC2": "1",
                                 "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"})
    assert len(check.errors) == 2 and len(check.warnings) == 1
    assert check.errors[0].startswith("PYTORCH_NPU_ALLOC_CONF='expandable_segments:True'")
    assert check.errors[1].startswith("VLLM_ASCEND_ENABLE_NZ='1': weight sync needs the ND format")
    assert "removed it in June 2025 (PR #1229)" in check.warnings[0]
    cuda = vs.check_env("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:True"})
    assert len(cuda.errors) == 1 and cuda.errors[0].startswith("PYTORCH_CUDA_ALLOC_CONF=")
    assert vs.check_env("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, enable_sleep_mode=False) == vs.EnvCheck()


def test_launcher_env_must_come_from_torchrun():
    vs.check_launcher_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    with pytest.raises(RuntimeError, match=r"^LOCAL_RANK, MASTER_PORT not set"):
        vs.check_launcher_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x"})


# -- sampling parameters ------------------------------------------------------------------------


def test_sampling_params_map_to_vllm_kwargs():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=32, seed=3, stop_token_ids=(7, 2))
    kwargs = ve.vllm_sampling_kwargs(params, eos_token_ids=[2, 151643], index=1, stream=4)
    assert kwargs == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "max_tokens": 32,
        "seed": request_seed(3, 1, 4),
        "stop_token_ids": [2, 7, 151643],
        "logprobs": 0,
        "detokenize": False,
    }
    assert ve.vllm_sampling_kwargs(params, index=1, max_tokens=3)["max_tokens"] == 3  # a continued request's rest
    greedy = ve.vllm_sampling_kwargs(SamplingParams(temperature=0, max_tokens=5))
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"], greedy["seed"], greedy["stop_token_ids"]) == (0, -1, 1.0, None, [])


def test_request_seeds_differ_per_request_and_dp_rank_and_repeat_per_call():
    seeds = {request_seed(3, i, s) for i in range(64) for s in range(4)}
    assert len(seeds) == 256 and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(3, 5, 1) == request_seed(3, 5, 1)
    assert request_seed(3, 1, 0) != request_seed(4, 0, 0)  # consecutive call seeds do not shift onto each other
    assert request_seed(None, 5, 1) is None
    # one sampling stream per TP group: ranks 0-3 and 4-7 with TP=4
    assert [ve.stream_seed(10, r, 4) for r in range(8)] == [10] * 4 + [11] * 4


def test_tokenizer_init_is_skipped_only_without_tokenizer_files(tiny_dir, tmp_path):
    assert vs.has_tokenizer(tiny_dir) is False  # the tiny checkpoint has config and weights only
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert vs.has_tokenizer(str(tmp_path)) is True
    assert vs.engine_args("/m", RolloutParallel(dp=1), skip_tokenizer_init=False)["skip_tokenizer_init"] is False


def test_model_eos_ids_and_prompt_checks(tiny_dir):
    assert vs.model_eos_token_ids(tiny_dir) == {2}
    limit = "engine's max_model_len"
    check_prompts(PROMPTS, [16] * len(PROMPTS), vocab_size=512, max_len=64, limit=limit)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        check_prompts([[1], []], [4, 4], 512, 64, limit)
    with pytest.raises(ValueError, match=r"prompt 0 has token id 512 outside the vocabulary \[0, 512\)"):
        check_prompts([[3, 512]], [4], 512, 64, limit)
    with pytest.raises(ValueError, match="prompt 0: 9 tokens \\+ max_tokens 60 exceed the engine's max_model_len 64"):
        check_prompts([PROMPTS[1]], [60], 512, 64, limit)


# -- output conversion (stand-ins with vLLM's attribute names) -----------------------------------

Logprob = namedtuple("Logprob", "logprob rank decoded_token")


def completion(token_ids, log_probs, finish_reason):
    steps = [{t: Logprob(lp, 1, None), t + 1: Logprob(-9.0, 2, None)} for t, lp in zip(token_ids, log_probs)]
    return SimpleNamespace(index=0, text="", token_ids=token_ids, logprobs=steps, finish_reason=finish_reason)


def request(prompt, *completions):
    return SimpleNamespace(request_id="0", prompt_token_ids=prompt, outputs=list(completions), finished=True)


def test_outputs_become_a_generation():
    outputs = [
        request(PROMPTS[0], completion([10, 11, 2], [-0.5, -1.25, -0.125], "stop")),
        request(PROMPTS[1], completion([30, 31, 32, 33], [-2.0, -0.0, -3.5, -1.0], "length")),
    ]
    assert ve.to_generation(outputs, PROMPTS[:2]) == Generation(
        token_ids=[[10, 11, 2], [30, 31, 32, 33]],
        log_probs=[[-0.5, -1.25, -0.125], [-2.0, -0.0, -3.5, -1.0]],
        finish_reasons=["stop", "length"],
    )
    # plain floats in place of Logprob objects are read too
    plain = SimpleNamespace(token_ids=[4], logprobs=[{4: -0.75}], finish_reason="stop")
    assert ve.to_generation([request([1], plain)]).log_probs == [[-0.75]]
    assert ve.to_generation([], []) == Generation([], [], [])


@pytest.mark.parametrize(
    "broken, message",
    [
        (lambda c: setattr(c, "finish_reason", "abort"), "finished with 'abort'"),
        (lambda c: setattr(c, "finish_reason", None), "finished with None"),
        (lambda c: setattr(c, "logprobs", None), "no log-probs"),
        (lambda c: setattr(c, "logprobs", c.logprobs[:-1]), "2 log-prob entries for 3 tokens"),
        (lambda c: c.logprobs[1].pop(11), "lack the sampled token 11"),
    ],
)
def test_bad_outputs_raise(broken, message):
    c = completion([10, 11, 2], [-0.5, -1.25, -0.125], "stop")
    broken(c)
    with pytest.raises(RuntimeError, match=message):
        ve.to_generation([request(PROMPTS[0], c)], PROMPTS[:1])


def delta(request_id, new, so_far, log_probs, reason=None):
    """A step's output in RequestOutputKind.DELTA: the new tokens, and the log-probs as vLLM slices
    them from the request's list so far (``so_far``, ``log_probs``): all of it when nothing is new."""
    steps = completion(so_far, log_probs, reason).logprobs
    c = completion(new, [], reason)
    c.logprobs = steps[-len(new):] if new else steps
    return SimpleNamespace(request_id=request_id, outputs=[c], finished=reason is not None)


def test_step_outputs_gather_per_request_and_a_pause_returns_them_so_far():
    """The pausable loop's deltas: each request's tokens and log-probs gathered over the steps in
    request order, whatever order the steps report them in; a request vLLM finished keeps its
    reason, one still running at the pause comes back "paused" with its tokens so far."""
    gathered = ve.DeltaOutputs(["a", "b", "c"], PROMPTS)
    gathered.add([delta("b", [30], [30], [-2.0]), delta("a", [10], [10], [-0.5])])
    gathered.add([delta("a", [11, 2], [10, 11, 2], [-0.5, -1.25, -0.125], reason="stop"),
                  delta("b", [], [30], [-2.0]),  # no new token this step: nothing added
                  delta("c", [40], [40], [-0.25])])
    assert gathered.unfinished() == ["b", "c"]
    assert gathered.finished(["a"]) and not gathered.finished(["a", "c"])
    part = ve.to_generation(gathered.outputs(["c", "a"]), [PROMPTS[2], PROMPTS[0]])  # a part's rows, in its order
    assert part.token_ids == [[40], [10, 11, 2]] and part.finish_reasons == ["paused", "stop"]
    generation = ve.to_generation(gathered.outputs(), PROMPTS)
    assert generation == Generation(token_ids=[[10, 11, 2], [30], [40]], log_probs=[[-0.5, -1.25, -0.125], [-2.0], [-0.25]],
                                    finish_reasons=["stop", "paused", "paused"])


def test_outputs_with_routed_experts_become_a_generation():
    """vLLM >= 0.14 reports [tokens, layers, k] from the first prompt token; the recipe keeps the
    tokens the model read (not the last response token), ids ascending, int16."""
    import numpy as np

    c = completion([10, 11, 2], [-0.5, -1.25, -0.125], "stop")
    c.routed_experts = np.array([[[3, 1]], [[0, 2]], [[7, 5]], [[4, 6]], [[1, 0]], [[2, 3]]])  # 3 + 3 tokens, 1 layer
    generation = ve.to_generation([request([5, 6, 7], c)], [[5, 6, 7]], routed_experts=True)
    (table,) = generation.routed_experts
    assert table.dtype == torch.int16 and table.tolist() == [[[1, 3]], [[0, 2]], [[5, 7]], [[4, 6]], [[0, 1]]]
    assert ve.to_generation([request([5, 6, 7], c)], [[5, 6, 7]]).routed_experts is None
    c.routed_experts = np.zeros((4, 1, 2))
    with pytest.raises(RuntimeError, match=r"routed_experts has shape \(4, 1, 2\), expected \[>= 5"):
        ve.to_generation([request([5, 6, 7], c)], [[5, 6, 7]], routed_experts=True)
    del c.routed_experts
    with pytest.raises(RuntimeError, match="no routed_experts"):
        ve.to_generation([request([5, 6, 7], c)], [[5, 6, 7]], routed_experts=True)


def test_routed_experts_need_a_vllm_that_reports_them():
    from dataclasses import dataclass

    @dataclass
    class Old:  # vLLM 0.11's EngineArgs has no such field
        model: str = ""

    @dataclass
    class New:
        enable_return_routed_experts: bool = False

    assert vs.routed_experts_problem(New, "0.14.0") is None
    problem = vs.routed_experts_problem(Old, "0.11.0")
    assert "vLLM 0.11.0" in problem and "enable_rollout_routing_replay=false" in problem and "0.14" in problem
    args = vs.engine_args("/m", RolloutParallel(tp=1, dp=1), return_routed_experts=True)
    assert args["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in vs.engine_args("/m", RolloutParallel(tp=1, dp=1))


def test_outputs_out_of_order_or_with_several_completions_raise():
    a = request(PROMPTS[0], completion([10], [-0.5], "length"))
    b = request(PROMPTS[1], completion([11], [-0.5], "length"))
    with pytest.raises(RuntimeError, match="output 0 belongs to another prompt"):
        ve.to_generation([b, a], PROMPTS[:2])
    with pytest.raises(RuntimeError, match="returned 1 outputs for 2 prompts"):
        ve.to_generation([a], PROMPTS[:2])
    two = request(PROMPTS[0], completion([10], [-0.5], "length"), completion([12], [-0.5], "length"))
    with pytest.raises(RuntimeError, match="2 completions, expected 1"):
        ve.to_generation([two], PROMPTS[:1])


# -- weights ------------------------------------------------------------------------------------


def test_hub_tensor_shapes_are_the_checkpoint_tensors(tiny_dir):
    expected = vw.hub_tensor_shapes(load_hf_config(tiny_dir))
    with safe_open(os.path.join(tiny_dir, "model.safetensors"), "pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert expected == on_disk and len(expected) == 135
    assert expected["model.layers.3.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert expected["model.layers.0.self_attn.k_proj.weight"] == (64, 64)  # 4 KV heads x head_dim 16
    tied = vw.hub_tensor_shapes({**load_hf_config(tiny_dir), "tie_word_embeddings": True})
    assert set(expected) - set(tied) == {"lm_head.weight"}


def test_checked_stream_counts_and_passes_everything_through(tiny_dir, hub_tensors):
    stream = vw.CheckedStream(((n, t.to(torch.bfloat16)) for n, t in hub_tensors.items()), vw.hub_tensor_shapes(load_hf_config(tiny_dir)))
    names = [name for name, _ in stream]
    assert names == list(hub_tensors)
    assert (stream.tensors, stream.bytes) == (135, 1_452_800 // 2)
    assert stream.missing_dense() == []


GATE_0_3 = "model.layers.0.mlp.experts.3.gate_proj.weight"


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda items: items + [("model.layers.4.mlp.gate.weight", items[0][1])], "unexpected tensor 'model.layers.4.mlp.gate.weight'"),
        (lambda items: [(n, t.T if n == GATE_0_3 else t) for n, t in items], f"tensor '{GATE_0_3}' has shape \\(64, 32\\), the model expects \\(32, 64\\)"),
        (lambda items: items[:50] + [items[20]] + items[50:], "appears twice"),
        (lambda items: [(n, t.to(torch.int32) if n == GATE_0_3 else t) for n, t in items], "is not a floating-point"),
    ],
    ids=["unknown", "transposed", "duplicate", "integer"],
)
def test_checked_stream_stops_at_the_bad_tensor(tiny_dir, hub_tensors, corrupt, message):
    stream = vw.CheckedStream(corrupt(list(hub_tensors.items())), vw.hub_tensor_shapes(load_hf_config(tiny_dir)))
    with pytest.raises(WeightLoadError, match=message) as err:
        for _ in stream:
            pass
    assert "the rollout weights are now a mix" in str(err.value)


def test_checked_stream_first_tensor_bad_writes_nothing_and_lists_missing(tiny_dir, hub_tensors):
    expected = vw.hub_tensor_shapes(load_hf_config(tiny_dir))
    with pytest.raises(WeightLoadError, match=r"unexpected tensor 'foo': .*\(nothing was written\)"):
        next(vw.CheckedStream([("foo", torch.zeros(1))], expected))
    stream = vw.CheckedStream([(n, t) for n, t in hub_tensors.items() if ".layers.3." not in n and "lm_head" not in n], expected)
    list(stream)
    missing = stream.missing_dense()
    assert len(missing) == 10 and missing[0] == "model.layers.3.input_layernorm.weight" and missing[-1] == "lm_head.weight"


class FakeFusedMoE(torch.nn.Module):
    """The attributes of vLLM's FusedMoE that the engine reads, with replaced parameters."""

    def __init__(self, experts: int, expert_map=None, local=None):
        super().__init__()
        self.global_num_experts = experts
        self.local_num_experts = local or (experts if expert_map is None else int((expert_map >= 0).sum()))
        self.expert_map = expert_map
        self.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 3), requires_grad=False)  # no weight_loader
        self.w2_weight = torch.nn.Parameter(torch.zeros(2, 3, 2), requires_grad=False)
        self.w2_weight.weight_loader = "kept"

    def weight_loader(self, *args, **kwargs):
        return True


def fake_vllm_model(expert_maps, local=None):
    layers = torch.nn.ModuleList()
    for emap in expert_maps:
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = FakeFusedMoE(4, emap, local)
        layers.append(layer)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = layers
    return model


def test_local_experts_from_the_expert_map_and_missing_ones():
    model = fake_vllm_model([torch.tensor([-1, -1, 0, 1]), None])  # layer 0: EP rank 1 of 2; layer 1: no EP
    experts = vw.local_experts(model)
    assert experts == {0: [2, 3], 1: [0, 1, 2, 3]}
    seen = {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in (2, 3) for p in ("gate_proj", "up_proj", "down_proj")}
    seen |= {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    assert vw.missing_local_experts(experts, seen) == []
    seen.discard("model.layers.0.mlp.experts.3.up_proj.weight")
    assert vw.missing_local_experts(experts, seen) == ["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert vw.local_experts(torch.nn.Linear(2, 2)) is None
    # expert parallel without a readable map (2 of 4 experts here, which ones unknown): not checked
    assert vw.local_experts(fake_vllm_model([None], local=2)) is None


def test_moe_weight_loaders_are_reattached_where_missing():
    model = fake_vllm_model([None, None])
    assert vw.reattach_moe_weight_loaders(model) == 2
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.weight_loader == experts.weight_loader
    assert experts.w2_weight.weight_loader == "kept"
    assert vw.reattach_moe_weight_loaders(model) == 0


def test_model_runner_is_found_on_the_in_process_engine_and_unwrapped():
    model = torch.nn.Linear(2, 2)
    runner = SimpleNamespace(model=SimpleNamespace(runnable=model), sampler=None)  # a CUDAGraphWrapper stand-in
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
    direct = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=executor))
    via_core = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(model_executor=executor))))
    assert ve.find_model_runner(direct) is runner and ve.find_model_runner(via_core) is runner
    assert ve.unwrap_model(runner.model) is model and ve.unwrap_model(model) is model
    with pytest.raises(RuntimeError, match="engine is not in-process"):
        ve.find_model_runner(SimpleNamespace(llm_engine=SimpleNamespace()))
    with pytest.raises(RuntimeError, match="not an nn.Module"):
        ve.unwrap_model(SimpleNamespace())


def test_effective_logprobs_mode():
    assert ve.effective_logprobs_mode(SimpleNamespace(logprobs_mode="processed_logprobs",
                                                      topk_topp_sampler=SimpleNamespace(logprobs_mode="processed_logprobs"))) == "processed_logprobs"
    # vllm-ascend's sampler built without the configured mode (cf. vllm-ascend PR #8643)
    assert ve.effective_logprobs_mode(SimpleNamespace(logprobs_mode="processed_logprobs",
                                                      topk_topp_sampler=SimpleNamespace(logprobs_mode="raw_logprobs"))) == (
        "processed_logprobs (top-k/top-p sampler: raw_logprobs)")
    assert ve.effective_logprobs_mode(SimpleNamespace(logprobs_mode=SimpleNamespace(value="raw_logprobs"))) == "raw_logprobs"
    assert ve.effective_logprobs_mode(None) is None


# -- without vLLM -------------------------------------------------------------------------------


def test_importing_the_module_does_not_import_vllm():
    code = "import sys, recipe.rollout.vllm_engine; assert 'vllm' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.skipif(HAS_VLLM, reason="checks the error on a machine without vLLM")
@pytest.mark.parametrize(
    "platform, command",
    [("cuda", "pip install -e '.[gpu]'"), ("npu", "pip install vllm==0.11.0 vllm-ascend==0.11.0rc1")],
)
def test_missing_vllm_names_the_install_command(tiny_dir, platform, command):
    before = dict(os.environ)
    with pytest.raises(ImportError) as err:
        ve.VLLMEngine(tiny_dir, RolloutParallel(dp=1), platform=platform)
    assert isinstance(err.value, vs.VLLMNotInstalledError)
    assert f"VLLMEngine on {platform} needs vllm" in str(err.value) and command in str(err.value)
    assert dict(os.environ) == before  # nothing set before the check


def test_cpu_platform_points_to_the_hf_engine(tiny_dir):
    with pytest.raises(ValueError, match=r"runs on cuda or npu, not 'cpu'; on the CPU use recipe\.rollout\.hf_engine\.HFEngine"):
        ve.VLLMEngine(tiny_dir, RolloutParallel(dp=1), platform="cpu")


# -- a real engine (vLLM on a GPU, vLLM-Ascend on an NPU) ----------------------------------------


@pytest.fixture(scope="module", params=[pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("npu", marks=pytest.mark.npu)])
def engine(request, tiny_dir):
    """One rank of a colocated engine: torch.distributed started first, as the trainer does."""
    pytest.importorskip("vllm")
    if request.param == "npu":
        pytest.importorskip("vllm_ascend")
        import torch_npu  # noqa: F401

    import torch.distributed as dist

    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = getattr(torch, request.param)
    device.set_device(0)
    dist.init_process_group("hccl" if request.param == "npu" else "nccl")
    engine = ve.VLLMEngine(
        tiny_dir, RolloutParallel(dp=1, gpu_memory_utilization=0.3, max_num_seqs=8), platform=request.param,
        dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
    )
    yield engine
    del engine
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def greedy_reference(model, prompt, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def full_log_probs(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return (logits[len(prompt) - 1 : -1] / temperature).log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_real_engine_refuses_to_generate_on_dummy_weights(engine):
    engine.wake_up()
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(PROMPTS, SamplingParams(max_tokens=4))
    engine.sleep()


def test_real_engine_greedy_after_sync_equals_transformers(engine, hub_tensors):
    assert engine.logprobs_mode == "processed_logprobs"
    stats = engine.load_weights(iter(hub_tensors.items()))  # wakes the weights only
    assert (stats.tensors, stats.bytes) == (135, 1_452_800)
    engine.wake_up()
    reference = tiny_hf_model(0)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    for prompt, tokens, log_probs in zip(PROMPTS, out.token_ids, out.log_probs):
        expected = greedy_reference(reference, prompt, 8)
        stop = next((k + 1 for k, t in enumerate(expected) if t == 2), len(expected))  # the model's EOS ends it
        assert tokens == expected[:stop]
        torch.testing.assert_close(torch.tensor(log_probs), full_log_probs(reference, prompt, tokens, 1.0), rtol=0, atol=1e-3)


def test_real_engine_seeded_sampling_repeats_and_log_probs_are_temperature_scaled(engine):
    params = SamplingParams(temperature=0.7, max_tokens=12, seed=11)
    first = engine.generate(PROMPTS + PROMPTS, params)
    assert engine.generate(PROMPTS + PROMPTS, params) == first
    assert first.token_ids[:3] != first.token_ids[3:]  # repeated prompts get different samples
    reference = tiny_hf_model(0)
    for prompt, tokens, log_probs in zip(PROMPTS, first.token_ids, first.log_probs):
        torch.testing.assert_close(torch.tensor(log_probs), full_log_probs(reference, prompt, tokens, 0.7), rtol=0, atol=1e-3)


def test_real_engine_sleep_wake_keeps_the_weights_and_a_bad_sync_blocks_generation(engine, hub_tensors):
    params = SamplingParams(temperature=0, max_tokens=8)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    engine.wake_up(tags=["weights"])
    engine.wake_up(tags=["kv_cache"])
    assert engine.generate(PROMPTS, params) == before
    items = list(hub_tensors.items())
    with pytest.raises(WeightLoadError, match="unexpected tensor 'model.layers.4.mlp.gate.weight'"):
        engine.load_weights(items[:40] + [("model.layers.4.mlp.gate.weight", items[0][1])] + items[40:])
    with pytest.raises(RuntimeError, match="no complete weights"):
        engine.generate(PROMPTS, params)
    engine.load_weights(items)
    assert engine.generate(PROMPTS, params) == before


def _pool_engine_greedy(rank, world_size, model_dir, files):
    """One rank of a rollout pool of its own: the engine built as a rollout rank of its own builds it (no sleep mode),
    the weights loaded, greedy responses generated; its own process, beside the fixture's engine."""
    from recipe.rollout import ENGINES
    from recipe.rollout.base import EngineArgs

    engine = ENGINES["vllm"].build(EngineArgs(
        model_dir=model_dir, dtype=torch.float32, platform="cuda", rollout=RolloutParallel(dp=1, gpu_memory_utilization=0.3),
        max_model_len=256, seed=0, return_routed_experts=False, engine_kwargs={"enforce_eager": True}, colocated=False))
    engine.load_weights((name, t) for path in files for name, t in load_file(path).items())
    engine.wake_up()  # nothing asleep: a no-op, as RolloutWorker.generate calls it
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    return {"sleep_mode": engine.enable_sleep_mode, "tokens": out.token_ids}


@pytest.mark.gpu
def test_real_engine_in_a_rollout_pool_of_its_own_never_sleeps(tiny_dir, tmp_path):
    pytest.importorskip("vllm")
    files = sorted(glob.glob(os.path.join(tiny_dir, "*.safetensors")))
    (result,) = run_ranks(_pool_engine_greedy, 1, tmp_path, str(tiny_dir), files, platform_name="cuda")
    reference = tiny_hf_model(0)
    assert result["sleep_mode"] is False
    for prompt, tokens in zip(PROMPTS, result["tokens"]):
        expected = greedy_reference(reference, prompt, 8)
        stop = next((k + 1 for k, t in enumerate(expected) if t == 2), len(expected))
        assert tokens == expected[:stop]


def _pool_engine_paused(rank, world_size, model_dir, files):
    """A pausable engine (partial rollout): greedy responses whole, with per-request budgets, and
    paused in their third step then continued; its own process."""
    from recipe.rollout import ENGINES
    from recipe.rollout.base import EngineArgs
    from recipe.rollout.partial import resume

    engine = ENGINES["vllm"].build(EngineArgs(
        model_dir=model_dir, dtype=torch.float32, platform="cuda", rollout=RolloutParallel(dp=1, gpu_memory_utilization=0.3),
        max_model_len=256, seed=0, return_routed_experts=False, engine_kwargs={"enforce_eager": True}, colocated=False,
        pausable=True))
    engine.load_weights((name, t) for path in files for name, t in load_file(path).items())
    params, ids = SamplingParams(temperature=0, max_tokens=8), [0, 1, 2]
    whole = engine.generate(PROMPTS, params, request_ids=ids)
    budgets = engine.generate(PROMPTS, params, request_ids=ids, max_tokens=[2, 5, 8])
    steps = iter(range(1, 100))
    hook = engine.model.register_forward_pre_hook(lambda *_: engine.pause() if next(steps) == 3 else None)
    paused = engine.generate(PROMPTS, params, request_ids=ids)
    hook.remove()
    continued = resume(engine, PROMPTS, ids, params, paused)
    given, forwards = [], []
    hook = engine.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    joined = engine.generate(PROMPTS, params, request_ids=ids, max_tokens=[2, 8, 8], parts=[1, 2],
                             on_part=lambda i, out: given.append([i, len(forwards), out.token_ids]))
    hook.remove()
    return {"whole": whole.token_ids, "joined": joined.token_ids, "given": given,
            "budgets": budgets.token_ids, "paused": paused.token_ids,
            "paused_reasons": paused.finish_reasons, "was_paused": paused.paused,
            "continued": continued.token_ids, "continued_reasons": continued.finish_reasons,
            "whole_reasons": whole.finish_reasons}


@pytest.mark.gpu
def test_real_engine_pauses_between_steps_and_continues_where_it_stopped(tiny_dir, tmp_path):
    """Partial rollout on vLLM: a pause in the third step stops the unfinished requests there (aborted
    in vLLM, 3 tokens each), and continued with the rest of their budgets under the same weights
    they end as the uninterrupted greedy responses. Two calls joined into one give back each part
    at the step its last request ends."""
    pytest.importorskip("vllm")
    files = sorted(glob.glob(os.path.join(tiny_dir, "*.safetensors")))
    (r,) = run_ranks(_pool_engine_paused, 1, tmp_path, str(tiny_dir), files, platform_name="cuda")
    assert r["budgets"] == [t[:n] for t, n in zip(r["whole"], [2, 5, 8])]
    assert r["was_paused"] and "paused" in r["paused_reasons"]
    for tokens, reason, whole in zip(r["paused"], r["paused_reasons"], r["whole"]):
        assert tokens == whole[:len(tokens)] and (reason != "paused" or len(tokens) == 3)
    assert r["continued"] == r["whole"] and r["continued_reasons"] == r["whole_reasons"]
    # a joined call: the first part (2 tokens) given back after its second step, the other at the end
    first = r["whole"][0][:2]
    assert r["given"][0] == [0, len(first), [first]]
    assert r["given"][1][0] == 1 and r["given"][1][1] > len(first) and r["given"][1][2] == r["whole"][1:]
    assert r["joined"] == [r["whole"][0][:2], *r["whole"][1:]]
