"""Weight sync after an update: the actor's export stream into the colocated rollout engine."""

from __future__ import annotations

import time

from megatron_bridge.weights.export import WeightExporter
from recipe.rollout.base import RolloutEngine


def sync_weights(exporter: WeightExporter, engine: RolloutEngine) -> dict[str, float]:
    """Stream the new weights into ``engine`` (every training rank calls this together) and return
    ``timing_s/reshard`` (export and load) with the stream's ``reshard/*`` counts for this rank."""
    start = time.perf_counter()
    stream = exporter.stream()
    try:
        engine.load_weights(stream)
    finally:
        # The other ranks exchange pieces with this one bucket by bucket: finish this rank's part
        # even when the engine rejected the stream, so that they report instead of hanging.
        for _ in stream:
            pass
    return {"timing_s/reshard": time.perf_counter() - start, **exporter.stats.as_metrics()}
