"""``rotary_of``: a model's RoPE as a ``codec.Rotary``, read from its transformers config.

With it a profile codes keys position-free (``codec.calibrate(samples, rotary=...)``).
Only what the codec reproduces exactly is returned: model families whose keys are
rotated Llama-style (``rotate_half``) with a ``default``, ``linear`` or ``llama3``
frequency schedule. Anything else gets None (keys coded as they are: still correct,
only less compact), with a warning when the model does have RoPE of another kind.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import codec

#: Families whose attention applies transformers' Llama ``apply_rotary_pos_emb`` to the
#: keys (rotate_half over the first ``head_dim * partial_rotary_factor`` channels).
ROTATE_HALF_FAMILIES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "olmo", "olmo2",
                                  "granite", "smollm3"})


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_parameters(config) -> dict | None:
    """The config's RoPE fields in transformers 5's ``rope_parameters`` form (older
    configs keep ``rope_theta`` and ``rope_scaling`` apart), or None without RoPE."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        return None
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": theta}


def rotary_of(model) -> codec.Rotary | None:
    """The keys' RoPE of a transformers model (or config), or None: no RoPE (BERT,
    MiniLM), or RoPE the codec does not reproduce (a warning says which)."""
    from codec.rotary import ROPE_TYPES, Rotary  # the codec loads with the first call, not on import

    config = _text_config(model)
    params = _rope_parameters(config)
    if params is None:
        return None
    family = getattr(config, "model_type", None)
    rope_type = params.get("rope_type", "default")
    if family not in ROTATE_HALF_FAMILIES or rope_type not in ROPE_TYPES:
        warnings.warn(f"{family} RoPE ({rope_type}) is not one the codec removes; keys are coded with it",
                      stacklevel=2)
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    extra: dict = {}
    if rope_type in ("linear", "llama3"):
        extra["factor"] = float(params["factor"])
    if rope_type == "llama3":
        extra.update(low_freq_factor=float(params["low_freq_factor"]),
                     high_freq_factor=float(params["high_freq_factor"]),
                     original_max_positions=int(params["original_max_position_embeddings"]))
    return Rotary(head_dim=int(head_dim), dim=int(head_dim * partial), theta=float(params["rope_theta"]),
                        rope_type=rope_type, **extra)
