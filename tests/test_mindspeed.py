"""MindSpeed's features for the actor on the NPU (``megatron_bridge.runtime.mindspeed``).

What must hold, from MindSpeed 2.2.0_core_r0.12.1 (commit a654440c; the names and the files they were
read in are listed in the module's docstring):

- ``repatch(args)`` only sets the keys it is given, so every switch is always written (a second call
  in the same process turns off what a first one turned on);
- with flash attention MindSpeed's mask feature must stay on (it makes the fused attention causal);
  without it the mask feature must be off, because it would need ``micro_batch_size`` and
  ``seq_length`` and keep one dense mask of that shape for every micro-batch;
- combinations MindSpeed refuses or cannot run fail here first, naming the key;
- the import of ``mindspeed.megatron_adaptor`` does not see the launching command line;
- an installed MindSpeed without ``repatch`` (2.1.0) is an error naming the version needed.

The ``npu`` test checks all of it against the installed MindSpeed on one NPU rank.
"""

import itertools
import sys
import types
from dataclasses import replace

import pytest

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import TrainParallel
from megatron_bridge.runtime import mindspeed

SWITCHES = [dict(flash_attn=f, grouped_gemm=g, permute_fusion=p)
            for f, g, p in itertools.product((True, False), repeat=3)]


def _train(**switches) -> TrainParallel:
    return replace(TrainParallel(), **switches)


@pytest.fixture
def fresh(monkeypatch):
    """No MindSpeed applied in this process yet; fake adaptors go into sys.modules only for the test."""
    monkeypatch.setattr(mindspeed, "_applied", None)
    for name in ("mindspeed", mindspeed.ADAPTOR):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return monkeypatch


def _fake_adaptor(monkeypatch, calls: list | None = None, with_repatch: bool = True):
    package = types.ModuleType("mindspeed")
    adaptor = types.ModuleType(mindspeed.ADAPTOR)
    if with_repatch:
        def repatch(args):
            calls.append(dict(args))
            sys.modules["transformer_engine"] = types.ModuleType("transformer_engine")  # as MindSpeed's pre-patches do

        adaptor.repatch = repatch
    monkeypatch.setitem(sys.modules, "mindspeed", package)
    monkeypatch.setitem(sys.modules, mindspeed.ADAPTOR, adaptor)
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    monkeypatch.setattr(mindspeed, "permute_fusion_available", lambda: True)


# --- the mapping --------------------------------------------------------------------------------


def test_every_switch_is_written_whatever_its_value():
    keys = {frozenset(mindspeed.feature_args(_train(**s))) for s in SWITCHES}
    assert len(keys) == 1
    args = mindspeed.feature_args(_train(flash_attn=False, grouped_gemm=False, permute_fusion=False))
    assert args["use_flash_attn"] is False and args["moe_grouped_gemm"] is False and args["moe_permute_fusion"] is False


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(k for k, v in s.items() if v) or "none")
def test_switches_reach_mindspeed_under_verls_names(switches):
    args = mindspeed.feature_args(_train(**switches))
    assert args["use_flash_attn"] == switches["flash_attn"]
    assert args["moe_grouped_gemm"] == switches["grouped_gemm"]
    assert args["moe_permute_fusion"] == switches["permute_fusion"]
    # only names MindSpeed reads (parser options or feature names, verified on the NPU test)
    assert set(args) <= mindspeed.PARSER_OPTIONS | mindspeed.FEATURE_NAMES


def test_flash_attention_keeps_the_mask_feature_and_no_flash_turns_it_off():
    on = mindspeed.feature_args(_train(flash_attn=True))
    off = mindspeed.feature_args(_train(flash_attn=False))
    # GenerateMaskFeature applies unless no_create_attention_mask_in_dataloader is true: it makes the
    # fused attention causal (sparse_mode 2, the compressed mask), so it must stay with flash attention
    assert not on["no_create_attention_mask_in_dataloader"]
    # without flash attention it would build one dense [micro_batch_size, 1, seq_length, seq_length] mask
    # from those two arguments (or raise without them) and reuse it for micro-batches of every length:
    # it is switched off and neither is ever handed to MindSpeed
    assert off["no_create_attention_mask_in_dataloader"] is True
    for args in (on, off):
        assert "micro_batch_size" not in args and "seq_length" not in args


