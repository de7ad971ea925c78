"""How fast this process recomputes KV from text with a loaded model.

A fetch weighs sending a chunk as text against its KV at ``recompute_seconds_per_token``;
a default guessed for a GPU (0.1 ms/token) made text look 19x cheaper than it is for
SmolLM2 on a 2-core CPU (~1.9 ms/token). So whoever holds the model measures it: one
chunk's prefill, timed once per (model, chunk length) in a process and outside any
timed fetch. (A profile does not record it: the rate belongs to the receiver's hardware,
and a profile travels to receivers on other machines.)
"""
from __future__ import annotations

import time
import weakref

from streamer.model import hf

#: tokens timed when the chunk length is not known (capped at the model's positions)
DEFAULT_TOKENS = 512
#: a short prefill before timing: the first forward pays one-off allocation and dispatch costs
_WARM_TOKENS = 16

_measured: "weakref.WeakKeyDictionary[object, dict[int, float]]" = weakref.WeakKeyDictionary()


def recompute_seconds_per_token(model, tokens: int = DEFAULT_TOKENS) -> float:
    """Seconds per token ``recompute_chunk`` takes on a ``tokens``-token chunk (capped at
    the model's positions) with this model, measured here once and remembered."""
    limit = getattr(model.config, "max_position_embeddings", None) or tokens
    tokens = max(1, min(int(tokens), int(limit)))
    known = _measured.setdefault(model, {})
    if tokens not in known:
        vocab = hf.vocab_size(model)
        ids = [(7 + 31 * i) % vocab for i in range(tokens)]  # any ids: the cost does not depend on them
        hf.recompute_chunk(model, None, ids[:min(_WARM_TOKENS, tokens)])
        began = time.perf_counter()
        hf.recompute_chunk(model, None, ids)
        known[tokens] = (time.perf_counter() - began) / tokens
    return known[tokens]
