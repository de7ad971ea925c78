"""Overlap of upload and decode as a pure, sans-I/O scheduler: sections in, commands out.

The GPU decode of a stream of chunks wants: one upload and one decode per *group* of a
few arrived layers; a copy stream and a decode stream ordered by events, so that chunk
i decodes while chunk i+1 uploads; page-locked host buffers reused, never refilled
while a copy still reads them or a decode still reads their device twin. The ordering
rules live here, apart from CUDA, as an object that is told what arrived and answers
with commands; ``kvwire_kernels.gpu`` carries them out with PyCUDA and torch, and
tests/test_schedule.py with a fake backend that checks the rules on a simulated clock.

Events are named, not created: ``Event("copied", chunk, group)`` is recorded on the copy
stream after a group's upload, ``Event("decoded", chunk, group)`` on the decode stream
after its decode. A command's ``wait``/``after`` fields name events recorded by earlier
commands (or None), so a backend keeps one table from names to its own events.

Rules (each a test):

* every section is verified (length, CRC, lane table) exactly once, on arrival;
* a group closes when ``group_layers`` layers of a chunk have arrived, or its chunk's last
  layer has, or on :meth:`Scheduler.flush`: a layer is uploaded no later than one group
  after its bytes arrived;
* buffers are used round robin: a group's host write waits for the previous copy out of
  that buffer, its device copy for the previous decode of that buffer;
* layers are delivered in layer order, each after its group's decode (a layer that
  arrived early waits for the layers before it);
* a chunk is held only while it is open: once fully delivered or cancelled
  (:meth:`Scheduler.cancel`) nothing of it stays, except, until the buffers are used
  again, the events of its last copy into and decode from each buffer, which the next
  group in that buffer still waits for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Event:
    """A CUDA event by name: ``kind`` is "copied" (copy stream) or "decoded" (decode stream)."""

    kind: str
    chunk: int
    group: int


@dataclass(frozen=True)
class Verify:
    """Check the section's length and CRC and parse its lane table, on the host, once."""

    chunk: int
    layer: int


@dataclass(frozen=True)
class Upload:
    """Pack the group's verified sections into page-locked host buffer ``buffer`` once
    ``host_wait`` has fired (the last copy out of it), then, on the copy stream and after
    ``device_wait`` (the last decode of its device twin), copy it to the device in one
    transfer and record ``Event("copied", chunk, group)``."""

    chunk: int
    group: int
    layers: tuple[int, ...]
    buffer: int
    host_wait: Event | None
    device_wait: Event | None


@dataclass(frozen=True)
class Launch:
    """On the decode stream, after ``after`` (the group's copy): entropy-decode the
    group's layers from device buffer ``buffer``, reconstruct them (one batched GEMM),
    and record ``Event("decoded", chunk, group)``."""

    chunk: int
    group: int
    layers: tuple[int, ...]
    buffer: int
    after: Event


@dataclass(frozen=True)
class Deliver:
    """Hand the group's layers to the consumer once ``after`` (its decode) has fired."""

    chunk: int
    layers: tuple[int, ...]
    after: Event


Command = Union[Verify, Upload, Launch, Deliver]


@dataclass
class _Buffer:
    copied: Event | None = None     # the last copy out of the host buffer
    decoded: Event | None = None    # the last decode reading the device buffer


@dataclass
class _Chunk:
    layers: int
    arrived: set[int] = field(default_factory=set)
    pending: list[int] = field(default_factory=list)
    groups: int = 0
    scheduled: dict[int, int] = field(default_factory=dict)  # layer -> its group
    delivered: int = 0                                       # layers 0 .. delivered-1 are


class Scheduler:
    """The ordering of a stream of chunks' sections through ``buffers`` reused buffers."""

    def __init__(self, group_layers: int, buffers: int = 2) -> None:
        if group_layers < 1:
            raise ValueError(f"group_layers must be >= 1, got {group_layers}")
        if buffers < 2:
            raise ValueError(f"buffers must be >= 2 (one uploads while one decodes), got {buffers}")
        self.group_layers = group_layers
        self._buffers = [_Buffer() for _ in range(buffers)]
        self._next_buffer = 0
        self._chunks: dict[int, _Chunk] = {}

    @property
    def open_chunks(self) -> tuple[int, ...]:
        """The chunks opened and neither fully delivered nor cancelled."""
        return tuple(self._chunks)

    def open_chunk(self, chunk: int, layers: int) -> None:
        """Announce a chunk of ``layers`` sections (its header has arrived)."""
        if chunk in self._chunks:
            raise ValueError(f"chunk {chunk} is already open")
        if layers < 1:
            raise ValueError(f"a chunk has at least one layer, got {layers}")
        self._chunks[chunk] = _Chunk(layers)

    def arrived(self, chunk: int, layer: int) -> list[Command]:
        """A section's bytes are all here: verify it, and upload and decode its group
        when the group is complete."""
        state = self._chunks.get(chunk)
        if state is None:
            raise ValueError(f"chunk {chunk} was not opened")
        if not 0 <= layer < state.layers or layer in state.arrived:
            raise ValueError(f"chunk {chunk}: layer {layer} is out of range or arrived twice")
        state.arrived.add(layer)
        state.pending.append(layer)
        commands: list[Command] = [Verify(chunk, layer)]
        if len(state.pending) >= self.group_layers or len(state.arrived) == state.layers:
            commands += self._close_group(chunk, state)
        return commands

    def flush(self) -> list[Command]:
        """Close every partial group now (e.g. the stream stalled): nothing waits for
        layers that may be slow to come."""
        commands: list[Command] = []
        for chunk, state in self._chunks.items():
            if state.pending:
                commands += self._close_group(chunk, state)
        return commands

    def cancel(self, chunk: int) -> None:
        """Forget a chunk no one waits for any more (its session gave up on it): its
        arrived layers not yet in a group are dropped, no more of its layers are
        delivered, and a later ``arrived`` for it is refused as not opened. Groups of it
        already uploaded or launched still finish on the streams; each buffer keeps the
        events of its last use, so the next group in that buffer waits for them as
        always. Cancelling a chunk not open (delivered, or cancelled before) does nothing."""
        self._chunks.pop(chunk, None)

    def _close_group(self, chunk: int, state: _Chunk) -> list[Command]:
        layers, state.pending = tuple(state.pending), []
        group = state.groups
        state.groups += 1
        index = self._next_buffer
        self._next_buffer = (index + 1) % len(self._buffers)
        buffer = self._buffers[index]
        copied, decoded = Event("copied", chunk, group), Event("decoded", chunk, group)
        commands: list[Command] = [Upload(chunk, group, layers, index, buffer.copied, buffer.decoded),
                                   Launch(chunk, group, layers, index, copied)]
        buffer.copied, buffer.decoded = copied, decoded
        state.scheduled.update((layer, group) for layer in layers)
        ready = []
        while state.delivered + len(ready) in state.scheduled:
            ready.append(state.delivered + len(ready))
        if ready:  # the decode stream runs groups in order: the last one's event covers all
            last = max(state.scheduled[layer] for layer in ready)
            commands.append(Deliver(chunk, tuple(ready), Event("decoded", chunk, last)))
            state.delivered += len(ready)
        if state.delivered == state.layers:
            del self._chunks[chunk]
        return commands