def test_packed_micro_batches_use_megatrons_packed_seq_params_not_mindspeeds_eod_path():
    args = mindspeed.feature_args(_train(flash_attn=True), packed=True)
    assert args == mindspeed.feature_args(_train(flash_attn=True), packed=False)
    # reset_attention_mask would replace the actor's cu_seqlens with MindSpeed's own data loader's
    assert not args.get("reset_attention_mask")
    with pytest.raises(ConfigError, match="use_flash_attn=true"):
        mindspeed.feature_args(_train(flash_attn=False), packed=True)


def test_combinations_mindspeed_refuses_fail_first_naming_the_key():
    with pytest.raises(ConfigError, match="moe_permute_fusion=false"):
        mindspeed.feature_args(_train(permute_fusion=True), dispatcher="allgather")
    assert mindspeed.feature_args(_train(permute_fusion=True), dispatcher="alltoall")["moe_permute_fusion"]
    with pytest.raises(ConfigError, match="use_flash_attn=true"):
        mindspeed.feature_args(_train(cp=2, flash_attn=False))
    with pytest.raises(ConfigError, match="packed"):
        mindspeed.feature_args(_train(cp=2), packed=True)


def test_context_parallel_size_is_passed_as_verl_passes_it():
    assert mindspeed.feature_args(_train(cp=2))["context_parallel_size"] == 2
    assert mindspeed.feature_args(_train())["context_parallel_size"] == 1  # what MindSpeed reads as unset


def test_the_context_parallel_algorithm_is_always_written():
    # megatron_cp_algo and no Ulysses degree are MindSpeed's own defaults: a second repatch in the same
    # process puts back a first one's hybrid algorithm
    plain = mindspeed.feature_args(_train(cp=2))
    assert (plain["context_parallel_algo"], plain["ulysses_degree_in_cp"]) == ("megatron_cp_algo", None)
    hybrid = mindspeed.feature_args(_train(cp=4, cp_algo="hybrid_cp_algo", ulysses_degree_in_cp=2))
    assert (hybrid["context_parallel_algo"], hybrid["ulysses_degree_in_cp"]) == ("hybrid_cp_algo", 2)
    assert set(hybrid) == set(plain) and {"context_parallel_algo", "ulysses_degree_in_cp"} <= mindspeed.PARSER_OPTIONS
    with pytest.raises(ConfigError, match="context-parallel attention \\(ulysses_cp_algo\\).*use_flash_attn=true"):
        mindspeed.feature_args(_train(cp=2, cp_algo="ulysses_cp_algo", flash_attn=False))


def test_fused_rope_comes_with_the_position_embedding_type_its_check_reads():
    args = mindspeed.feature_args(_train(), fused_elementwise=True)
    assert args["use_fused_rotary_pos_emb"] and args["position_embedding_type"] == "rope"
    plain = mindspeed.feature_args(_train(), fused_elementwise=False)
    assert not (plain["use_fused_rmsnorm"] or plain["use_fused_rotary_pos_emb"] or plain["use_fused_swiglu"])


# --- applying it ---------------------------------------------------------------------------------


def test_apply_hands_the_arguments_to_repatch_once(fresh):
    calls = []
    _fake_adaptor(fresh, calls)
    train = _train(flash_attn=True)
    assert mindspeed.apply(train) == mindspeed.feature_args(train)
    assert mindspeed.apply(train) == calls[0]  # the same switches again: nothing to redo
    assert calls == [mindspeed.feature_args(train)]
    mindspeed.check_applied(train)
    # MindSpeed takes its stand-in transformer_engine out of sys.modules after its own import; so does apply
    assert "transformer_engine" not in sys.modules
    off = _train(flash_attn=False)
    with pytest.raises(ConfigError, match="use_flash_attn=True.*wanted False"):
        mindspeed.check_applied(off)
    mindspeed.apply(off)
    assert calls[-1]["use_flash_attn"] is False and calls[-1]["no_create_attention_mask_in_dataloader"] is True
    mindspeed.check_applied(off)


def test_a_model_built_without_apply_is_an_error(fresh):
    with pytest.raises(ConfigError, match=r"mindspeed.apply\(train\) before initialize_model_parallel"):
        mindspeed.check_applied(_train())


