"""Weight sync after an update: the actor's export stream into the colocated rollout engine."""

from __future__ import annotations

import time

from megatron_bridge.weights.export import WeightExporter
from recipe.rollout.base import RolloutEngine, WeightStream


def sync_weights(exporter: WeightExporter, engine: RolloutEngine) -> dict[str, float]:
    """Stream the new weights into ``engine`` (every training rank calls this together) and return
    ``timing_s/reshard`` (export and load) with the stream's ``reshard/*`` counts for this rank."""
    start = time.perf_counter()
    load_all(exporter.stream(), engine)
    return {"timing_s/reshard": time.perf_counter() - start, **exporter.stats.as_metrics()}


def load_all(stream: WeightStream, engine: RolloutEngine) -> None:
    """``engine.load_weights(stream)``, then the rest of the stream even when the engine rejected
    it: the stream's producers (the other training ranks, the other end of a broadcast) exchange
    pieces with this process bucket by bucket, and report instead of hanging only if it takes part
    to the end."""
    stream = iter(stream)
    try:
        engine.load_weights(stream)
    finally:
        for _ in stream:
            pass
