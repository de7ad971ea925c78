"""Hugging Face transformers integration: take KV caches out of a model, put them back,
recompute chunks that arrive as text, and measure what a lossy cache does to the model.

* ``hf``          - capture / inject KV (decoders via the cache, encoders via hooks),
  greedy generation after a transmitted context, ``CacheAssembler`` (recompute),
  ``recompute_seconds_per_token`` (this model's measured text cost)
* ``rotary``      - ``rotary_of``: the model's RoPE as a ``codec.Rotary`` (keys coded position-free)
* ``sensitivity`` - ``kv_sensitivity``: a causal LM's output KL per unit MSE/var of each
  (layer, K/V), which ``codec.allocation`` turns into per-section target weights
* ``quality``     - per-level quality on real text (attention error, embedding cosine,
  perplexity), and profile calibration on a model's own KV

``streamer.hf`` is the same module as ``streamer.model.hf`` (the name earlier releases used).
"""
from streamer.model.hf import (CALIBRATION_TEXTS, MEASURE_TEXT, CacheAssembler, ModelLoadError, cache_to_kv,
                               capture_kv, continuation_logits, generate_with_kv, greedy_generate,
                               is_decoder, is_gguf, kv_shape, kv_to_cache, load_model, minilm_path,
                               random_llama, read_text, recompute_chunk, recompute_seconds_per_token,
                               resolve_model_path, sentence_embedding, tokenize)
from streamer.model.rotary import rotary_of
from streamer.model.sensitivity import kv_sensitivity

__all__ = ["CALIBRATION_TEXTS", "MEASURE_TEXT", "CacheAssembler", "ModelLoadError", "cache_to_kv",
           "capture_kv", "continuation_logits", "generate_with_kv", "greedy_generate", "is_decoder",
           "is_gguf", "kv_sensitivity", "kv_shape", "kv_to_cache", "load_model", "minilm_path", "random_llama",
           "read_text", "recompute_chunk", "recompute_seconds_per_token", "resolve_model_path",
           "rotary_of", "sentence_embedding", "tokenize"]
