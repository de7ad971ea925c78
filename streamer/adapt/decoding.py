"""The receiver's decode cost: seconds per layer section, as its decoder shows it.

A KV chunk is delivered once its sections are decoded, and the decoder is a pipeline
stage of its own: chunk ``i`` decodes while chunk ``i + 1`` arrives. Where the decoder is
slower than the link (a CPU decoder beside a fast link), a plan timed by the link alone
finishes long after its estimate: the decode backlog grows behind the link, and a text
chunk's recompute, which waits for the chunk before it to be delivered, starts that much
later. ``kvwire demo`` on a 2-core host missed its 1 s SLO that way (at 2c693ff: last
byte in at 0.56 s, decode of the backlog until 0.64 s, then a text chunk's 0.41 s
recompute: 1.05 s). So the planners time a KV option at the slower of its transfer and
its decode (``base.link_seconds``), and the decode still owed comes off their budget
(``base.pipeline_budget``).

A section's decode is partly per element (rANS symbols, dequantisation, the inverse
transform) and partly per coded byte. Decoded alone on this session's machine, the
demo's MiniLM chunks take 27 ms at level 4 and 48 ms at level 0 (3.8x the bytes): about
half of a mid-level chunk's time is per token. During a fetch on 2 cores the same chunks
took 2-5x longer, and longer still while the link ran fast (the receiving loop, the
sender and the proxy share the cores), so the two terms cannot be told apart from the
sections a fetch decodes: a least-squares fit read the load as a price of bytes (the
sections decoded under load were the large ones) and sent a feasible fetch to level 4;
a per-token figure alone made every level look alike when the decoder was the
bottleneck, and the plan kept level 0, whose decode then ran 20 ms past a 1 s SLO. So
the *scale* is measured (the mean over the recent sections, which follows the load) and
the *split* is fixed: ``PER_TOKEN_SHARE`` of a section's time at the measured sections'
bytes per token is per token, the rest scales with its bytes.

Before a session has decoded anything the plan has no figure, and the first chunks went
out timed by the link alone (``kvwire demo``: levels 1-2 then 0, then level 4 once the
decoder had been timed; the steady stretch was not one level). A caller that has timed
the decoder (a chunk decoded before the fetch, through ``measure_whole``; ``kvwire
receive`` passes what its last fetch measured) gives that as
``SessionConfig.decode_prior``; it stands in for one chunk's sections
(``prior_sections``): the session's own timings weigh as much after one chunk, more
after two, and replace it within ``RECENT_SECTIONS``.

Pure; the delivery times each section as it is decoded, the session asks here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: How many recent sections the cost is judged by: a few chunks' worth, so it follows the
#: load of the moment and no single slow section decides it.
RECENT_SECTIONS = 24
#: Share of a section's decode that is per token at the bytes per token of the sections
#: measured (the rest scales with its coded bytes): ~0.5 from the idle timings above.
PER_TOKEN_SHARE = 0.5


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
    return DecodeCost(sum(s for _, _, s in recent) / tokens, sum(b for _, b, _ in recent) / tokens)


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
