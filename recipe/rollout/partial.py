"""Partial rollout (``async_training.partial_rollout``): a generation paused at a weight push and
continued under the new weights.

The engine's ``pause()`` stops its lockstep decoding after the current token; the responses not yet
finished come back with finish reason "paused", each with its request's sampler (``Generation.generators``).
``resume`` continues them: prompt + tokens so far as the new prompt (re-prefilled under whatever
weights the engine holds now), the rest of the token budget, and the same samplers, so each request
draws the random numbers it would have drawn uninterrupted. What was made before the pause stays as
it was: its tokens, log-probs and routes (the re-prefill's routes of tokens already generated are
dropped, R3 replays those of the version that made them).

A generation that had not started when the pause came (queued behind the one running) is held:
its responses come back empty with finish reason "held" and are generated from the start under
the new weights.
"""

from __future__ import annotations

import dataclasses

import torch

from recipe.rollout.base import Generation, SamplingParams

PAUSED = "paused"
HELD = "held"


def held(rows: int) -> Generation:
    """The answer of a generation the pause stopped before it started: ``rows`` empty responses."""
    return Generation(token_ids=[[] for _ in range(rows)], log_probs=[[] for _ in range(rows)],
                      finish_reasons=[HELD] * rows)


def paused_rows(generation: Generation) -> list[int]:
    return [i for i, reason in enumerate(generation.finish_reasons) if reason == PAUSED]


def resume(engine, prompts: list[list[int]], params: SamplingParams, generation: Generation) -> Generation:
    """``generation`` (of ``prompts`` with ``params``) with its paused responses continued by ``engine``;
    they may come back paused again."""
    rows = paused_rows(generation)
    # lockstep decoding pauses every unfinished response of a call after the same token
    so_far = len(generation.token_ids[rows[0]])
    prefixes = [prompts[i] + generation.token_ids[i] for i in rows]
    more = engine.generate(prefixes, dataclasses.replace(params, max_tokens=params.max_tokens - so_far),
                           generators=[generation.generators[i] for i in rows])
    out = dataclasses.replace(generation, token_ids=[list(t) for t in generation.token_ids],
                              log_probs=[list(p) for p in generation.log_probs],
                              finish_reasons=list(generation.finish_reasons),
                              routed_experts=generation.routed_experts and list(generation.routed_experts))
    for row, i in enumerate(rows):
        out.token_ids[i] += more.token_ids[row]
        out.log_probs[i] += more.log_probs[row]
        out.finish_reasons[i] = more.finish_reasons[row]
        if out.routed_experts is not None:
            # the continuation's routes from the feed of the last token made before the pause on
            fed_before = len(prompts[i]) + so_far - 1
            out.routed_experts[i] = torch.cat([out.routed_experts[i], more.routed_experts[row][fed_before:]])
    return out
