"""What the OpenAI-compatible server reads and writes, as pure functions (sans-I/O).

``parse_completion`` validates a decoded ``POST /v1/completions`` body into a
``CompletionRequest`` or raises ``APIError`` (an OpenAI-style error: status, message,
``type``, ``param``, ``code``); ``completion_body`` / ``stream_chunk`` / ``usage_body`` /
``models_body`` build the answers in the shapes the ``openai`` client parses.

Decoding is greedy (the argmax at each step, what the reference full prefill gives), so
every parameter that asks for something else is refused with a 400 naming it, rather than
silently ignored: ``temperature`` > 0, ``top_p`` < 1, ``n`` or ``best_of`` > 1,
``logprobs``, ``echo``, ``suffix``, ``stop``, ``logit_bias``, non-zero penalties. A
``temperature`` of 0 (or omitted) is greedy; ``seed`` and ``user`` are accepted and have no
effect (nothing is random). One extension field: ``kvwire: {"slo": seconds}``, the
deadline of the request's prefix fetch (the openai client sends it with
``extra_body={"kvwire": {"slo": 0.5}}``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from streamer.net.json_body import BodyError, load_json_body

#: the API's default port (vLLM's and the openai examples')
DEFAULT_PORT = 8000
#: the environment variable ``kvwire serve-openai`` reads the API token from
API_TOKEN_ENV = "KVWIRE_OPENAI_TOKEN"
#: the most bytes a completions body may have (a 64K-token prompt as JSON ids is ~400 KB)
MAX_BODY = 1 << 20
#: OpenAI's default ``max_tokens`` for completions
DEFAULT_MAX_TOKENS = 16

_ACCEPTED = frozenset({"model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p", "n",
                       "best_of", "logprobs", "echo", "suffix", "stop", "logit_bias", "presence_penalty",
                       "frequency_penalty", "seed", "user", "kvwire"})


class APIError(Exception):
    """A request the server refuses or fails: answered with ``status`` and ``body()``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions request: the prompt as text or token ids, and how much to
    generate."""

    model: str
    #: the prompt as given: a string (tokenized by the server) or token ids
    prompt: str | tuple[int, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    stream: bool = False
    #: streamed: one last chunk with the usage (``stream_options.include_usage``)
    include_usage: bool = False
    #: the prefix fetch's deadline in seconds (None: the server's)
    slo: float | None = None


def parse_body(body: bytes, *, max_tokens_limit: int) -> CompletionRequest:
    """A raw body (JSON, at most ``MAX_BODY`` bytes) -> the request; APIError (400, 413)."""
    try:
        doc = load_json_body(body, MAX_BODY)
    except BodyError as exc:
        raise APIError(exc.status, exc.message) from None
    return parse_completion(doc, max_tokens_limit=max_tokens_limit)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A string, a list of token ids, or a one-element list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _bad("prompt", "the prompt is empty")
        return value
    if isinstance(value, list):
        if not value:
            raise _bad("prompt", "the prompt is empty")
        if not all(_is_int(t) and t >= 0 for t in value):
            raise _bad("prompt", "a prompt given as a list must hold token ids (integers >= 0)")
        return tuple(value)
    raise _bad("prompt", "prompt must be a string or a list of token ids (one prompt per request: n = 1)")


def _refuse_sampling(doc: dict[str, Any]) -> None:
    """APIError(400) for each parameter asking for other than one greedy completion."""
    defaults: dict[str, Any] = {"top_p": 1, "n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0}
    temperature = doc.get("temperature")
    if temperature is not None and (not _is_number(temperature) or temperature != 0):
        raise _bad("temperature", "this server decodes greedily: temperature must be 0 or omitted, "
                                  f"got {temperature!r:.40}")
    for name, default in defaults.items():
        value = doc.get(name)
        if value is not None and (not _is_number(value) or value != default):
            raise _bad(name, f"this server decodes greedily, one completion per request: {name} must be "
                             f"{default} or omitted, got {value!r:.40}")
    for name in ("logprobs", "suffix", "stop"):
        if doc.get(name) is not None:
            raise _bad(name, f"{name} is not supported by this server")
    if doc.get("echo") not in (None, False):
        raise _bad("echo", "echo is not supported by this server")
    if doc.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias", "logit_bias is not supported by this server")


def parse_completion(doc: Any, *, max_tokens_limit: int) -> CompletionRequest:
    """Validate a decoded completions body; APIError(400) naming the offending field."""
    if not isinstance(doc, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _ACCEPTED)
    if unknown:
        raise _bad(unknown[0], f"unknown field(s) {unknown[:8]}")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "model must be the name of a served model (GET /v1/models)")
    if "prompt" not in doc:
        raise _bad("prompt", "missing field 'prompt'")
    prompt = _prompt(doc["prompt"])
    max_tokens = doc.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_tokens_limit:
        raise _bad("max_tokens", f"max_tokens must be an integer from 1 to {max_tokens_limit}, got {max_tokens!r:.40}")
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", f"stream must be true or false, got {stream!r:.40}")
    options = doc.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise _bad("stream_options", "stream_options must be {\"include_usage\": true|false}")
        include_usage = options.get("include_usage", False)
    _refuse_sampling(doc)
    slo = None
    extension = doc.get("kvwire")
    if extension is not None:
        if not isinstance(extension, dict) or set(extension) - {"slo"}:
            raise _bad("kvwire", "kvwire must be an object with only \"slo\" (seconds)")
        slo = extension.get("slo")
        if slo is not None and (not _is_number(slo) or slo <= 0):
            raise _bad("kvwire", f"kvwire.slo must be a finite number of seconds > 0, got {slo!r:.40}")
    return CompletionRequest(model=model, prompt=prompt, max_tokens=max_tokens, stream=bool(stream),
                             include_usage=include_usage, slo=None if slo is None else float(slo))


# ------------------------------------------------------------------------ responses
def usage_body(prompt_tokens: int, completion_tokens: int, kvwire: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object, with how the prompt's KV was obtained under ``kvwire``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "kvwire": kvwire}


def completion_body(completion_id: str, created: int, model: str, text: str, finish_reason: str,
                    usage: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) completion."""
    return {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage}


