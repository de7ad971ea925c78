"""What a fetch did, chunk by chunk: the record a caller, a CLI and a benchmark read."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ChunkReport:
    """One chunk of a fetch.

    ``level`` is the quality level delivered through ``on_layer`` (of its last layers, if
    it was continued at a lower level: ``layer_levels``), or ``"text"`` when the chunk
    went to ``on_text`` (the caller recomputes it). ``seconds`` runs from the
    request leaving to the last byte arriving; ``busy_seconds`` is the part of it the
    link spent on this chunk (idle and queueing excluded), and ``throughput_bps``
    (bits per second) is measured over that busy time only.
    """

    index: int
    level: int | str
    bytes: int = 0
    seconds: float = 0.0
    busy_seconds: float = 0.0
    throughput_bps: float = 0.0
    decode_seconds: float = 0.0
    #: seconds the caller's on_text took to recompute the chunk (text chunks; 0 otherwise)
    recompute_seconds: float = 0.0
    #: seconds from fetch() to the chunk's last byte
    finished_at: float = 0.0
    #: the throughput estimate (bits/s) the policy decided with; None without history
    estimate_bps: float | None = None
    #: seconds to the deadline when the decision was taken
    time_left: float = 0.0
    #: refetches after a lost connection or a corrupt section
    retries: int = 0
    #: why a chunk went to text without the policy choosing it ("deadline", "servers lost", ...)
    reason: str | None = None
    #: layers delivered through on_layer before the chunk switched to text (its sections
    #: stayed corrupt, or it was cancelled to meet the deadline): the consumer got on_text
    #: for the chunk as well and recomputes all of it
    superseded_layers: int = 0
    #: (first layer, level) of each run of layers delivered at one level, in layer order:
    #: [(0, level)] for a chunk delivered at one level, [(0, 1), (12, 3)] for one whose
    #: layers from 12 on were continued at level 3 when level 1 turned slow (``level`` is
    #: then the last run's); empty for a text chunk
    layer_levels: list[tuple[int, int]] = field(default_factory=list)
    #: levels this chunk was requested at and then cancelled (the cancel rule predicted
    #: a deadline miss, or it was queued behind such a chunk), in order
    cancelled_levels: list[int] = field(default_factory=list)


@dataclass
class FetchReport:
    context_id: str
    slo: float
    policy: str
    chunks: list[ChunkReport] = field(default_factory=list)
    total_seconds: float = 0.0
    #: seconds from fetch() to the first on_layer call (None if every chunk went to text)
    first_layer_seconds: float | None = None
    reconnects: int = 0
    #: times the cancel rule abandoned a chunk in flight
    cancels: int = 0
    #: the recompute rate (s/token) the last decisions planned text at: the configured one,
    #: or the caller's recent on_text calls when slower (``streamer.adapt.recompute``)
    recompute_seconds_per_token: float = 0.0
    #: and the seconds per token it added for each token before it (attention)
    recompute_context_seconds: float = 0.0

    @property
    def deadline_met(self) -> bool:
        return self.total_seconds <= self.slo

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.chunks)

    @property
    def text_chunks(self) -> int:
        return sum(1 for c in self.chunks if c.level == "text")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(deadline_met=self.deadline_met, bytes=self.bytes, text_chunks=self.text_chunks)
        return out
