"""The receiver's decode cost: seconds per layer section, as its decoder shows it.

A KV chunk is delivered once its sections are decoded, and the decoder is a pipeline
stage of its own: chunk ``i`` decodes while chunk ``i + 1`` arrives. Where the decoder is
slower than the link (a CPU decoder beside a fast link), a plan timed by the link alone
finishes long after its estimate: the decode backlog grows behind the link, and a text
chunk's recompute, which waits for the chunk before it to be delivered, starts that much
later. So the planners time a KV option at the slower of its transfer and its decode
(``base.link_seconds``), and the decode still owed comes off their budget
(``base.pipeline_budget``).

A section's decode is partly per element (rANS symbols, dequantisation, the inverse
transform) and partly per coded byte. Under load (the receiving loop, the sender and a
proxy sharing few cores) a section takes several times longer, and the sections decoded
under load are not a random sample of sizes, so the two terms cannot be told apart from
the sections a fetch decodes: a least-squares fit reads the load as a price of bytes and
overprices the better levels; a per-token figure alone makes every level look alike
where the decoder is the bottleneck, so the plan keeps the best level and its decode runs
late. So the *scale* is measured (the mean over the recent sections, which follows the
load) and the *split* is fixed: ``PER_TOKEN_SHARE`` of a section's time at the measured
sections' bytes per token is per token, the rest scales with its bytes. One section that
stalls (a page fault into a cold decoder, the interpreter held by a model loading beside
the fetch) is not the load of the moment: each section counts at most ``STALL_FACTOR``
times the median section's seconds per token, so a single 2 s stall among 5 ms sections
does not price every later chunk as text.

Before a session has decoded anything the plan has no figure, and its first chunks would
be timed by the link alone. A caller that has timed the decoder (a chunk decoded before
the fetch, through ``measure_whole``; ``kvwire receive`` passes what its last fetch
measured) gives that as ``SessionConfig.decode_prior``; it stands in for one chunk's
sections (``prior_sections``): the session's own timings weigh as much after one chunk,
more after two, and replace it within ``RECENT_SECTIONS``.

Pure; the delivery times each section as it is decoded, the session asks here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: How many recent sections the cost is judged by: a few chunks' worth, so it follows the
#: load of the moment and no single slow section decides it.
RECENT_SECTIONS = 24
#: Share of a section's decode that is per token at the bytes per token of the sections
#: measured (the rest scales with its coded bytes): on an idle decoder about half of a
#: mid-level chunk's time is per token.
PER_TOKEN_SHARE = 0.5
#: A section counts at most this many times the median recent section's seconds per
#: token (a stall is not a rate; a load that slows most sections moves the median too).
STALL_FACTOR = 4.0


@dataclass(frozen=True)
class DecodeCost:
    """The decoder as recently measured: ``seconds_per_token`` at ``bytes_per_token``."""

    seconds_per_token: float
    bytes_per_token: float

    def __post_init__(self) -> None:
        if not (self.seconds_per_token >= 0 and self.bytes_per_token > 0):
            raise ValueError(f"invalid {self}: seconds_per_token >= 0 and bytes_per_token > 0 needed")

    def seconds(self, tokens: float, nbytes: float) -> float:
        """Seconds a section (or the sum of sections) of ``tokens`` tokens and ``nbytes``
        coded bytes takes to decode."""
        return self.seconds_per_token * (PER_TOKEN_SHARE * tokens
                                         + (1.0 - PER_TOKEN_SHARE) * nbytes / self.bytes_per_token)


def measure(sections: Sequence[tuple[int, int, float]]) -> DecodeCost | None:
    """The cost over the last ``RECENT_SECTIONS`` of ``sections`` ((tokens, bytes, seconds),
    oldest first; token-weighted), or None with none (sections of no tokens or no bytes
    are ignored)."""
    recent = [s for s in sections if s[0] > 0 and s[1] > 0][-RECENT_SECTIONS:]
    if any(not seconds >= 0 for _, _, seconds in recent):
        raise ValueError(f"decode seconds must be >= 0, got {recent}")
    if not recent:
        return None
    tokens = sum(t for t, _, _ in recent)
    rates = sorted(s / t for t, _, s in recent)
    cap = STALL_FACTOR * rates[len(rates) // 2]
    seconds = sum(min(s, cap * t) for t, _, s in recent)
    return DecodeCost(seconds / tokens, sum(b for _, b, _ in recent) / tokens)


def measure_whole(tokens: int, layers: int, coded_bytes: int, seconds: Sequence[float]) -> DecodeCost:
    """The cost shown by whole-chunk decodes of ``tokens`` tokens and ``layers`` layers
    (``coded_bytes`` of sections), each taking one of ``seconds`` (the mean counts): a
    section is one layer of the chunk, so the figures are per token and layer."""
    if not (tokens > 0 and layers > 0 and coded_bytes > 0 and seconds):
        raise ValueError(f"measure_whole needs tokens, layers, coded_bytes > 0 and some seconds, got "
                         f"{tokens}, {layers}, {coded_bytes}, {list(seconds)}")
    token_layers = tokens * layers
    return DecodeCost(sum(seconds) / len(seconds) / token_layers, coded_bytes / token_layers)


def prior_sections(prior: DecodeCost, tokens: int, layers: int) -> list[tuple[int, int, float]]:
    """``prior`` as ``layers`` sections of ``tokens`` tokens each (one chunk's worth), in
    the (tokens, bytes, seconds) form ``measure`` reads (bytes rounded to whole ones)."""
    nbytes = max(round(prior.bytes_per_token * tokens), 1)
    return [(tokens, nbytes, prior.seconds_per_token * tokens)] * layers
