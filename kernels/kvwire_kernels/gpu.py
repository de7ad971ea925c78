"""GPU decode through PyCUDA: the thin adapter that carries out ``kvwire_kernels.schedule``'s commands.

Everything that decides *what* happens when is elsewhere and tested without a GPU: the
order of uploads, launches and deliveries (``kvwire_kernels.schedule``), the one-buffer layout of
a group's lane arrays (``kvwire_kernels.packing``), stage 2 of the decode (``kvwire_kernels.reconstruct``:
one batched GEMM per group, means, RoPE, written straight into the caller's tensors) and
the device strings (``kvwire_kernels.devices``). This module only maps them onto CUDA: a copy
stream and a decode stream, one named event per command, page-locked host buffers reused
round robin with a device twin each, and per group of layers one upload, one launch of the
rANS lane kernel over all the group's lanes (its section table packed with the arrays)
and one GEMM.

Context safety: one primary context per device, retained once (``pycuda.driver.Device(n)
.retain_primary_context()``, the context torch uses too) and pushed around every call in
whatever thread makes it, popped after; ``cuda:N`` decodes on device N; one decoder per
device (:func:`decoder`, in ``kvwire_kernels.devices``' registry, whose ``close_all`` the receiver
daemon calls on shutdown: it synchronizes and releases every decoder).

Entropy decoding and dequantization are bit-identical to the CPU decoder; the GEMM takes
the same bfloat16 operands and its summation order differs (cuBLAS vs oneDNN), so output
agrees with the CPU's but for a bfloat16 unit of the product where a float32 sum lies
next to a rounding boundary (FORMAT.md, "Inverse transform"). A raw section's tokens and
sink tokens are copied synchronously (rare).
"""
from __future__ import annotations

import math
import os
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

import codec
from codec import layer_codec, prediction
from codec.errors import GpuUnavailable
from codec.profile import Profile

from . import packing, reconstruct
from . import devices
from .devices import availability, require  # noqa: F401  (availability: kvwire_kernels.gpu's API)
from .schedule import Deliver, Event, Launch, Scheduler, Upload, Verify

KERNEL_DIR = Path(__file__).resolve().parent
KERNEL_SOURCES = ("rans_decode.cu",)
THREADS_PER_BLOCK = 128
#: layers per upload and GEMM: a layer is delivered at most this many layers after it arrives
GROUP_LAYERS = 4


def kernel_source() -> str:
    return "\n".join((KERNEL_DIR / name).read_text() for name in KERNEL_SOURCES)


@dataclass
class _CoderTables:
    freq: torch.Tensor
    cdf: torch.Tensor
    lut: torch.Tensor


def coder_cache() -> "weakref.WeakKeyDictionary[Profile, _CoderTables]":
    """A decoder's device copies of each profile's coder tables, for as long as the profile
    lives: a long-running receiver sees profiles come and go (re-downloaded, embedded), and
    a plain dict keyed by the identity-compared profile kept every one until close()."""
    return weakref.WeakKeyDictionary()


@dataclass
class _Inflight:
    """A launched group: what must stay alive until its decode event fires, and where each
    coded layer's lanes are in its status."""

    status: torch.Tensor
    layers: tuple[packing.LayerLayout, ...]
    coefficients: torch.Tensor


