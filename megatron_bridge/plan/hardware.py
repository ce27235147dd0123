"""What a device computes and moves per second, as the step-time model (``step_time``) needs it.

The figures are data, ``configs/hardware/<name>.yaml``, each with its public source and whether it
is a data-sheet peak or a measurement (and by whom); ``Rates`` turns them into the rates the model
uses: a peak times the achieved fraction the user assumes (``Assumptions``), a measurement as it
is, a command-line override as given. A sheet may also give fixed costs (``Overheads``: a
collective's launch latency, a decoder layer's and the rest of the model's cost per micro-batch
whatever its tokens, an optimizer step's beyond its bytes), which
only a probe on the machine can give (``bench/plan_calibrate.py`` for CPU gloo ranks); a sheet
without them counts none, as the model did before them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from megatron_bridge.configs import check_keys, find_config, key_tree, read_yaml, shipped, typed_fields
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import Cluster

GB = 1e9  # link and memory figures are in GB/s (10^9 bytes), as the sheets give them
KINDS = ("peak", "measured")
BY = ("vendor", "third-party", "probe", "ESTIMATE")  # probe: bench/plan_calibrate.py on the machine itself


@dataclass(frozen=True)
class Figure:
    value: float
    kind: str  # peak: scaled by the assumed achieved fraction; measured: used as it is
    by: str  # vendor | third-party | probe | ESTIMATE
    source: str


@dataclass(frozen=True)
class Overheads:
    """Fixed costs the rates leave out, measured on the machine (``by: probe``); absent: 0.
    On accelerators they are microseconds against milliseconds of work; on CPU gloo ranks with a
    tiny model they are most of a step."""

    collective_latency_us: float = 0.0  # one collective (or p2p send) whatever its bytes: t = latency + bytes / rate
    layer_forward_us: float = 0.0  # one decoder layer's forward of one micro-batch, beyond its FLOPs at the rate
    layer_backward_us: float = 0.0  # the same for its backward
    # a micro-batch's work outside the decoder layers (embedding, output layer, log-probs), beyond the
    # output layer's FLOPs
    micro_batch_forward_us: float = 0.0
    micro_batch_backward_us: float = 0.0
    # a decoder layer's forward (backward) under TP (EP) beyond the layer's: what the sequence-parallel
    # gathers and scatters (the MoE dispatcher) add outside their collectives, and smaller GEMMs' lower
    # rate; measured at TP2 (EP2), taken for any TP (EP) > 1
    tp_layer_forward_us: float = 0.0
    tp_layer_backward_us: float = 0.0
    ep_layer_forward_us: float = 0.0
    ep_layer_backward_us: float = 0.0
    # one optimizer step beyond its Adam bytes at the memory rate, its parameter all-gather and its
    # layers' share below (the clip, Python over the parameter groups, the metric sums)
    optimizer_step_us: float = 0.0
    # a decoder layer's share of an optimizer step beyond its Adam bytes (work tensor by tensor: the
    # update and the gradient norm loop over the parameters where no fused kernel takes them all);
    # measured at the probe's DP, taken for any
    optimizer_layer_us: float = 0.0
    # the ranks measured share the cores, at least two a core: a rank that waits (a pipeline stage in
    # the bubble) leaves its core to the others (step_time.bubble_seconds)
    ranks_share_cores: bool = False
    by: str = "probe"
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    """One node type (``configs/hardware/*.yaml``); per device; links one direction."""

    device: str  # npu | cuda | cpu, as trainer.device
    bf16_tflops: Figure
    hbm_gb_s: Figure
    intra_node_gb_s: Figure
    inter_node_gb_s: Figure
    npu_kind: str | None = None
    overheads: Overheads = Overheads()
    name: str = ""


_FIGURES = ("bf16_tflops", "hbm_gb_s", "intra_node_gb_s", "inter_node_gb_s")
_CHECKS = {
    "value": lambda v: None if v > 0 else "must be a positive number",
    "kind": lambda v: None if v in KINDS else f"choose one of {', '.join(KINDS)}",
    "by": lambda v: None if v in BY else f"choose one of {', '.join(BY)}",
}
_RULES = {f"{figure}.{key}": check for figure in _FIGURES for key, check in _CHECKS.items()}
_RULES |= {f"overheads.{f.name}": (lambda v: None if v >= 0 else "must be >= 0")
           for f in fields(Overheads) if f.name.endswith("_us")}
_RULES["overheads.by"] = _CHECKS["by"]


def load_hardware(ref: str) -> Hardware:
    """A hardware sheet by shipped name (``atlas_800t_a2``) or path."""
    path = find_config("hardware", ref)
    if path is None:
        raise ConfigError(f"hardware {ref!r}: no such file; shipped: {', '.join(shipped('hardware'))}")
    data = read_yaml(path)
    name = os.path.basename(path).removesuffix(".yaml")
    check_keys(data, key_tree(Hardware, skip=("name",)), path)
    return Hardware(**typed_fields(Hardware, data, "", path, _RULES, skip=("name",)), name=name)


def hardware_for(cluster: Cluster) -> Hardware | None:
    """The shipped sheet for a cluster's device (an NPU without a kind is taken as an A2; CUDA as
    an H100); None for CPU ranks, whose rates only a probe on the machine could give."""
    if cluster.device == "npu":
        return load_hardware("atlas_800_a3" if cluster.npu_kind == "a3" else "atlas_800t_a2")
    if cluster.device == "cuda":
        return load_hardware("h100")
    return None


@dataclass(frozen=True)
class Assumptions:
    """What the model assumes and the user may switch (``plan check/search --mfu`` and the rest)."""

    mfu: float = 0.4  # ESTIMATE: the share of peak bf16 the model's kernels reach (MoE training: 0.25-0.45 is usual)
    link_efficiency: float = 0.8  # ESTIMATE: the share of a link's peak a collective reaches (NCCL's bus bandwidth)
    hbm_efficiency: float = 0.8  # ESTIMATE: the share of peak memory bandwidth decoding reaches
    # megatron's overlap_grad_reduce / overlap_param_gather: off in this project's actor
    # (megatron_bridge.runtime.actor builds DistributedDataParallelConfig without them)
    overlap_grad_sync: bool = False


@dataclass(frozen=True)
class Overrides:
    """Rates given on the command line, used as they are (a measurement of your own): GB/s for
    the links and memory; TFLOPS peak (the MFU still applies)."""

    tflops: float | None = None
    hbm_gb_s: float | None = None
    intra_node_gb_s: float | None = None
    inter_node_gb_s: float | None = None


@dataclass(frozen=True)
class Rates:
    """The rates the model divides by: FLOP/s and bytes/s per device, one direction for links."""

    flops: float
    hbm: float
    intra: float
    inter: float
    hardware: str  # the sheet's name, or "command line"
    latency: float = 0.0  # seconds per collective launch (Overheads)
    layer_forward: float = 0.0  # seconds per decoder layer and micro-batch, forward (Overheads)
    layer_backward: float = 0.0  # the same, backward
    tp_layer_forward: float = 0.0  # seconds a decoder layer's forward adds under TP > 1 (Overheads)
    tp_layer_backward: float = 0.0  # the same, backward
    ep_layer_forward: float = 0.0  # seconds a decoder layer's forward adds under EP > 1 (Overheads)
    ep_layer_backward: float = 0.0  # the same, backward
    micro_batch_forward: float = 0.0  # seconds per micro-batch outside the layers, forward (Overheads)
    micro_batch_backward: float = 0.0  # the same, backward
    optimizer_step: float = 0.0  # seconds per optimizer step beyond its bytes (Overheads)
    optimizer_layer: float = 0.0  # seconds per decoder layer of the stage and optimizer step (Overheads)
    ranks_share_cores: bool = False  # (Overheads)

    @classmethod
    def of(cls, hw: Hardware | None, assume: Assumptions, given: Overrides = Overrides()) -> "Rates | None":
        """None when neither the sheet nor the command line gives every rate."""

        def rate(figure: Figure | None, efficiency: float, unit: float) -> float | None:
            if figure is None:
                return None
            return figure.value * unit * (efficiency if figure.kind == "peak" else 1.0)

        def given_or(override: float | None, figure: Figure | None) -> Figure | None:
            return figure if override is None else Figure(override, "measured", "command line", "")

        # --tflops is a peak (the MFU applies, as to a sheet's peak); the other overrides are as achieved
        tflops = hw and hw.bf16_tflops if given.tflops is None else Figure(given.tflops, "peak", "command line", "")
        values = (
            rate(tflops, assume.mfu, 1e12),
            rate(given_or(given.hbm_gb_s, hw and hw.hbm_gb_s), assume.hbm_efficiency, GB),
            rate(given_or(given.intra_node_gb_s, hw and hw.intra_node_gb_s), assume.link_efficiency, GB),
            rate(given_or(given.inter_node_gb_s, hw and hw.inter_node_gb_s), assume.link_efficiency, GB),
        )
        if any(v is None for v in values):
            return None
        fixed = hw.overheads if hw else Overheads()
        return cls(*values, hardware=hw.name if hw else "command line", latency=fixed.collective_latency_us * 1e-6,
                   layer_forward=fixed.layer_forward_us * 1e-6, layer_backward=fixed.layer_backward_us * 1e-6,
                   tp_layer_forward=fixed.tp_layer_forward_us * 1e-6, tp_layer_backward=fixed.tp_layer_backward_us * 1e-6,
                   ep_layer_forward=fixed.ep_layer_forward_us * 1e-6, ep_layer_backward=fixed.ep_layer_backward_us * 1e-6,
                   micro_batch_forward=fixed.micro_batch_forward_us * 1e-6,
                   micro_batch_backward=fixed.micro_batch_backward_us * 1e-6,
                   optimizer_step=fixed.optimizer_step_us * 1e-6,
                   optimizer_layer=fixed.optimizer_layer_us * 1e-6, ranks_share_cores=fixed.ranks_share_cores)
