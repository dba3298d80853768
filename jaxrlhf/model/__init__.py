"""Models: the Llama-family transformer (pure functions) and sharded initialisation."""

from jaxrlhf.model.transformer import (KVCache, forward, init_cache, init_params, last_valid_index,
                                       lm_logits, param_axes, param_shapes,
                                       positions_from_mask, positions_from_segments,
                                       scalar_head, unembedding)
from jaxrlhf.model.sharded import abstract_params, cast_floating, init_sharded, param_shardings
from jaxrlhf.model.scoring import pool_scores, sequence_scores, token_logprobs, token_scores

__all__ = [
    "KVCache", "forward", "init_cache", "init_params", "last_valid_index", "lm_logits",
    "param_axes", "param_shapes", "positions_from_mask", "positions_from_segments",
    "scalar_head", "unembedding",
    "abstract_params", "cast_floating", "init_sharded", "param_shardings", "pool_scores",
    "sequence_scores", "token_logprobs", "token_scores",
]
