"""Where a layout's process groups sit on the nodes, and what their collectives cost.

Megatron-core 0.12.1 numbers ranks tp-cp-ep-dp-pp (TP fastest, PP slowest; the expert groups
etp-ep-edp-pp), and a launcher gives each node consecutive ranks, so a group of ``size`` members
``stride`` ranks apart has ``min(size, devices_per_node // stride)`` of them on each node.

Costs are bytes one device sends over one link, and seconds at that link's rate (``Rates``):
ring all-gather and reduce-scatter move (n-1)/n of the full buffer through each device, an
all-reduce twice that; a ring that leaves a node runs at the inter-node rate (its slowest link);
an all-to-all sends (n-1)/n of a device's buffer, its intra- and inter-node shares over the two
links at once. Latency is not counted: the model is for large messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.plan.hardware import Rates
from megatron_bridge.plan.layout import Layout


@dataclass(frozen=True)
class Group:
    size: int
    stride: int  # ranks between consecutive members

    def members_per_node(self, devices_per_node: int) -> int:
        return min(self.size, max(1, devices_per_node // self.stride))

    def crosses_nodes(self, devices_per_node: int) -> bool:
        return self.members_per_node(devices_per_node) < self.size


@dataclass(frozen=True)
class Groups:
    """A layout's training groups (the distributed optimizer's dense group is DP*CP)."""

    tp: Group
    cp: Group
    dp: Group  # dense gradients and parameters: DP*CP
    ep: Group
    etp: Group
    edp: Group  # expert gradients and parameters (EP > 1)
    pp: Group

    @classmethod
    def of(cls, layout: Layout) -> "Groups":
        t, w = layout.train, layout.cluster.world_size
        etp = t.expert_tp
        return cls(
            tp=Group(t.tp, 1), cp=Group(t.cp, t.tp), dp=Group(w // (t.tp * t.pp), t.tp),
            ep=Group(t.ep, etp), etp=Group(etp, 1), edp=Group(w // (etp * t.ep * t.pp), etp * t.ep),
            pp=Group(t.pp, w // t.pp),
        )


def ring_bytes(full_bytes: float, n: int) -> float:
    """Bytes through each device in a ring all-gather (or reduce-scatter) whose full buffer is
    ``full_bytes``: (n-1)/n of it."""
    return full_bytes * (n - 1) / n


def link_rate(group: Group, rates: Rates, devices_per_node: int) -> float:
    """Bytes/s of a group's collective: its slowest link."""
    return rates.inter if group.crosses_nodes(devices_per_node) else rates.intra


def ring_seconds(full_bytes: float, group: Group, rates: Rates, devices_per_node: int) -> float:
    return ring_bytes(full_bytes, group.size) / link_rate(group, rates, devices_per_node)


@dataclass(frozen=True)
class AllToAll:
    """The bytes one device sends in an all-to-all of ``local_bytes`` spread evenly over the group:
    to the members on its node (itself excluded) and to the members on other nodes."""

    intra_bytes: float
    inter_bytes: float

    @classmethod
    def of(cls, local_bytes: float, group: Group, devices_per_node: int) -> "AllToAll":
        on_node = group.members_per_node(devices_per_node)
        return cls(local_bytes * (on_node - 1) / group.size, local_bytes * (group.size - on_node) / group.size)

    def seconds(self, rates: Rates) -> float:
        return max(self.intra_bytes / rates.intra, self.inter_bytes / rates.inter)  # both links at once
