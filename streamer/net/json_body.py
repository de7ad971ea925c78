"""A JSON request body read as hostile input: capped in size, UTF-8, nesting bounded.

The receiver's HTTP API and the completions server read their bodies the same way and
answer in their own error shapes, so this raises one ``BodyError`` carrying the HTTP
status for them to translate."""
from __future__ import annotations

import json
from typing import Any


class BodyError(ValueError):
    """The body cannot be read as JSON; ``status`` is 413 (too large) or 400."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def load_json_body(body: bytes, limit: int) -> Any:
    """The JSON document in ``body``, at most ``limit`` bytes; BodyError otherwise."""
    if len(body) > limit:
        raise BodyError(413, f"the body may be at most {limit} bytes, got {len(body)}")
    try:
        return json.loads(body.decode("utf-8"))
    except ValueError as exc:   # not UTF-8, not JSON, or an integer of over 4300 digits
        raise BodyError(400, f"malformed JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise BodyError(400, "malformed JSON: nested too deeply") from None