def test_mindspeed_without_repatch_names_the_version_needed(fresh):
    _fake_adaptor(fresh, with_repatch=False)
    with pytest.raises(ConfigError, match=r"repatch.*MindSpeed 2\.2\.0 \(branch 2\.2\.0_core_r0\.12\.1\)"):
        mindspeed.apply(_train())


def test_permute_fusion_without_the_kernels_is_an_error(fresh):
    _fake_adaptor(fresh, [])
    fresh.setattr(mindspeed, "permute_fusion_available", lambda: False)
    with pytest.raises(ConfigError, match="CANN >= 8.3.RC1"):
        mindspeed.apply(_train(permute_fusion=True))


def test_no_mindspeed_installed_is_an_error(fresh, tmp_path):
    fresh.syspath_prepend(str(tmp_path))  # nothing named mindspeed there
    if __import__("importlib").util.find_spec("mindspeed") is not None:
        pytest.skip("MindSpeed is installed here")
    with pytest.raises(ConfigError, match="install MindSpeed from branch 2.2.0_core_r0.12.1"):
        mindspeed.import_adaptor()


def test_the_adaptor_is_imported_without_the_command_line(fresh, tmp_path):
    """MindSpeed parses sys.argv at import: a worker's own flags must not become its features."""
    package = tmp_path / "mindspeed"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "megatron_adaptor.py").write_text("import sys\nSEEN = list(sys.argv)\n")
    fresh.syspath_prepend(str(tmp_path))
    argv = ["default_worker.py", "--use-flash-attn", "--profile", "--redis-password=secret", "-h"]
    fresh.setattr(sys, "argv", argv)
    try:
        adaptor = mindspeed.import_adaptor()
        assert adaptor.SEEN == ["default_worker.py"]
        assert sys.argv is argv  # given back unchanged
        assert mindspeed.import_adaptor() is adaptor  # imported once
    finally:
        for name in (mindspeed.ADAPTOR, "mindspeed"):
            sys.modules.pop(name, None)


# --- on the NPU ------------------------------------------------------------------------------------


def _first_position_logits(micro_batch, output):
    import torch

    return torch.zeros((), device=output.device), {"first": output[:, 0].float(), "second": output[:, 1].float()}


