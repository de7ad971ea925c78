"""What the receiver daemon reads from an HTTP request, as pure functions (sans-I/O).

aiohttp frames each request (request line, headers, body) within the limits below;
the daemon hands what it framed to ``authorize`` (the API token, when the daemon has
one), then to ``parse_head`` (route and parameters, from the request target and
headers), both before any body is read, and, for ``POST /fetch``, the body to
``parse_fetch_body``. Each returns the parsed request or raises
``RequestError``, a ``FetchError`` with a 4xx status that names the cause. The fuzz
target ``http`` (``streamer.tools.fuzz_http``) drives these functions from raw bytes
through aiohttp's own request parser, configured by ``server_options``.

Maximum of each size read, each checked before anything of that size is kept:

- request line: ``MAX_REQUEST_LINE`` bytes (aiohttp's parser, ``max_line_size``): 400
- a header's name, and its value: ``MAX_HEADER_FIELD`` bytes each (``max_field_size``): 400
- headers: ``MAX_HEADERS`` (``max_headers``): 400
- query parameters: ``MAX_QUERY_FIELDS`` (``parse_head``): 400
- body: ``MAX_BODY`` bytes. ``parse_head`` refuses a larger Content-Length before the
  body is read (413); a chunked or compressed body is cut at the same size, decoded,
  while it is read (aiohttp's ``client_max_size``: 413)
- JSON nesting: the interpreter's recursion limit (``parse_fetch_body``: 400, not the
  RecursionError that was a 500); JSON integers: 4300 digits, Python's conversion
  limit (400, not the ValueError that was a 500)
- time to a whole request head: ``HEAD_TIMEOUT`` (aiohttp's ``keepalive_timeout``): a
  connection that has sent part of a head and no more by then (slowloris) is closed
- time to a whole body: ``BODY_TIMEOUT`` (the daemon's read): 408
"""
from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote_to_bytes

from streamer.net.json_body import BodyError, load_json_body
from streamer.receiver.fetcher import FetchError, FetchRequest

MAX_REQUEST_LINE = 8190
MAX_HEADER_FIELD = 8190
MAX_HEADERS = 32
MAX_QUERY_FIELDS = 8
#: a fetch body is a few hundred bytes of JSON
MAX_BODY = 64 << 10
HEAD_TIMEOUT = 30.0
BODY_TIMEOUT = 10.0
#: the longest ``?wait=`` of an event stream, seconds
MAX_EVENTS_WAIT = 3600.0
#: the largest event number ``Last-Event-ID`` or ``?after=`` may name
MAX_EVENT_ID = (1 << 63) - 1

FETCH_KEYS = frozenset({"context_id", "slo", "policy", "min_level", "refresh", "wait"})


class RequestError(FetchError):
    """A request the daemon refuses (4xx); ``allow``: the methods of the path (for 405)."""

    def __init__(self, status: int, message: str, allow: tuple[str, ...] = (),
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status, message, {"Allow": ", ".join(allow)} if allow else headers)
        self.allow = allow


@dataclass(frozen=True)
class Head:
    """A request's route and parameters, from its target and headers."""

    #: a key of ``ROUTES``
    route: str
    context_id: str | None = None
    #: context: wait for a fetch of it that is running
    join: bool = True
    #: events: seconds to wait for a fetch to start
    wait: float = 0.0
    #: events: replay only events after this number (Last-Event-ID, or ?after=)
    after: int = 0


def server_options() -> dict[str, Any]:
    """aiohttp ``AppRunner`` options that put the limits above on its request parser."""
    return {"max_line_size": MAX_REQUEST_LINE, "max_field_size": MAX_HEADER_FIELD,
            "max_headers": MAX_HEADERS, "keepalive_timeout": HEAD_TIMEOUT}


