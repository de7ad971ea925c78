"""Ordered, exactly-once delivery of decoded layers (and text chunks) to the consumer.

The network side adds a chunk's layer sections as they land; each one starts
decoding in a worker thread (the codec releases the GIL), so decoding overlaps with
receiving. A decoded layer is several times its coded size (up to ~50x at the lowest
level), so decoding ahead of the consumer is admitted against the process's memory
budget (``admit``): a section that does not fit waits, coded, until it does or until the
consumer needs it next; the section the consumer needs next always starts, so the
budget never deadlocks a fetch. A single consumer task walks chunks 0..n-1 and, within a
chunk, layers 0..L-1, awaiting each decode in turn and calling ``on_layer`` — or
``on_text`` for a chunk the session resolved as text. Because only that task
calls the callbacks, order and exactly-once hold by construction, whatever the
network does (refetches after a reset or a corrupt section just refill slots). A
plain-function ``on_text`` runs in a worker thread, so the later chunks keep arriving
while the caller recomputes (an async one must not block the loop either).

A layer counts as delivered from the moment its ``on_layer`` is called: an async
``on_layer`` may still be running when the session decides about its chunk. A chunk
some of whose layers went out may continue at another level from the layers delivered
(``resolve(chunk, level, first_layer)``: what was decoded of the old level past them is
dropped, each layer still goes out once), so one chunk's layers may come at two or more
levels (``ChunkReport.layer_levels``). A predicted blob's sections (format 7) decode in
order, each answer with its own ``codec.LayerChain``: a continuation of one starts at a
layer coded alone at or before the first not delivered, and the layers before that
one are decoded into the chain and not delivered again. It may also switch to text (its
sections stayed corrupt, or finishing it would miss the deadline): the consumer then
gets ``on_text`` for that chunk once the running call returns, and must recompute the
whole chunk, the delivered layers included (``ChunkReport.superseded_layers``).

What happens here is reported to ``observe`` as fetch-controller inputs
(``streamer.fetch.events``): sections handed to the decoder and decoded (with the
decoder's seconds), layers delivered, recomputes started and finished, chunks done,
and sections that fail their checks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

import codec
from codec.prediction import is_intra
from streamer.fetch import events as ev

TEXT = "text"

LayerCallback = Callable[[int, int, torch.Tensor, torch.Tensor], Any]
TextCallback = Callable[[int, list[int]], Any]
Observer = Callable[[ev.Event], None]
SectionDecoder = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class StreamingDecoder(Protocol):
    """A decoder that takes sections as they land and holds a chunk's state until it is
    fully decoded (``kvwire_kernels.stream.StreamDecoder``): a chunk this delivery gives up on
    must be cancelled there, else it stays held. The CPU path (``codec.decode_section``)
    is a plain function holding nothing, and has no such interface."""

    def submit(self, header: codec.BlobHeader, profile: codec.Profile | None, layer: int,
               section: bytes | memoryview) -> concurrent.futures.Future: ...

    def cancel(self, header: codec.BlobHeader) -> None: ...


@dataclass
class _Waiting:
    """A received section not yet handed to the decoder."""

    header: codec.BlobHeader
    profile: codec.Profile
    section: bytes | memoryview
    arrived: float   # perf_counter: a stream decoder's time counts from here (waits included)
    #: a layer delivered already, sent again because the layers after it are predicted
    #: from it: decoded into the answer's chain, not delivered
    context: bool = False


class _Retarget:
    """Marker that wakes the consumer when a chunk switches to text before delivery."""


@dataclass
class _ChunkSlots:
    kind: asyncio.Future          # resolves to a level (int) or TEXT
    layers: dict[int, asyncio.Future] = field(default_factory=dict)
    header: codec.BlobHeader | None = None   # of the sections last handed to the decoder
    submitted: int = 0            # layers of ``header`` handed to the decoder
    #: a predicted answer's chain (format 7), and its last decode started: the next waits for it
    chain: codec.LayerChain | None = None
    chain_tail: asyncio.Future | None = None
    failure: BaseException | None = None     # what fail_chunk made the consumer raise
    text: asyncio.Future | None = None
    delivered: int = 0            # layers whose on_layer was called (counted from the call)
    done: bool = False


class OrderedDelivery:
    def __init__(self, *, chunks: int, layers: int, on_layer: LayerCallback | None,
                 on_text: TextCallback | None, observe: Observer,
                 executor: concurrent.futures.Executor,
                 decode: SectionDecoder | StreamingDecoder = codec.decode_section,
                 resume_layer: Callable[[int, int], int] = lambda level, delivered: delivered) -> None:
        """``resume_layer(level, delivered)``: the first layer a continuation at ``level``
        must start from (``Manifest.resume_layer``; the delivered count, where no level
        predicts one layer from another)."""
        self._loop = asyncio.get_running_loop()
        self._resume_layer = resume_layer
        self._layers = layers
        self._on_layer = on_layer
        self._on_text = on_text
        self._observe = observe
        self._executor = executor
        self._decode = decode
        #: the decoder when it holds chunks between sections (None: a plain section decoder)
        self._stream = decode if isinstance(decode, StreamingDecoder) else None
        self._chunks = [_ChunkSlots(kind=self._loop.create_future()) for _ in range(chunks)]
        #: bytes each section added and not yet delivered holds: coded while it waits or
        #: decodes, plus its decoded output from the start of its decode
        self._backlog: dict[tuple[int, int], int] = {}
        self.backlog_bytes = 0
        #: sections received and not yet handed to the decoder, in arrival order
        self._waiting: dict[tuple[int, int], _Waiting] = {}
        #: the decode job of each section handed to the decoder and not finished
        self._decoding: dict[tuple[int, int], asyncio.Future] = {}
        #: whether ``nbytes`` more may be held to decode ahead of the consumer (the
        #: session's budget); None: always
        self.admit: Callable[[int], bool] | None = None
        self._position = 0   # the chunk the consumer is on
        #: called whenever the backlog shrinks or the consumer moves on (backpressure hook)
        self.on_progress: Callable[[], None] | None = None

    # ------------------------------------------------------------- backlog (backpressure)
    def _release(self, chunk: int, layer: int | None = None) -> None:
        keys = [(chunk, layer)] if layer is not None else [k for k in self._backlog if k[0] == chunk]
        for key in keys:
            self.backlog_bytes -= self._backlog.pop(key, 0)
            self._decoding.pop(key, None)
        if layer is None:   # the chunk was given up on or is done: its waiting sections too
            for key in [k for k in self._waiting if k[0] == chunk]:
                del self._waiting[key]
        self.pump()

    def _hold(self, key: tuple[int, int], nbytes: int) -> None:
        self.backlog_bytes += nbytes - self._backlog.get(key, 0)
        self._backlog[key] = nbytes

    def pump(self) -> None:
        """Hand waiting sections to the decoder: the one the consumer needs next, then the
        others in arrival order while the budget admits their output. Called whenever
        something is released here and when the process's budget has room again."""
        if self._waiting:
            needed = self._needed()
            if needed in self._waiting:
                self._start(needed)
            for key in list(self._waiting):
                if key not in self._waiting:
                    continue   # started already, before a later layer of its chain
                item = self._waiting[key]
                if not item.context and self.admit is not None and not self.admit(item.header.raw_size):
                    break
                self._start(key)
        if self.on_progress is not None:
            self.on_progress()

    @property
    def waiting(self) -> bool:
        """Whether sections wait for room in the budget to start decoding."""
        return bool(self._waiting)

    def _needed(self) -> tuple[int, int] | None:
        if self._position >= len(self._chunks):
            return None
        return self._position, self._chunks[self._position].delivered

    def starved(self) -> bool:
        """True when the consumer waits for something not received yet: the receiver must
        keep reading whatever the backlog (else a refetch stuck behind it would deadlock)."""
        if self._position >= len(self._chunks):
            return False
        state = self._chunks[self._position]
        if not state.kind.done():
            return True
        if state.kind.result() == TEXT:
            return state.text is None or not state.text.done()
        if state.delivered >= self._layers:
            return False   # finishing this chunk; the move to the next one is checked then
        slot = state.layers.get(state.delivered)
        return slot is None or not slot.done()

    # ------------------------------------------------------------- producer side
    def _slot(self, chunk: int, layer: int) -> asyncio.Future:
        slots = self._chunks[chunk].layers
        if layer not in slots or slots[layer].done() and isinstance(slots[layer].result(), _Retarget):
            slots[layer] = self._loop.create_future()
        return slots[layer]

    def resolve(self, chunk: int, kind: int | str, first_layer: int = 0) -> None:
        """Fix how a chunk's layers from ``first_layer`` on will be delivered. Another level
        is allowed for the whole chunk until a layer went out, and after that for a
        continuation from exactly the layers delivered (``first_layer``: those already
        out stay, the rest come at ``kind``), or, at a level predicting each layer from
        the one before, from the layer coded alone before them (``resume_layer``: the
        layers up to the delivered ones are decoded as context); TEXT is allowed until
        the chunk is done (it supersedes delivered layers)."""
        state = self._chunks[chunk]
        if state.kind.done():
            if state.kind.result() == kind:
                return
            if state.done:
                raise RuntimeError(f"chunk {chunk} was delivered already; it cannot change")
            resume = self._resume_layer(kind, state.delivered) if kind != TEXT else 0   # type: ignore[arg-type]
            if state.delivered and kind != TEXT and first_layer != resume:
                raise RuntimeError(f"chunk {chunk} already delivered {state.delivered} layers; level {kind} "
                                   f"can only continue from layer {resume}, not {first_layer}")
            state.kind = self._loop.create_future()
            self._drop_slots(chunk, 0)
            self._cancel_decode(state)
            self._release(chunk)
        state.kind.set_result(kind)

    def kind(self, chunk: int) -> int | str | None:
        fut = self._chunks[chunk].kind
        return fut.result() if fut.done() else None

    def delivered_layers(self, chunk: int) -> int:
        return self._chunks[chunk].delivered

    def is_done(self, chunk: int) -> bool:
        return self._chunks[chunk].done

    def add_section(self, chunk: int, layer: int, header: codec.BlobHeader, profile: codec.Profile,
                    section: bytes | memoryview) -> None:
        """Start decoding one layer section now; the consumer picks the result up in order.
        A predicted blob's sections (format 7) decode in order, each from the one before
        it in the same answer (``_add_chained``)."""
        if header.predicted:
            self._add_chained(chunk, layer, header, profile, section)
            return
        state = self._chunks[chunk]
        if layer < state.delivered:
            return  # a refetch resent a layer that already went out: exactly once
        slot = self._slot(chunk, layer)
        if slot.done():
            return  # duplicate part (refetch overlap); the first copy wins
        if (chunk, layer) in self._waiting:
            return  # duplicate part of a section not decoding yet: the first copy wins
        if header is not state.header:
            self._new_answer(chunk, state, header)
        self._hand(chunk, layer, state, _Waiting(header, profile, section, time.perf_counter()))

    def _add_chained(self, chunk: int, layer: int, header: codec.BlobHeader, profile: codec.Profile,
                     section: bytes | memoryview) -> None:
        """A section of a predicted blob: every section of its answer decodes, in order, with
        one ``codec.LayerChain``; those of layers delivered already (a continuation starts
        at a layer coded alone before them) only feed the chain. A new answer (a refetch)
        decodes afresh every layer not delivered: what the old answer decoded of them came
        from another chain."""
        state = self._chunks[chunk]
        if header is not state.header:
            self._new_answer(chunk, state, header)
            for undelivered in self._drop_slots(chunk, state.delivered):
                self._release(chunk, undelivered)
            state.chain, state.chain_tail = codec.LayerChain(), None
        context = layer < state.delivered
        if not context and (self._slot(chunk, layer).done() or (chunk, layer) in self._waiting):
            return   # a duplicate part: the first copy wins
        self._hand(chunk, layer, state, _Waiting(header, profile, section, time.perf_counter(), context))

    def _drop_slots(self, chunk: int, first: int) -> list[int]:
        """Forget the chunk's slots of layers ``first`` on (their layers: the consumer,
        if it waits on one, is woken to ask again)."""
        slots = self._chunks[chunk].layers
        dropped = [layer for layer in slots if layer >= first]
        for layer in dropped:
            slot = slots.pop(layer)
            if not slot.done():
                slot.set_result(_Retarget())
        return dropped

    def _new_answer(self, chunk: int, state: _ChunkSlots, header: codec.BlobHeader) -> None:
        """The sections of another answer begin (a refetch, or a continuation): the old one's
        rest never comes."""
        self._cancel_decode(state)
        for key in [k for k in self._waiting if k[0] == chunk]:
            del self._waiting[key]
        state.header, state.submitted = header, 0

    def _hand(self, chunk: int, layer: int, state: _ChunkSlots, item: _Waiting) -> None:
        state.submitted += 1
        self._observe(ev.SectionHanded(chunk, layer, len(item.section), time.monotonic()))
        self._hold((chunk, layer), len(item.section))
        self._waiting[(chunk, layer)] = item
        if self._stream is not None:
            self._start((chunk, layer))   # its output is on the device, not in this budget
        self.pump()

    def _start(self, key: tuple[int, int]) -> None:
        chunk, layer = key
        item = self._waiting.pop(key)
        state, output = self._chunks[chunk], 0
        if self._stream is not None:   # groups upload and decode as sections land (a run chains its own)
            job = asyncio.ensure_future(_submitted(self._stream.submit(item.header, item.profile, layer,
                                                                       item.section), item.arrived))
        else:
            output = 0 if item.context else item.header.raw_size
            if item.header.predicted:
                for earlier in sorted(k for k in self._waiting if k[0] == chunk and k[1] < layer):
                    self._start(earlier)   # the layers it is predicted from go first
                job = asyncio.ensure_future(self._chained_decode(state.chain_tail, state.chain, item, layer))
                state.chain_tail = job
            else:
                job = self._loop.run_in_executor(self._executor, _timed_decode, self._decode, item.header,
                                                 item.profile, layer, item.section)
            self._hold(key, len(item.section) + output)
        if not item.context:
            self._slot(chunk, layer).set_result(job)
        self._decoding[key] = job
        job.add_done_callback(functools.partial(self._decoded, key, len(item.section), output, item.context))

    async def _chained_decode(self, previous: asyncio.Future | None, chain: codec.LayerChain | None,
                              item: _Waiting, layer: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Decode a predicted blob's layer once the layer before it in its answer has: in
        the same chain, so never beside it. A layer predicted from one that did not decode
        is corrupt too (a layer coded alone decodes whatever came before it)."""
        if previous is not None:
            await asyncio.wait([previous])
            failed = previous.cancelled() or previous.exception() is not None
            if failed and not is_intra(layer, item.profile.restart):
                raise codec.CorruptBitstream(f"layer {layer} is predicted from layer {layer - 1}, "
                                             "which did not decode")
        decode = functools.partial(self._decode, chain=chain)
        return await self._loop.run_in_executor(self._executor, _timed_decode, decode, item.header,
                                                item.profile, layer, item.section)

    def _decoded(self, key: tuple[int, int], size: int, output: int, context: bool, job: asyncio.Future) -> None:
        # a failed decode is the consumer's to raise (exception() only marks it seen: a
        # retargeted chunk's moot failure is not logged as unretrieved)
        ok = not job.cancelled() and job.exception() is None
        seconds = job.result()[2] if ok else None
        self._observe(ev.SectionDecoded(*key, size, seconds, time.monotonic()))
        if self._decoding.get(key) is job:   # not released or replaced meanwhile
            del self._decoding[key]
            if context:   # its values live on in the chain only
                self.backlog_bytes -= self._backlog.pop(key, 0)
            else:
                self._hold(key, output if ok else 0)   # the coded bytes are free now
            if self.on_progress is not None:
                self.on_progress()

    def add_text(self, chunk: int, token_ids: list[int]) -> None:
        state = self._chunks[chunk]
        if state.text is None:
            state.text = self._loop.create_future()
        if not state.text.done():
            state.text.set_result(token_ids)

    def fail_chunk(self, chunk: int, exc: BaseException) -> None:
        """Make the consumer raise ``exc`` when it reaches ``chunk`` (unrecoverable; the
        first failure stands)."""
        state = self._chunks[chunk]
        if state.failure is not None:
            return
        state.failure = exc
        for key in [k for k in self._waiting if k[0] == chunk]:
            del self._waiting[key]
        for fut in [state.kind, state.text, *[self._slot(chunk, l) for l in range(state.delivered, self._layers)]]:
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                # the consumer raises ``exc`` from the first of these it reaches and never
                # awaits the rest: mark each retrieved, or asyncio logs them when collected
                fut.exception()
        if not state.done:
            self._cancel_decode(state)

    def _cancel_decode(self, state: _ChunkSlots) -> None:
        """Make a stream decoder drop what it holds of the chunk's sections (once per header)."""
        if state.header is not None and self._stream is not None:
            self._stream.cancel(state.header)
        state.header = None

    def close(self) -> None:
        """Let go of what is held: the fetch is over, and a failed or cancelled one leaves
        decoded layers, waiting sections and a stream decoder's chunks behind (a session's
        objects refer to each other, so without this they would wait for the cyclic
        garbage collector, decoded tensors and all). The consumer's callbacks and the
        observer go too: a caller's callbacks hold what it assembles (a prefix's whole KV),
        and decodes still running report to nobody."""
        self._on_layer = self._on_text = None
        self._observe = _ignore
        for state in self._chunks:
            if not state.done:
                self._cancel_decode(state)
            state.layers.clear()
        self._waiting.clear()
        self._decoding.clear()
        self._backlog.clear()
        self.backlog_bytes = 0
        self.on_progress = self.admit = None

    # ------------------------------------------------------------- consumer side
    async def run(self) -> None:
        """Deliver every chunk in order; returns when all are delivered."""
        for index, state in enumerate(self._chunks):
            self._position = index
            while True:
                kind = await state.kind
                if kind == TEXT:
                    if state.text is None:
                        state.text = self._loop.create_future()
                    token_ids = await state.text
                    if self._on_text is not None:
                        began = time.monotonic()
                        self._observe(ev.RecomputeStarted(index, began))
                        await _call(self._on_text, index, token_ids, off_loop=True)
                        ended = time.monotonic()
                        self._observe(ev.RecomputeFinished(index, len(token_ids), ended - began, ended))
                    break
                if await self._deliver_layers(index, state):
                    break
            state.done = True
            self._observe(ev.ChunkDone(index, time.monotonic()))
            if state.submitted < self._layers:
                # a refetch skipped the layers that went out already: the decoder still
                # waits for them under the refetch's header
                self._cancel_decode(state)
            state.header = None
            self._position = index + 1
            self._release(index)

    async def _deliver_layers(self, index: int, state: _ChunkSlots) -> bool:
        """Deliver the chunk's remaining layers; False if it was retargeted to text."""
        kind = state.kind
        while state.delivered < self._layers:
            if state.kind is not kind:
                return False   # retargeted to text while on_layer ran
            layer = state.delivered
            job = await self._slot(index, layer)
            if isinstance(job, _Retarget):
                return False
            try:
                k, v, _ = await job
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise   # this consumer is cancelled
                # the stream decoder cancelled the decode: this delivery gave up on the chunk
                if state.kind is not kind:
                    return False   # retargeted
                raise state.failure or RuntimeError(f"the decoder dropped chunk {index} layer {layer}") from None
            except codec.CorruptBitstream as exc:
                if state.kind is not kind:
                    return False   # retargeted while it decoded: the bad section is moot
                # the refetch resends every section: drop the rest of the bad answer too, so
                # a second bad section in it cannot win over its replacement
                for pending in [l for l in state.layers if l >= layer]:
                    del state.layers[pending]
                self._release(index)
                self._observe(ev.Corrupt(index, layer, str(exc), time.monotonic()))
                if state.kind is not kind:
                    return False  # the session gave up on the layers and resolved the chunk anew
                continue  # the session refetches; wait for the replacement section
            if state.kind is not kind:
                return False   # retargeted to text while this layer decoded: not delivered
            # delivered from the call on: a switch decided while an async on_layer runs
            # sees it, and leaves it (text supersedes it; no other level replaces it)
            state.delivered += 1
            self._observe(ev.LayerDelivering(index, layer, time.monotonic()))
            if self._on_layer is not None:
                await _call(self._on_layer, index, layer, k, v)
            state.layers.pop(layer, None)   # gone already if the chunk was retargeted meanwhile
            self._release(index, layer)
        return True


def _ignore(event: ev.Event) -> None:
    """The observer of a closed delivery."""


def _timed_decode(decode: SectionDecoder, header: codec.BlobHeader, profile: codec.Profile, layer: int,
                  section: bytes | memoryview) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(k, v, seconds the decode itself took, on cores shared with whatever else runs).
    The fetch controller queues the sections it is owed behind one another itself
    (``adapt.decoding``: the decode backlog, the pipeline behind the link), as the
    simulator's decoder does, so a section's cost is its own decode. Timed from its
    arrival instead, each of a chunk's sections would carry its wait behind the ones
    before it, and their sum would count the backlog once per section."""
    began = time.perf_counter()
    k, v = decode(header, profile, layer, section)
    return k, v, time.perf_counter() - began


async def _submitted(future: concurrent.futures.Future, start: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(k, v, seconds from submission) of a section handed to a stream decoder; cancelled
    when the decoder cancels it (its chunk was given up on: a cancelled task logs nothing)."""
    k, v = await asyncio.wrap_future(future)
    return k, v, time.perf_counter() - start


async def _call(fn: Callable[..., Any], *args: Any, off_loop: bool = False) -> None:
    """Call a consumer callback, sync or async. ``off_loop``: a plain function runs in a
    worker thread (``on_text`` is a prefill, and the transfers of the later chunks run
    on this event loop meanwhile: the planners count on that overlap, ``adapt.overlap``)."""
    if off_loop and not inspect.iscoroutinefunction(fn):
        result = await asyncio.to_thread(fn, *args)
    else:
        result = fn(*args)
    if inspect.isawaitable(result):
        await result