def _npu_rank(rank, world_size, checkpoint, batch):
    from functools import partial

    import torch
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from mindspeed.args_utils import get_full_args, get_mindspeed_args
    from mindspeed.features_manager import MindSpeedFeaturesManager

    from loss.megatron_hook import log_prob_func
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions

    out = {}
    train = TrainParallel()
    args = mindspeed.apply(train)
    # the names, against the installed MindSpeed: its parser's options and its features' names
    options = vars(get_mindspeed_args(get_defaults=True))
    features = {f.feature_name for f in MindSpeedFeaturesManager.FEATURES_LIST}
    out["unknown_names"] = sorted(k for k in args if k not in options and k not in features)
    out["not_options"] = sorted(k for k in mindspeed.PARSER_OPTIONS if k not in options)
    out["not_features"] = sorted(k for k in mindspeed.FEATURE_NAMES if k not in features)
    # MindSpeed's global arguments after repatch
    full = vars(get_full_args())
    out["global_args_differ"] = sorted(k for k, v in args.items() if full.get(k) != v)
    # what the switches did to megatron: the flash forward inside the mask feature's wrapper
    forward = DotProductAttention.forward
    out["flash_forward"] = [forward.__code__.co_filename, getattr(forward, "__wrapped__", forward).__module__]
    out["te_attention_is_local"] = te_extension.TEDotProductAttention is DotProductAttention
    out["transformer_engine_in_sys_modules"] = "transformer_engine" in sys.modules

    initialize_parallel(train)
    spec = load_model_spec(checkpoint)
    actors = {}
    for packed in (False, True):
        actor = MegatronActor(spec, train, BuildOptions(), None, "npu", packed)
        actor.load_hf(checkpoint)
        actors[packed] = actor
    mindspeed.check_applied(train)
    actor = actors[False]
    layer = actor.chunks[0].module.decoder.layers[0]
    out["config"] = {k: getattr(actor.config, k, None)
                     for k in ("use_flash_attn", "moe_grouped_gemm", "use_fused_rmsnorm")}
    out["modules"] = [type(layer.self_attention.core_attention).__name__, type(layer.mlp.experts).__name__,
                      type(layer.mlp.experts.linear_fc1).__name__]

    # causal: the first position's logits do not change when every later token does
    rows = len(batch["input_ids"])
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][:, 1:] = (changed["input_ids"][:, 1:] + 7) % 500 + 3
    a = actor.forward_only(batch, rows, _first_position_logits)
    b = actor.forward_only(changed, rows, _first_position_logits)
    out["causal"] = [float((a["first"] - b["first"]).abs().max()), float((a["second"] - b["second"]).abs().max())]

    log_probs = partial(log_prob_func, 1.0, False)
    padded = actor.forward_only(batch, 2, log_probs)["log_probs"]
    out["finite"] = bool(torch.isfinite(padded).all())
    # packed (TND, actual_seq_qlen from cu_seqlens): changing the first sequence of a packed
    # micro-batch leaves the ones after it alone
    packer = actors[True]
    first = dict(batch, input_ids=batch["input_ids"].clone())
    first["input_ids"][0] = (first["input_ids"][0] + 11) % 500 + 3
    mask = batch["response_mask"].to(padded.device)
    p = packer.forward_only(batch, rows, log_probs)["log_probs"]
    q = packer.forward_only(first, rows, log_probs)["log_probs"]
    delta = (p - q).abs() * mask
    out["packed"] = [float(delta[0].max()), float(delta[1:].max()), float(((p - padded).abs() * mask).max())]

    # flash attention off: megatron's attention with its own causal mask per micro-batch length
    # (micro-batches of several lengths by the token budget), no dense mask from MindSpeed
    off = replace(train, flash_attn=False)
    mindspeed.apply(off)
    forward = DotProductAttention.forward
    out["unfused_forward"] = [forward.__code__.co_filename, hasattr(forward, "__wrapped__")]
    plain = MegatronActor(spec, off, BuildOptions(), None, "npu")
    plain.load_hf(checkpoint)
    lengths = {tuple(mb["input_ids"].shape) for mb in plain.micro_batches(batch, 2, max_tokens=24)}
    unfused = plain.forward_only(batch, 2, log_probs, max_tokens=24)["log_probs"]
    mask = batch["response_mask"].to(unfused.device)
    out["unfused"] = [len(lengths), bool(torch.isfinite(unfused).all()), float(((unfused - padded).abs() * mask).max())]
    return out


@pytest.mark.npu
def test_mindspeed_features_on_one_npu_rank(tmp_path):
    from megatron_bridge.tiny_model import save_tiny_checkpoint
    from tests.distributed import run_ranks
    from tests.test_actor_update import make_batch

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny_hf", seed=1)
    batch = make_batch(checkpoint, 0)
    (r,) = run_ranks(_npu_rank, 1, tmp_path, checkpoint, batch, platform_name="npu")
    assert r["unknown_names"] == r["not_options"] == r["not_features"] == []
    assert r["global_args_differ"] == []
    # flash on: MindSpeed's npu_fusion_attention forward inside its mask feature's causal wrapper
    assert r["flash_forward"][0].endswith("flash_attention/generate_mask/adaptor.py")
    assert r["flash_forward"][1] == "mindspeed.core.transformer.flash_attention.flash_attention.adaptor"
    assert r["te_attention_is_local"] and not r["transformer_engine_in_sys_modules"]
    assert r["config"] == {"use_flash_attn": True, "moe_grouped_gemm": True, "use_fused_rmsnorm": True}
    assert r["modules"] == ["DotProductAttention", "TEGroupedMLP", "MindSpeedTEColumnParallelGroupedLinear"]
    first, second = r["causal"]
    # fp32 on the CPU gives exactly 0 and 5.1 on this batch (SDPA); a bf16 NPU kernel may round per row
    assert second > 0 and first <= 0.1 * second, r["causal"]
    assert r["finite"]
    own, others, _ = r["packed"]
    # CPU fp32 (SDPA over cu_seqlens): 0.23 and 5e-7; a misread boundary moves the next sequence by
    # a share of the first's change
    assert own > 0 and others <= 0.1 * own, r["packed"]
    # flash off: megatron's own forward, several micro-batch lengths, no mask error
    assert r["unfused_forward"][0].endswith("megatron/core/transformer/dot_product_attention.py")
    assert not r["unfused_forward"][1]
    assert r["unfused"][0] > 1 and r["unfused"][1], r["unfused"]
