"""How megatron-core 0.12.1 splits transformer layers over pipeline and virtual-pipeline stages
(transformer_block.get_num_layers_to_build), for a layout the validator has accepted."""

from __future__ import annotations

from megatron_bridge.plan.layout import TrainParallel


def layers_per_chunk(num_layers: int, train: TrainParallel) -> list[list[int]]:
    """Transformer layers built by each model chunk: ``[pp_rank][vp_rank]``."""
    pp, vpp = train.pp, train.vpp or 1
    first, last = train.first_stage_layers, train.last_stage_layers
    embedding = int(train.account_for_embedding_in_pipeline_split)
    loss = int(train.account_for_loss_in_pipeline_split)
    if first is None and last is None:
        per_rank = [(num_layers + embedding + loss) // pp] * pp
    else:
        middle_stages = pp - (first is not None) - (last is not None)
        middle_layers = num_layers - (first or 0) - (last or 0)
        per_rank = [middle_layers // middle_stages if middle_stages else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    chunks = [[count // vpp] * vpp for count in per_rank]
    # An accounted embedding (loss) takes one layer's place in the first (last) chunk.
    chunks[0][0] -= embedding
    chunks[-1][-1] -= loss
    return chunks


def layers_per_stage(num_layers: int, train: TrainParallel) -> list[int]:
    """Transformer layers held by each pipeline rank (all its virtual chunks together)."""
    return [sum(chunk) for chunk in layers_per_chunk(num_layers, train)]
