"""Partial rollout (``async_training.partial_rollout``): a generation paused at a weight push and
continued under the new weights.

The engine's ``pause()`` stops its decoding after the current token; the responses not yet
finished come back with finish reason "paused". ``resume`` continues them: prompt + tokens so far as
the new prompt (re-prefilled under whatever weights the engine holds now) and the rest of each
one's token budget. The hf engine returns each request's sampler (``Generation.generators``) and
continues with it, so each request draws the random numbers it would have drawn uninterrupted; vLLM
keeps no sampler across requests, so a continuation samples from a seed of its own, made from the
call's seed and the tokens so far (the same run gives the same tokens; an uninterrupted run draws
others). What was made before the pause stays as it was: its tokens, log-probs and routes (the
re-prefill's routes of tokens already generated are dropped, R3 replays those of the version that
made them).

A generation that had not started when the pause came (queued behind the one running) is held:
its responses come back empty with finish reason "held" and are generated from the start under
the new weights.
"""

from __future__ import annotations

import dataclasses

import torch

from recipe.rollout.base import Generation, SamplingParams, request_seed

PAUSED = "paused"
HELD = "held"
RESUMED = 1 << 20  # the seed stream of continuations (request_seed's streams below it are DP ranks)


def held(rows: int) -> Generation:
    """The answer of a generation the pause stopped before it started: ``rows`` empty responses."""
    return Generation(token_ids=[[] for _ in range(rows)], log_probs=[[] for _ in range(rows)],
                      finish_reasons=[HELD] * rows)


def paused_rows(generation: Generation) -> list[int]:
    return [i for i, reason in enumerate(generation.finish_reasons) if reason == PAUSED]


def resume(engine, prompts: list[list[int]], request_ids: list[int], params: SamplingParams,
           generation: Generation) -> Generation:
    """``generation`` (of ``prompts`` with ``request_ids`` and ``params``) with its paused responses
    continued by ``engine``; they may come back paused again. The engine is called even with none
    to continue: an engine whose ranks decode together needs every rank in the call."""
    rows = paused_rows(generation)
    so_far = [len(generation.token_ids[i]) for i in rows]
    sampling = {}
    if generation.generators is not None:
        sampling["generators"] = [generation.generators[i] for i in rows]
    elif params.seed is not None:
        params = dataclasses.replace(params, seed=request_seed(params.seed, sum(so_far), stream=RESUMED))
    more = engine.generate([prompts[i] + generation.token_ids[i] for i in rows], params,
                           request_ids=[request_ids[i] for i in rows],
                           max_tokens=[params.max_tokens - n for n in so_far], **sampling)
    out = dataclasses.replace(generation, token_ids=[list(t) for t in generation.token_ids],
                              log_probs=[list(p) for p in generation.log_probs],
                              finish_reasons=list(generation.finish_reasons), paused=more.paused,
                              routed_experts=generation.routed_experts and list(generation.routed_experts))
    for row, (i, n) in enumerate(zip(rows, so_far)):
        out.token_ids[i] += more.token_ids[row]
        out.log_probs[i] += more.log_probs[row]
        out.finish_reasons[i] = more.finish_reasons[row]
        if out.routed_experts is not None:
            # the continuation's routes from the feed of the last token made before the pause on
            fed_before = len(prompts[i]) + n - 1
            out.routed_experts[i] = torch.cat([out.routed_experts[i], more.routed_experts[row][fed_before:]])
    return out
