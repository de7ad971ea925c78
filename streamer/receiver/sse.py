"""Server-sent events (the WHATWG ``text/event-stream`` format) of a fetch's progress.

One event is ``id: N``, ``event: KIND`` and one ``data:`` line of JSON, then a blank
line. The data is JSON with every non-ASCII character escaped, so no value (a sender's
error message, a context id, a report) can put a CR or LF into the stream and start a
field or an event of its own; floats that are not finite (JSON has no NaN or
Infinity) are sent as null. The fuzz target ``sse`` (``streamer.tools.fuzz_http``)
parses what ``encode`` writes with the standard's parsing rules.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

#: a comment line: keeps an idle stream alive so that a dead subscriber is noticed
KEEPALIVE = b": keepalive\n\n"

_KIND = re.compile(r"[a-z][a-z_]{0,31}")


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (lists and dicts walked)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def encode(seq: int, kind: str, data: Any) -> bytes:
    """One event's bytes; ValueError for an event number or kind that cannot be sent
    (a kind is 1-32 of [a-z_], so it is a single token on its line)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"an event number is an int >= 0, got {seq!r}")
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ValueError(f"an event kind is 1-32 of [a-z_], got {kind!r:.80}")
    text = json.dumps(_finite(data), separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return f"id: {seq}\nevent: {kind}\ndata: {text}\n\n".encode("ascii")
