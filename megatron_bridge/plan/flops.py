"""Floating-point operations of a Qwen3-MoE forward pass, counted from the model's shape (GEMMs
only: a multiply-add is 2 FLOPs; norms, softmax and rotary are left out, a few percent).
A backward pass is twice its forward; full recompute runs the forward once more."""

from __future__ import annotations

from megatron_bridge.plan.model_spec import ModelSpec


def dense_flops_per_token(spec: ModelSpec) -> float:
    """The attention projections (q, k, v, o) and the router: the parts every token runs."""
    h = spec.hidden_size
    return 2 * h * (spec.q_dim + 2 * spec.kv_dim) + 2 * spec.q_dim * h + 2 * h * spec.num_experts


def expert_flops_per_token(spec: ModelSpec) -> float:
    """The top-k experts' gate, up and down projections."""
    return 2 * spec.moe_topk * spec.expert_params


def attention_core_flops(spec: ModelSpec, seq_len: int) -> float:
    """Q K^T and P V of one causal sequence: 2 s^2 q_dim each, halved by the mask."""
    return 2 * spec.q_dim * seq_len**2


def layer_forward_flops(spec: ModelSpec, seq_len: int) -> float:
    """One decoder layer's forward over one sequence of ``seq_len`` tokens."""
    per_token = dense_flops_per_token(spec) + expert_flops_per_token(spec)
    return per_token * seq_len + attention_core_flops(spec, seq_len)


def logits_flops(spec: ModelSpec, tokens: int) -> float:
    """The output layer over ``tokens`` tokens."""
    return 2 * spec.hidden_size * spec.vocab_size * tokens


def decode_flops_per_token(spec: ModelSpec, context: int) -> float:
    """One generated token with ``context`` tokens before it: every active weight once, attention
    over the context (not halved: the new token sees all of it), and the output layer."""
    active = spec.num_layers * (dense_flops_per_token(spec) + expert_flops_per_token(spec))
    return active + spec.num_layers * 4 * spec.q_dim * context + logits_flops(spec, 1)
