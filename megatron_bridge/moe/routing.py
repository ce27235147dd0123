"""Routing capture and replay on megatron-core's ``TopKRouter``, in any TP/SP/PP/VPP/EP/ETP layout.

megatron-core 0.12.1 has no router replay (``RouterReplay`` arrives in 0.16). Here one wrapper
around ``TopKRouter.routing`` -- installed once per process, around whatever routing is in place,
so MindSpeed's replacement (``routing_tp_extend_ep``) is wrapped too -- hands each routing result
of the routers a ``RoutingTap`` is attached to, with the router's logits, to that tap. The tap

- records the experts each token went to (capture), in the layout-independent form of
  ``megatron_bridge.moe.table`` (row, position, layer, k);
- forces given experts (replay): the gate weights are the router's probabilities at the replayed
  experts, computed from this forward's logits the way the router computes them (Qwen3-MoE's
  ``norm_topk_prob``: a softmax over the k chosen logits), so the router keeps its gradient.

Tokens reach a router as [s, b] flattened sequence-major; with context parallel each CP rank routes
its held positions of s, and with sequence parallel each TP rank its 1/TP slice of those. The actor announces each micro-batch around its model call
(``micro_batch``); a routing call outside that is activation recompute during the backward pass,
which replays the experts that micro-batch's forward used: first in, first out per router, the
order in which megatron's schedules run a stage's backward passes.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_bridge.moe.table import NONE, ROUTING_DTYPE, RoutingRecord, changed_slots, empty_routing
from megatron_bridge.runtime.batch import (HELD_POSITIONS, RESPONSE_ENDS, ROUTED_EXPERTS, ROW_INDEX, SEQUENCE_STARTS,
                                           packed_places)


_wrapped = False


def install() -> None:
    """Wrap ``TopKRouter.routing`` (once per process; routers without a tap are untouched)."""
    global _wrapped
    if _wrapped:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    inner = TopKRouter.routing

    def routing(self, logits: torch.Tensor):
        probs, routing_map = inner(self, logits)
        tap = getattr(self, "routing_tap", None)
        return (probs, routing_map) if tap is None else tap.on_routing(self, logits, probs, routing_map)

    TopKRouter.routing = routing
    _wrapped = True


def replay_problems(config) -> list[str]:
    """Why routing replay cannot run with this TransformerConfig (empty: it can)."""
    out = []
    if config.moe_expert_capacity_factor is not None:
        out.append("moe_expert_capacity_factor is set: dropping tokens by capacity would undo the replayed routing")
    if config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff:
        out.append("a load-balancing aux loss is on: its gradient hangs on the routing that replay replaces")
    if config.moe_z_loss_coeff:
        out.append("the router z-loss is on: its gradient hangs on the routing that replay replaces")
    if config.moe_router_score_function not in ("softmax", "sigmoid"):
        out.append(f"score function {config.moe_router_score_function!r}")
    return out


def sorted_topk(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """[tokens, experts] bool (exactly k per token, as dropless routing gives: ``topk_miscounted``)
    -> [tokens, k] ids, ascending. A stable sort puts each token's chosen experts first, in order,
    without reading anything back from the device."""
    return routing_map.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :topk]


def topk_miscounted(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """0-dim: how many tokens of ``routing_map`` are not routed to exactly ``topk`` experts."""
    return (routing_map.sum(dim=1) != topk).sum()


def replayed_gates(logits: torch.Tensor, experts: torch.Tensor, config) -> torch.Tensor:
    """[tokens, k] gate weights at ``experts`` [tokens, k] from router ``logits`` [tokens, E],
    as megatron-core's top-k routing computes them for the experts it picks itself."""
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            gates = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits).gather(1, experts)
        else:
            gates = torch.softmax(logits.gather(1, experts), dim=-1, dtype=torch.float32).type_as(logits)
    else:  # sigmoid; an expert bias only steers the choice, it is not in the weights
        gates = torch.sigmoid(logits.float()).type_as(logits).gather(1, experts)
        if experts.shape[1] > 1:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor:
        gates = gates * config.moe_router_topk_scaling_factor
    return gates