# ---------------------------------------------------------------------------- head
#: route -> (methods, the query parameters it takes)
ROUTES: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "fetch": (("POST",), frozenset()),
    "contexts": (("GET", "HEAD"), frozenset()),
    "context": (("GET", "HEAD"), frozenset({"wait"})),
    "events": (("GET", "HEAD"), frozenset({"wait", "after"})),
    "healthz": (("GET", "HEAD"), frozenset()),
    "metrics": (("GET", "HEAD"), frozenset()),
    "livez": (("GET", "HEAD"), frozenset()),
}
#: the one route served without the API token: it says only that the process answers,
#: and costs nothing (no sender, no cache)
PUBLIC_ROUTE = "livez"


def _segments(path: str) -> list[str]:
    """The path's segments, each percent-decoded as strict UTF-8."""
    try:
        return [unquote_to_bytes(s).decode("utf-8") for s in path.split("/")[1:]]
    except UnicodeError:
        raise RequestError(400, "the request path is not UTF-8 (after percent-decoding)") from None


def _route(path: str) -> tuple[str, str | None]:
    """(route, context id or None) of a path; 404 when it names no endpoint."""
    if not path.startswith("/"):
        raise RequestError(400, f"the request target must be a path starting with '/', got {path[:80]!r}")
    parts = _segments(path)
    if len(parts) == 1 and parts[0] in ("fetch", "contexts", "healthz", "metrics", "livez"):
        return parts[0], None
    if len(parts) in (2, 3) and parts[0] == "contexts" and (len(parts) == 2 or parts[2] == "events"):
        from streamer.wire.manifest import validate_context_id

        try:
            cid = validate_context_id(parts[1])
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None
        return ("context" if len(parts) == 2 else "events"), cid
    raise RequestError(404, f"no endpoint at {path[:200]!r} (POST /fetch, GET /contexts, /contexts/ID, "
                            "/contexts/ID/events, /healthz, /metrics, /livez)")


def _query(query: str, allowed: frozenset[str]) -> dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS, errors="strict")
    except UnicodeError:
        raise RequestError(400, "the query string is not UTF-8 (after percent-decoding)") from None
    except ValueError:   # more than MAX_QUERY_FIELDS
        raise RequestError(400, f"more than {MAX_QUERY_FIELDS} query parameters") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key not in allowed:
            valid = ", ".join(sorted(allowed)) or "none"
            raise RequestError(400, f"unknown query parameter {key[:40]!r} (valid here: {valid})")
        if key in out:
            raise RequestError(400, f"query parameter {key!r} given twice")
        out[key] = value
    return out


def _event_id(value: str, what: str) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 19) or int(value) > MAX_EVENT_ID:
        raise RequestError(400, f"{what} must be an event number (0 to 2^63-1), got {value[:40]!r}")
    return int(value)


def authorize(target: str, headers: Mapping[str, str], token: bytes | None) -> None:
    """``RequestError`` (401, ``WWW-Authenticate``) unless the daemon has no API token,
    the target's path is exactly ``/`` + ``PUBLIC_ROUTE``, or the request carries
    ``Authorization: Bearer <token>`` (compared in constant time). Called first, so that
    without the token nothing else is parsed or answered: no 400, 404 or 413 either."""
    if token is None or target.partition("?")[0] == "/" + PUBLIC_ROUTE:
        return
    scheme, _, given = headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        raise RequestError(401, "this API needs the daemon's token: Authorization: Bearer <token>",
                           headers={"WWW-Authenticate": 'Bearer realm="kvwire"'})
    # (a header may hold any character, lone surrogates too: surrogatepass encodes each,
    # never as ASCII, and a token is ASCII, so a non-ASCII one only ever differs)
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"), token):
        raise RequestError(401, "wrong API token",
                           headers={"WWW-Authenticate": 'Bearer realm="kvwire", error="invalid_token"'})