class GpuDecoder:
    """Decodes blob sections into CUDA tensors of one device, overlapping upload and decode."""

    def __init__(self, device: str | torch.device = "cuda", group_layers: int = GROUP_LAYERS,
                 buffers: int = 2) -> None:
        self.index = require(device)
        import pycuda.driver as cuda
        from pycuda.compiler import SourceModule

        self._cuda = cuda
        cuda.init()
        self.device = torch.device("cuda", self.index)
        self.group_layers, self._buffer_count = group_layers, buffers
        self._context = cuda.Device(self.index).retain_primary_context()
        self._lock = threading.Lock()   # one decode_into at a time: they share self.buffers
        self._closed = False            # current() checks it, the constructor included
        with self.current():
            cache = Path(os.environ.get("KVWIRE_CUDA_CACHE", Path.home() / ".cache" / "kvwire" / "cuda"))
            cache.mkdir(parents=True, exist_ok=True)
            self._module = SourceModule(kernel_source(), no_extern_c=True, cache_dir=str(cache),
                                        options=["-O3", "--fmad=false"])
            self._kernel = self._module.get_function("rans_decode_group")
            self.copy_stream, self.decode_stream = cuda.Stream(), cuda.Stream()
            self._torch_decode = torch.cuda.ExternalStream(self.decode_stream.handle, device=self.device)
        self.buffers = Buffers(self, buffers)
        self._coder = coder_cache()

    # ------------------------------------------------------------------ context
    @contextmanager
    def current(self) -> Iterator[None]:
        """This device's primary context current in the calling thread (pushed, then popped)."""
        if self._closed:
            raise GpuUnavailable(f"the decoder of cuda:{self.index} is closed")
        self._context.push()
        try:
            with torch.cuda.device(self.index):
                yield
        finally:
            self._cuda.Context.pop()

    def close(self) -> None:
        """Wait for the streams, free the buffers, release the primary context."""
        if self._closed:
            return
        with self._lock, self.current():
            self.copy_stream.synchronize()
            self.decode_stream.synchronize()
            self.buffers, self._coder = Buffers(self, 0), coder_cache()
        self._closed = True
        self._context.detach()

    # ------------------------------------------------------------------ decode
    def decode_into(self, header: codec.BlobHeader, profile: Profile | None,
                    sections: Iterable[tuple[int, bytes | memoryview]], count: int | None = None,
                    outs: dict[int, torch.Tensor] | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer, k, v) in arrival order as ``count`` (default: every layer) sections
        (layer, bytes) arrive, each written into ``outs[layer]`` ([2, tokens, heads,
        head_dim] on this device; allocated when absent): group g+1 uploads while group g
        decodes."""
        resolved, slot = codec.resolve_profile(header, profile)
        with self._lock:  # held for the whole decode: self.buffers are reused across its groups
            scheduler, events = self.scheduling()
            run = ChunkRun(self, self.buffers, events, 0, header, resolved, slot, {} if outs is None else outs, count)
            scheduler.open_chunk(0, run.expected)
            for layer, section in sections:
                with self.current():  # current only while working, never across a yield
                    run.execute(scheduler.arrived(0, run.arrive(layer, section)))
                    ready = run.delivered(block=False)
                yield from _raise_first(ready)
            with self.current():
                ready = run.delivered(block=True)
            yield from _raise_first(ready)

    def decode_layers(self, header: codec.BlobHeader, profile: Profile | None,
                      sections: Iterable[tuple[int, bytes | memoryview]]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer, k, v) in order on this device (``codec.decode_layers(device="cuda")``)."""
        yield from self.decode_into(header, profile, sections)

    def decode_section(self, header: codec.BlobHeader, profile: Profile | None, layer: int,
                       section: bytes | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [tokens, heads, head_dim] on this device from one layer's section bytes
        (in a predicted blob, an intra-coded layer's only: the others decode from the
        layers before them, with decode_layers)."""
        resolved, _ = codec.resolve_profile(header, profile)
        if header.predicted and not prediction.is_intra(layer, resolved.restart):
            raise ValueError(f"layer {layer} of a predicted blob decodes from the layers before it: decode "
                             f"them in order from layer {prediction.restart_layer(layer, resolved.restart)} "
                             f"with decode_layers")
        for _, k, v in self.decode_into(header, profile, [(layer, section)], count=1):
            return k, v
        raise AssertionError("a one-section decode delivers its layer")

    # ------------------------------------------------------------------ pieces the run uses
    def coder_tables(self, profile: Profile) -> _CoderTables:
        tables = self._coder.get(profile)
        if tables is None:
            host = layer_codec.coder_tables(profile)
            to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
            tables = _CoderTables(to(host.freq.view(np.int16)), to(host.cdf.view(np.int16)), to(host.lut))
            self._coder[profile] = tables
        return tables

    def scheduling(self) -> tuple[Scheduler, "EventTable"]:
        """A scheduler over this decoder's group size and buffers, and a table for the
        events its commands name (sized to keep each buffer's latest copy and decode)."""
        return Scheduler(self.group_layers, self._buffer_count), EventTable(self._cuda, 4 * self._buffer_count)

    def decode_context(self):
        """torch work issued inside runs on the decode stream."""
        return torch.cuda.stream(self._torch_decode)

    def launch_group(self, base: int, group: packing.GroupLayout, tables: _CoderTables, coded: int,
                     coef: torch.Tensor, status: torch.Tensor) -> None:
        """One launch of the lane kernel over every lane of a packed group (its buffer at
        device address ``base``), on the decode stream."""
        if not group.lanes:
            return
        ptr = lambda t: np.uintp(t.data_ptr())  # noqa: E731
        self._kernel(np.uintp(base), np.uintp(base), np.int32(len(group.layers)), np.int32(group.lanes),
                     ptr(tables.freq), ptr(tables.cdf), ptr(tables.lut), np.int32(coded), ptr(coef), ptr(status),
                     block=(THREADS_PER_BLOCK, 1, 1), grid=(math.ceil(group.lanes / THREADS_PER_BLOCK), 1),
                     stream=self.decode_stream)


class Buffers:
    """Page-locked host buffers, each with a device twin, used round robin by one scheduler."""

    def __init__(self, decoder: GpuDecoder, count: int) -> None:
        self._decoder = decoder
        self.host: list[np.ndarray] = [np.empty(0, np.uint8)] * count
        self.device: list[torch.Tensor | None] = [None] * count

    def get(self, index: int, size: int) -> tuple[np.ndarray, torch.Tensor]:
        """Buffer ``index`` and its twin, grown to ``size`` bytes (growing waits for both
        streams: the old buffers may still be read)."""
        if self.host[index].size < size:
            d = self._decoder
            d.copy_stream.synchronize()
            d.decode_stream.synchronize()
            capacity = max(size, 2 * self.host[index].size)
            self.host[index] = d._cuda.pagelocked_empty(capacity, np.uint8)
            self.device[index] = torch.empty(capacity, dtype=torch.uint8, device=d.device)
        return self.host[index], self.device[index]


class EventTable:
    """Named CUDA events of one device's streams: recorded by the commands, waited on by
    later ones. Only a buffer's latest copy and decode are ever waited on (the scheduler
    names nothing older), so the table keeps the newest ``keep`` and forgets the rest."""

    def __init__(self, cuda, keep: int) -> None:
        self._cuda, self._keep = cuda, keep
        self._events: dict[Event, object] = {}

    def record(self, name: Event, stream) -> object:
        event = self._cuda.Event()
        event.record(stream)
        self._events[name] = event
        while len(self._events) > self._keep:
            del self._events[next(iter(self._events))]
        return event

    def __getitem__(self, name: Event) -> object:
        return self._events[name]


#: (layer, k, v, error): a delivered layer, or the error that stopped it
Delivered = tuple[int, "torch.Tensor | None", "torch.Tensor | None", "Exception | None"]


class ChunkRun:
    """One chunk's state while its decoder carries out the scheduler's commands."""

    def __init__(self, decoder: GpuDecoder, buffers: Buffers, events: EventTable, chunk: int,
                 header: codec.BlobHeader, profile: Profile, slot: int, outs: dict[int, torch.Tensor],
                 expected: int | None = None) -> None:
        self.decoder, self.buffers, self.events, self.chunk = decoder, buffers, events, chunk
        self.header, self.profile, self.slot, self.outs = header, profile, slot, outs
        #: sections this run takes (all the header's layers, or fewer: one refetched layer)
        self.expected = header.layers if expected is None else expected
        self.layer_at: list[int] = []    # the scheduler's positions (arrival order) -> layers
        self.sections: dict[int, bytes | memoryview] = {}
        self.parsed: dict[int, reconstruct.ParsedSection] = {}
        self.failed: dict[int, Exception] = {}   # layers whose section failed its checks
        self.packed: packing.GroupLayout | None = None   # the group just uploaded, for its launch
        self.deliveries: deque[tuple[object, int, list[int]]] = deque()   # (event, group, layers)
        self.inflight: dict[int, _Inflight] = {}   # group -> what its decode reads and writes
        #: a predicted blob's (format 7) last reconstructed layer, which the next is predicted from
        self.chain = codec.LayerChain() if header.predicted else None

    def arrive(self, layer: int, section: bytes | memoryview) -> int:
        """Take a section's bytes; its position for the scheduler."""
        if not 0 <= layer < self.header.layers or layer in self.layer_at:
            raise ValueError(f"layer {layer} is out of range or arrived twice")
        self.layer_at.append(layer)
        self.sections[layer] = section
        return len(self.layer_at) - 1

    def complete(self) -> bool:
        return len(self.layer_at) == self.expected and not self.deliveries

    def execute(self, commands) -> None:
        """Carry out this chunk's commands; deliveries queue in order for their events."""
        d = self.decoder
        for command in commands:
            if isinstance(command, Verify):
                layer = self.layer_at[command.layer]
                try:
                    self.parsed[layer] = reconstruct.parse_section(self.header, self.profile, self.slot, layer,
                                                                   self.sections.pop(layer))
                except codec.CorruptBitstream as exc:
                    self.failed[layer] = exc
            elif isinstance(command, Upload):
                if command.host_wait is not None:
                    self.events[command.host_wait].synchronize()   # the last copy out of this buffer
                coded = [(l, self.parsed[l].lanes) for l in self._layers(command.layers)
                         if self.parsed[l].lanes is not None]
                host, dev = self.buffers.get(command.buffer, packing.group_size(coded))
                self.packed = packing.pack(coded, host, self.header.coded_tokens)
                if command.device_wait is not None:
                    d.copy_stream.wait_for_event(self.events[command.device_wait])
                if self.packed.used:
                    d._cuda.memcpy_htod_async(dev.data_ptr(), host[:self.packed.used], d.copy_stream)
                self.events.record(Event("copied", command.chunk, command.group), d.copy_stream)
            elif isinstance(command, Launch):
                d.decode_stream.wait_for_event(self.events[command.after])
                self._launch(command)
                self.events.record(Event("decoded", command.chunk, command.group), d.decode_stream)
            else:
                assert isinstance(command, Deliver)
                self.deliveries.append((self.events[command.after], command.after.group,
                                        [self.layer_at[p] for p in command.layers]))

    def _layers(self, positions: tuple[int, ...]) -> list[int]:
        """The layers at these positions whose sections passed their checks (and, in a
        predicted blob, so did those of the layers they are predicted from)."""
        return [l for l in (self.layer_at[p] for p in positions) if l not in self.failed and not self._cut_off(l)]

    def _cut_off(self, layer: int) -> bool:
        """Whether a predicted blob's ``layer`` decodes from a layer that failed: one between
        its intra-coded layer and it (its section's checks, or the kernel's, found it corrupt)."""
        return self.chain is not None and any(
            l in self.failed for l in range(prediction.restart_layer(layer, self.profile.restart), layer))

    def _launch(self, command: Launch) -> None:
        d, header, packed = self.decoder, self.header, self.packed
        assert packed is not None   # the scheduler launches a group right after its upload
        tables = d.coder_tables(self.profile)
        device_buffer = self.buffers.device[command.buffer]   # None until a group had coded layers
        base = 0 if device_buffer is None else device_buffer.data_ptr()
        layouts = {layout.layer: layout for layout in packed.layers}
        group = [self.parsed.pop(l) for l in self._layers(command.layers)]
        with d.decode_context():
            coef = torch.empty(packed.out_floats, dtype=torch.float32, device=d.device)
            status = torch.zeros(packed.lanes, dtype=torch.int32, device=d.device)
            d.launch_group(base, packed, tables, header.coded_tokens, coef, status)
            coefs: list[torch.Tensor | None] = []
            for parsed in group:   # each coded layer's [tokens, rows] in the launch's output
                layout = layouts.get(parsed.layer)
                coefs.append(None if layout is None else layout.coefficients(coef))
            outs = [self.outs.setdefault(p.layer, torch.empty((2, header.tokens, header.heads, header.head_dim),
                                                              dtype=header.dtype, device=d.device)) for p in group]
            if group:
                reconstruct.reconstruct(header, self.profile, group, coefs, outs, self.chain)
        self.inflight[command.group] = _Inflight(status, packed.layers, coef)

    def delivered(self, block: bool) -> list[Delivered]:
        """The queued deliveries whose decode has finished, in order (all of them, waiting,
        when ``block``): (layer, k, v, None), or (layer, None, None, error) for a section
        that failed its checks or a lane that failed in the kernel."""
        out: list[Delivered] = []
        while self.deliveries:
            event, last, layers = self.deliveries[0]
            if not block and not event.query():
                break
            event.synchronize()
            self.deliveries.popleft()
            for group in sorted(g for g in self.inflight if g <= last):  # the decode stream runs in order
                inflight = self.inflight.pop(group)
                codes = inflight.status.cpu().numpy()
                for layout in inflight.layers:
                    code = int(layout.statuses(codes).max(initial=0))
                    if code:
                        self.failed[layout.layer] = codec.CorruptBitstream(
                            f"layer {layout.layer}: entropy-coded data is corrupt (code {code})")
            for layer in layers:
                error = self.failed.get(layer)
                if error is None and self._cut_off(layer):
                    error = self.failed[layer] = codec.CorruptBitstream(
                        f"layer {layer} is predicted from a layer before it that is corrupt")
                out.append((layer, None, None, error) if error else
                           (layer, self.outs[layer][0], self.outs[layer][1], None))
        return out


def _raise_first(delivered: list[Delivered]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    for layer, k, v, error in delivered:
        if error is not None:
            raise error
        yield layer, k, v


def decoder(device: str | torch.device = "cuda") -> GpuDecoder:
    """The process-wide decoder of a device (compiles the kernel and retains the primary
    context once per device; ``kvwire_kernels.devices.close_all`` releases it)."""
    return devices.shared(device, "decoder", lambda index: GpuDecoder(torch.device("cuda", index)))