@dataclass
class _MicroBatch:
    rows: torch.Tensor | None  # [b] row indices in the pass's batch (capture)
    token_rows: torch.Tensor  # [tokens] in router order: the micro-batch row of each token this rank routes
    token_positions: torch.Tensor  # [tokens]: its position in that row's sequence
    valid: torch.Tensor  # [tokens] bool: a real token, before its row's response end
    targets: dict[int, torch.Tensor]  # layer number -> [tokens, k] experts to replay (-1: keep)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer number -> [tokens, k]


@dataclass
class _Outcome:
    record: RoutingRecord | None = None


class RoutingTap:
    """Capture and replay for the routers of one model (``chunks``: its pipeline chunks)."""

    def __init__(self, chunks: list[torch.nn.Module], topk: int, sequence_parallel: bool):
        from megatron.core.transformer.moe.router import TopKRouter

        install()
        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.routing_tap = self
        self.layers = sorted(int(r.layer_number) for r in self.routers)  # 1-based, megatron's numbering
        self.topk = topk
        self.sequence_parallel = sequence_parallel
        self._fifo: dict[int, deque] = {layer: deque() for layer in self.layers}
        self._pops = dict.fromkeys(self.layers, 0)
        self._pass: dict | None = None
        self._micro: _MicroBatch | None = None
        self._replay_checked = False

    # --- one pass ------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self, rows: int, width: int, *, capture: bool, replay: bool, training: bool) -> Iterator[_Outcome]:
        """Around one pass over a batch of ``rows`` x ``width`` tokens: ``capture`` records the
        router's choices, ``replay`` forces the micro-batches' ``routed_experts``, ``training``
        marks a pass with a backward (whose recompute replays again). The outcome's ``record``
        is set when the pass ends."""
        self._begin(rows, width, capture, replay, training)
        outcome = _Outcome()
        try:
            yield outcome
        except BaseException:
            self._pass = None
            raise
        outcome.record = self._end()

    def _begin(self, rows: int, width: int, capture: bool, replay: bool, training: bool) -> None:
        if replay and not self._replay_checked:
            problems = replay_problems(self.routers[0].config) if self.routers else []
            if problems:
                raise ValueError("routing replay cannot run with this model config: " + "; ".join(problems))
            self._replay_checked = True
        device = self.routers[0].weight.device if self.routers else torch.device("cpu")
        zeros = lambda dtype: torch.zeros(len(self.layers), dtype=dtype, device=device)  # noqa: E731
        self._pass = dict(rows=rows, width=width, capture=capture, replay=replay, training=training, chunks=[],
                          tokens=zeros(torch.long), overridden=zeros(torch.long), entropy=zeros(torch.float64),
                          topk_mass=zeros(torch.float64), miscounted=zeros(torch.long))
        for queue in self._fifo.values():
            queue.clear()
        self._pops = dict.fromkeys(self.layers, 0)

    def _end(self) -> RoutingRecord:
        """Finish the pass; checks that a recomputed layer replayed every forward exactly once."""
        p, self._pass = self._pass, None
        for layer, queue in self._fifo.items():
            if self._pops[layer] and queue:
                raise RuntimeError(f"routing replay: layer {layer - 1} was recomputed {self._pops[layer]} times but "
                                   f"ran {self._pops[layer] + len(queue)} forwards; the recompute would not replay "
                                   "the routing of its forward")
            queue.clear()
        miscounted = p["miscounted"].tolist()
        if any(miscounted):
            raise RuntimeError(f"routing chose other than {self.topk} experts for {sum(miscounted)} tokens (capture "
                               "and replay need dropless routing: no capacity factor)")
        routing = None
        if p["capture"]:
            routing = empty_routing(p["rows"], p["width"], len(self.layers), self.topk)
            for chunk in p["chunks"]:  # each micro-batch's, kept on the device until now: one copy each
                index, values = _captured(*(t.cpu() for t in chunk[:5]), chunk[5], self.layers)
                routing[index] = values
        return RoutingRecord(
            layers=[layer - 1 for layer in self.layers], routing=routing, tokens=p["tokens"].cpu(),
            overridden_slots=p["overridden"].cpu(), entropy=p["entropy"].cpu(), topk_mass=p["topk_mass"].cpu(),
        )

    @contextlib.contextmanager
    def micro_batch(self, micro_batch: dict[str, torch.Tensor], seq_len: int) -> Iterator[None]:
        """Around one micro-batch's model call (``micro_batch`` as the actor cuts it, ``seq_len``
        tokens a sequence, with its rows' ``row_index`` and ``response_ends``; packed, one sequence
        of its rows back to back, ``sequence_starts``)."""
        if self._pass is None:
            yield
            return

        ends = micro_batch[RESPONSE_ENDS]
        token_rows, token_positions, real = _router_tokens(micro_batch, seq_len, self.sequence_parallel)
        valid = real & (token_positions < ends[token_rows])
        width = self._pass["width"]
        within = real & (token_positions < width)  # the actor pads the tokens to a multiple of TP
        targets = {}
        if self._pass["replay"] and ROUTED_EXPERTS in micro_batch:
            experts = micro_batch[ROUTED_EXPERTS].to(ends.device)
            per_token = experts[token_rows, token_positions.clamp(max=experts.shape[1] - 1)].long()
            replayable = within & (token_positions < experts.shape[1])
            per_token = torch.where(replayable[:, None, None], per_token, NONE)  # [tokens, layers, k]
            mine = [layer - 1 for layer in self.layers]
            _check_targets(per_token[:, mine], self.routers[0].num_experts, mine)
            for layer in self.layers:
                targets[layer] = per_token[:, layer - 1]
        self._micro = _MicroBatch(micro_batch.get(ROW_INDEX), token_rows, token_positions, valid, targets)
        try:
            yield
        finally:
            micro, self._micro = self._micro, None
        if self._pass["capture"] and micro.captured:
            # per micro-batch and model chunk (with VPP a chunk runs some of this rank's layers), on the
            # device until the pass ends: copying it to the host here would wait for the device
            layers = sorted(micro.captured)
            stacked = torch.stack([micro.captured[layer] for layer in layers], dim=1).to(ROUTING_DTYPE)
            self._pass["chunks"].append((micro.rows, micro.token_rows, micro.token_positions, within, stacked, layers))

    # --- the routing wrapper calls this ---------------------------------------------------

    def on_routing(self, router, logits: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        p, micro = self._pass, self._micro
        if p is None:
            return probs, routing_map
        layer = int(router.layer_number)
        logits = logits.reshape(-1, logits.shape[-1])
        if routing_map.shape[0] != logits.shape[0]:
            raise RuntimeError(f"routing capture/replay: the router of layer {layer - 1} returned routing for "
                               f"{routing_map.shape[0]} tokens but got {logits.shape[0]} (alltoall_seq dispatcher?); "
                               "use the alltoall or allgather dispatcher")
        if micro is None:  # activation recompute in the backward pass: the forward's experts again
            if not (p["replay"] and self._fifo[layer]):
                return probs, routing_map
            self._pops[layer] += 1
            return self._forced(router, logits, self._fifo[layer].popleft(), probs, routing_map)
        native = sorted_topk(routing_map, self.topk)
        index = self.layers.index(layer)
        # every token is computed and the invalid ones masked out: selecting the valid ones would
        # read their number back from the device, in every layer
        with torch.no_grad():
            valid = micro.valid
            p["miscounted"][index] += topk_miscounted(routing_map, self.topk)
            p["tokens"][index] += valid.sum()
            scores = torch.softmax(logits.detach().float(), dim=-1)
            entropy = -(scores * torch.log(scores.clamp_min(1e-30))).sum(dim=-1)
            p["entropy"][index] += torch.where(valid, entropy, 0.0).sum().double()
            p["topk_mass"][index] += torch.where(valid, scores.gather(1, native).sum(dim=-1), 0.0).sum().double()
        if p["capture"]:
            micro.captured[layer] = native
        target = micro.targets.get(layer)
        if target is None:
            return probs, routing_map
        with torch.no_grad():
            replayed = valid & (target >= 0).all(-1)
            p["overridden"][index] += torch.where(replayed, changed_slots(native, target), 0).sum()
        if p["training"]:
            self._fifo[layer].append(target)
        return self._forced(router, logits, target, probs, routing_map)

    def _forced(self, router, logits, target, probs, routing_map):
        """(probs, routing_map) with the experts of ``target``; tokens with -1 keep the router's."""
        keep = (target < 0).any(-1, keepdim=True)
        experts = target.clamp(min=0)
        gates = replayed_gates(logits, experts, router.config)
        forced_probs = torch.zeros_like(logits).scatter(1, experts, gates)
        forced_map = torch.zeros_like(routing_map).scatter(1, experts, True)
        return torch.where(keep, probs, forced_probs), torch.where(keep, routing_map, forced_map)

    def remove(self) -> None:
        for router in self.routers:
            router.routing_tap = None


def _router_tokens(micro_batch: dict[str, torch.Tensor], seq_len: int,
                   sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each token this rank's routers see, in their order: its row in the micro-batch, its
    position in that row's sequence, and whether it is a real token (not padding at the end of a
    packed sequence). Routers see [s, b] flattened sequence-major (packed: b = 1, the rows back to
    back); with context parallel, the CP rank's ``held_positions`` of s; with sequence parallel,
    each TP rank its 1/TP slice of those."""
    ends = micro_batch[RESPONSE_ENDS]
    span = micro_batch.get(HELD_POSITIONS)
    span = torch.arange(seq_len, device=ends.device) if span is None else span.to(ends.device)
    if sequence_parallel:
        from megatron.core import parallel_state as ps

        share = len(span) // ps.get_tensor_model_parallel_world_size()
        span = span[ps.get_tensor_model_parallel_rank() * share:][:share]
    starts = micro_batch.get(SEQUENCE_STARTS)
    if starts is None:
        rows = len(ends)
        token_rows = torch.arange(rows, device=ends.device).repeat(len(span))
        return token_rows, span.repeat_interleave(rows), torch.ones_like(token_rows, dtype=torch.bool)
    token_rows, positions = packed_places(starts, span)
    last = starts[-1] + ends[-1].clamp(min=1)  # the packed sequence ends there, padding follows
    return token_rows, positions, span < last


def _check_targets(targets: torch.Tensor, num_experts: int, layers: list[int]) -> None:
    """Replayed experts [tokens, layers, k] must be k distinct ids in range (the dispatchers count k
    per token) or all -1; ``layers``: the 0-based layer of each. One read back for all layers."""
    given = (targets >= 0).all(-1)
    twice_or_outside = given & ((targets >= num_experts).any(-1) | (targets.sort(-1).values.diff(dim=-1) == 0).any(-1))
    mixed = (targets >= 0).any(-1) & ~given
    problems = torch.stack([twice_or_outside.any(0), mixed.any(0)]).tolist()
    for layer, bad, mixes in zip(layers, *problems):
        if bad:
            raise ValueError(f"routed_experts for layer {layer}: a token lists an expert id twice or one outside "
                             f"[0, {num_experts}); each token needs its k distinct experts (or -1 for none)")
        if mixes:
            raise ValueError(f"routed_experts for layer {layer}: a token mixes expert ids and -1")


def _captured(rows: torch.Tensor, token_rows: torch.Tensor, token_positions: torch.Tensor, within: torch.Tensor,
              stacked: torch.Tensor, layers: list[int], all_layers: list[int]) -> tuple[tuple, torch.Tensor]:
    """One micro-batch's captured experts (host tensors) as an index into the pass's routing table
    (row, position, layer) and the values there; ``within``: the tokens inside the table's width."""
    index = (rows[token_rows[within]][:, None], token_positions[within][:, None],
             torch.tensor([all_layers.index(layer) for layer in layers])[None, :])
    return index, stacked[within]