def stream_chunk(completion_id: str, created: int, model: str, text: str | None,
                 finish_reason: str | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: a piece of text (``finish_reason`` on the last), or with
    ``text=None`` the usage chunk (no choices) that ``include_usage`` asks for."""
    choices = [] if text is None else [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]
    chunk: dict[str, Any] = {"id": completion_id, "object": "text_completion", "created": created,
                             "model": model, "choices": choices}
    if usage is not None or text is None:
        chunk["usage"] = usage
    return chunk


def sse_data(payload: dict[str, Any] | None) -> bytes:
    """One server-sent event as OpenAI streams them: ``data: <json>`` (``data: [DONE]``
    for None). The JSON escapes every non-ASCII character, so no value can put a line
    break into the stream."""
    text = "[DONE]" if payload is None else json.dumps(payload, separators=(",", ":"), ensure_ascii=True)
    return f"data: {text}\n\n".encode("ascii")


def models_body(names: Sequence[str], created: int, owner: str = "kvwire") -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": owner}
                                       for name in names]}


class TextStream:
    """Token ids in, text out, piece by piece: each ``push`` returns what the ids so far
    add to the text, holding back a trailing incomplete UTF-8 sequence (the tokenizer
    decodes it as U+FFFD until its last byte comes) so that no piece is a broken
    character. A decoding that rewrites text already sent (not the case for byte-level
    tokenizers) sends nothing until it agrees with it again. ``text`` is the whole text."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._sent = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """What is left to send at the end (an incomplete character, as decoded)."""
        return self._advance(self._decode(self.ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self._sent):
            return ""
        piece, self._sent = text[len(self._sent):], text
        return piece

    @property
    def text(self) -> str:
        return self._decode(self.ids)
