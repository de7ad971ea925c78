"""GPU decode of a stream of chunks whose sections arrive one by one (a session, the daemon).

``submit`` takes a section as it lands and returns a future; one worker thread per device
feeds every section to one ``kvwire_kernels.schedule.Scheduler`` over all chunks, so groups of a
chunk's layers upload and decode as they fill, and chunk i's last groups decode while chunk
i+1's first ones upload. When no section comes for ``idle_seconds`` the worker closes the
partial groups (``Scheduler.flush``) and waits for every decode, so a layer never waits
for bytes that may be slow to come. The worker is the only thread that touches CUDA for
this stream; it makes the device's primary context current around its work.

A chunk is told apart by its header object (a session parses one per chunk); a layer sent
again for a chunk (a refetch after a corrupt section) is a one-layer chunk of its own in
the scheduler, so the header's chunk still completes when its other layers have come.
:meth:`StreamDecoder.cancel` gives up on a chunk (its session cancelled it). Nothing of
a chunk is held once it is fully delivered or cancelled: a long-lived daemon does not grow.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from dataclasses import dataclass

import torch

import codec
from codec.profile import Profile

from . import devices
from .gpu import Buffers, ChunkRun, EventTable, GpuDecoder, decoder
from .schedule import Scheduler

_STOP = object()


@dataclass(frozen=True)
class _Cancel:
    header: codec.BlobHeader


class StreamDecoder:
    """Sections in (from any thread), futures of (k, v) out, decoded on one device."""

    def __init__(self, decoder: GpuDecoder, idle_seconds: float = 0.002) -> None:
        self.decoder, self.idle_seconds = decoder, idle_seconds
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"kvwire-cuda{decoder.index}", daemon=True)
        self._thread.start()

    def submit(self, header: codec.BlobHeader, profile: Profile | None, layer: int,
               section: bytes | memoryview) -> concurrent.futures.Future:
        """Queue one layer's section; the future resolves to its (k, v) on the device, or to
        the CorruptBitstream its checks or its lanes raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            raise RuntimeError("the stream decoder is closed")
        self._queue.put((header, profile, layer, bytes(section), future))
        return future

    def __call__(self, header: codec.BlobHeader, profile: Profile | None, layer: int,
                 section: bytes | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocking form: what ``codec.decode_section`` callers expect."""
        return self.submit(header, profile, layer, section).result()

    def cancel(self, header: codec.BlobHeader) -> None:
        """Give up on the chunk of ``header``: its futures not resolved yet are cancelled,
        the worker and its scheduler forget it, and sections submitted for it later are
        cancelled at once. Its groups already on the streams finish there (their memory
        is the decode stream's, so nothing later reuses it early)."""
        self._queue.put(_Cancel(header))

    def close(self) -> None:
        """Finish what was submitted, then stop the worker."""
        self._queue.put(_STOP)
        self._thread.join()

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        """Feed sections to the scheduler; on idle, flush and wait; never die silently."""
        d = self.decoder
        scheduler, events = d.scheduling()
        state = self._state = _StreamState(scheduler, Buffers(d, d._buffer_count), events)
        while True:
            try:
                item = self._queue.get(timeout=self.idle_seconds)
            except queue.Empty:
                self._step(state, None)
                item = self._queue.get()
            if item is _STOP:
                self._step(state, None)
                return
            self._step(state, item)

    def _step(self, state: "_StreamState", item: tuple | _Cancel | None) -> None:
        """One arrival or cancel (or, for None, a flush of every partial group and a wait
        for every decode); an unexpected error fails every pending future instead of
        hanging them."""
        d = self.decoder
        try:
            with d.current():
                if item is None:
                    state.dispatch(state.scheduler.flush())
                    state.resolve(block=True)
                    return
                if isinstance(item, _Cancel):
                    state.cancel(item.header)
                    return
                header, profile, layer, section, future = item
                if state.cancelled.get(id(header)) is header:
                    future.cancel()
                    return
                try:
                    resolved, slot = codec.resolve_profile(header, profile)
                except codec.CorruptBitstream as exc:
                    future.set_exception(exc)
                    return
                run, futures = state.run_for(d, header, resolved, slot, layer)
                futures[layer] = future
                state.dispatch(state.scheduler.arrived(run.chunk, run.arrive(layer, section)))
                state.resolve(block=False)
        except Exception as exc:  # noqa: BLE001  (handed to every caller waiting)
            state.fail(exc)


class _StreamState:
    """The worker's scheduler, buffers, events and open chunks."""

    def __init__(self, scheduler: Scheduler, buffers: Buffers, events: EventTable) -> None:
        self.scheduler, self.buffers, self.events = scheduler, buffers, events
        self.runs: dict[int, tuple[ChunkRun, dict]] = {}          # scheduler chunk -> (run, layer -> future)
        self.by_header: dict[int, tuple[codec.BlobHeader, int]] = {}   # id(header) -> (header, its open chunk)
        # headers that had a chunk, and those cancelled: weak, so they go with their sessions
        self.seen: weakref.WeakValueDictionary[int, codec.BlobHeader] = weakref.WeakValueDictionary()
        self.cancelled: weakref.WeakValueDictionary[int, codec.BlobHeader] = weakref.WeakValueDictionary()
        self.chunks = 0

    def run_for(self, d: GpuDecoder, header: codec.BlobHeader, profile: Profile, slot: int, layer: int
                ) -> tuple[ChunkRun, dict]:
        """The open chunk of this header; else a new one of all its layers (a header not
        seen before) or of this layer alone (a layer sent again: a refetch)."""
        known = self.by_header.get(id(header))
        entry = self.runs.get(known[1]) if known is not None and known[0] is header else None
        if entry is not None and layer not in entry[0].layer_at:
            return entry
        first = self.seen.get(id(header)) is not header
        expected = header.layers if first else 1
        chunk, self.chunks = self.chunks, self.chunks + 1
        self.scheduler.open_chunk(chunk, expected)
        entry = (ChunkRun(d, self.buffers, self.events, chunk, header, profile, slot, {}, expected), {})
        self.runs[chunk] = entry
        if first:
            self.by_header[id(header)] = (header, chunk)
            self.seen[id(header)] = header
        return entry

    def dispatch(self, commands) -> None:
        """Each command to the run of its chunk, in order."""
        for command in commands:
            self.runs[command.chunk][0].execute([command])

    def resolve(self, block: bool) -> None:
        """Resolve the futures of every decoded layer; forget chunks fully delivered."""
        for chunk in list(self.runs):
            run, futures = self.runs[chunk]
            for layer, k, v, error in run.delivered(block):
                future = futures.pop(layer)
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result((k, v))
            if run.complete() and not futures:
                self._forget(chunk)

    def cancel(self, header: codec.BlobHeader) -> None:
        """Forget every chunk of ``header`` (cancelling its futures) and refuse its later sections."""
        self.cancelled[id(header)] = header
        for chunk in [c for c, (run, _) in self.runs.items() if run.header is header]:
            for future in self.runs[chunk][1].values():
                future.cancel()
            self._forget(chunk)

    def fail(self, exc: Exception) -> None:
        """Hand ``exc`` to every waiting future and forget every chunk."""
        for chunk in list(self.runs):
            for future in self.runs[chunk][1].values():
                if not future.done():
                    future.set_exception(exc)
            self._forget(chunk)

    def _forget(self, chunk: int) -> None:
        run, _ = self.runs.pop(chunk)
        self.scheduler.cancel(chunk)   # nothing, for a chunk it delivered in full
        if self.by_header.get(id(run.header), (None, None))[1] == chunk:
            del self.by_header[id(run.header)]


def stream_decoder(device: str | torch.device = "cuda") -> StreamDecoder:
    """The process-wide stream decoder of a device (sessions and the daemon share it),
    running on that device's decoder (``kvwire_kernels.gpu.decoder``)."""
    return devices.shared(device, "stream", lambda index: StreamDecoder(decoder(torch.device("cuda", index))))