def parse_head(method: str, target: str, headers: Mapping[str, str]) -> Head:
    """The route and parameters of a request, from its method, target (path and query,
    still percent-encoded: aiohttp's ``raw_path``) and headers; ``RequestError`` (400,
    404, 405, 413) naming what is wrong. Called before any body is read."""
    path, _, query = target.partition("?")
    route, cid = _route(path)
    methods, params = ROUTES[route]
    if method not in methods:
        raise RequestError(405, f"{method[:20]} is not allowed on {path[:200]} (allowed: {', '.join(methods)})",
                           allow=methods)
    length = headers.get("Content-Length")
    if length is not None and (not (length.isascii() and length.isdigit()) or len(length) > 19
                               or int(length) > MAX_BODY):
        raise RequestError(413, f"the body may be at most {MAX_BODY} bytes, Content-Length is {length[:40]!r}")
    values = _query(query, params)
    if route == "context":
        join = values.get("wait", "1")
        if join not in ("0", "1", "false", "true"):
            raise RequestError(400, f"wait must be 0, 1, false or true, got {join[:40]!r}")
        return Head(route, cid, join=join in ("1", "true"))
    if route == "events":
        try:
            wait = float(values.get("wait", "0"))
        except ValueError:
            wait = math.nan
        if not (math.isfinite(wait) and 0 <= wait <= MAX_EVENTS_WAIT):
            raise RequestError(400, f"wait must be between 0 and {MAX_EVENTS_WAIT:.0f} s, "
                                    f"got {values['wait'][:40]!r}")
        last = headers.get("Last-Event-ID")
        after = _event_id(last, "Last-Event-ID") if last is not None else _event_id(values.get("after", "0"), "after")
        return Head(route, cid, wait=wait, after=after)
    return Head(route, cid)


# ---------------------------------------------------------------------------- body
def parse_fetch_body(body: bytes, *, default_slo: float, default_policy: str) -> tuple[FetchRequest, bool]:
    """A POST /fetch body (JSON, at most MAX_BODY bytes): the request and whether to wait
    for its result; ``RequestError`` (400, 413) naming what is wrong."""
    try:
        doc = load_json_body(body, MAX_BODY)
    except BodyError as exc:
        raise RequestError(exc.status, exc.message) from None
    return parse_fetch(doc, default_slo=default_slo, default_policy=default_policy)


def _context_id(value: Any) -> str:
    from streamer.wire.manifest import validate_context_id

    try:
        return validate_context_id(value)
    except ValueError as exc:
        raise RequestError(400, str(exc)) from None


def parse_fetch(body: Any, *, default_slo: float, default_policy: str) -> tuple[FetchRequest, bool]:
    """Validate a decoded POST /fetch body; RequestError(400) naming what is wrong."""
    from streamer.adapt.policies import get_policy

    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(body).__name__}")
    unknown = set(body) - FETCH_KEYS
    if unknown:
        raise RequestError(400, f"unknown field(s) {sorted(unknown)[:8]}; valid: {sorted(FETCH_KEYS)}")
    if "context_id" not in body:
        raise RequestError(400, "missing field 'context_id'")
    context_id = _context_id(body["context_id"])
    slo = body.get("slo", default_slo)
    if isinstance(slo, bool) or not isinstance(slo, (int, float)) or not math.isfinite(slo) or slo <= 0:
        raise RequestError(400, f"slo must be a finite number of seconds > 0, got {slo!r:.80}")
    min_level = body.get("min_level")
    if min_level is not None and (isinstance(min_level, bool) or not isinstance(min_level, int) or min_level < 0):
        raise RequestError(400, f"min_level must be an integer >= 0 (0 is the best level), got {min_level!r:.80}")
    # a quality floor without a policy: fetch at exactly that level
    policy = body.get("policy", default_policy if min_level is None else f"fixed:{min_level}")
    if not isinstance(policy, str):
        raise RequestError(400, f"policy must be a string, got {policy!r:.80}")
    try:
        get_policy(policy)
    except ValueError as exc:
        raise RequestError(400, str(exc)) from None
    for flag in ("refresh", "wait"):
        if not isinstance(body.get(flag, False), bool):
            raise RequestError(400, f"{flag} must be true or false, got {body[flag]!r:.80}")
    request = FetchRequest(context_id=context_id, slo=float(slo), policy=policy, min_level=min_level,
                           refresh=body.get("refresh", False))
    return request, body.get("wait", True)
