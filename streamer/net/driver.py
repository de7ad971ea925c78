"""FetchDriver: one ``fetch()`` of a StreamSession, the asyncio adapter around FetchController.

It decides nothing. Socket events become controller inputs (each stamped with the time
its bytes were read), a chunk's parts are cut into sections (``net.assembly``) and handed
to the ordered delivery, whose decodes and deliveries are inputs too; the controller's
actions become REQUEST and CANCEL frames, reconnects, and the fetch's end. One timer
(the controller's ``timer()``) wakes it when nothing arrives. Reading pauses while more
than ``max_buffered_bytes`` wait to be delivered (TCP backpressure on the sender), unless
the consumer waits for bytes not yet read.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING

import codec

from streamer.fetch import events as ev
from streamer.fetch.controller import FetchController
from streamer.fetch.report import FetchReport
from streamer.net.assembly import Assembly
from streamer.net.budget import process_budget
from streamer.net.client import Arrival, ConnectionLost, StreamError
from streamer.net.delivery import OrderedDelivery
from streamer.store.put import decode_tokens
from streamer.wire import protocol as p

if TYPE_CHECKING:
    from streamer.net.session import StreamSession


class FetchFailed(StreamError):
    """The fetch could not complete; ``report`` says what was delivered."""

    def __init__(self, message: str, report: FetchReport) -> None:
        super().__init__(message)
        self.report = report


class TextNotConsumed(FetchFailed):
    """A chunk has to come as text (token ids) but the session, which hands layers to an
    ``on_layer``, has no ``on_text``: raised before the text is requested, as the chunk's
    KV would otherwise be silently missing from what ``on_layer`` received. (A session
    with neither callback consumes no data, e.g. a benchmark reading only the report.)"""


class ContextChanged(StreamError):
    """The context was re-put while we were fetching it: chunks would mix versions."""


class ContextTooLarge(StreamError):
    """The context's manifest says it decodes to more than ``SessionConfig.max_context_bytes``:
    refused before anything is fetched or allocated (the sender controls the manifest)."""


class FetchDriver:
    """Runs one fetch of ``session``'s context with ``controller`` deciding."""

    def __init__(self, session: "StreamSession", controller: FetchController) -> None:
        self.s, self.controller = session, controller
        self.manifest = controller.manifest
        self.delivery = OrderedDelivery(chunks=len(self.manifest.chunks), layers=self.manifest.layers,
                                        on_layer=session._on_layer, on_text=session._on_text,
                                        observe=self._observe, executor=session._executor,
                                        decode=session._decode, resume_layer=self.manifest.resume_layer)
        self.delivery.on_progress = self._on_progress
        self.delivery.admit = self._admit
        self.share = process_budget().join(self.delivery.pump)
        self.assemblies: dict[int, Assembly] = {}
        self.wake = asyncio.Event()
        self.pending: collections.deque[ev.Reconnect | ev.Fail] = collections.deque()
        self.paused = False
        self.pauses = 0
        self.peak_backlog = 0
        session._on_data = self._on_bytes
        if session._client is not None:
            session._client.set_on_data(self._on_bytes)

    # ------------------------------------------------------------------ main loop
    async def run(self) -> FetchReport:
        consumer = asyncio.create_task(self.delivery.run())
        try:
            client = self.s._client
            assert client is not None
            self._feed(ev.Started(client.rtt, self.s.connect_seconds, time.monotonic(),
                                  continuations=client.conn.continuations))
            # over once every chunk is delivered and the answers' ends are in (or a callback raised)
            while not (consumer.done() and (self.controller.done or consumer.cancelled()
                                            or consumer.exception() is not None)):
                await self._carry_out_pending()
                arrival = await self._next_arrival(consumer)
                if arrival is not None:
                    self._translate(arrival)
                else:
                    self._feed(ev.Tick(time.monotonic()))
                self._maybe_pause()
        except ContextChanged:
            consumer.cancel()
            raise
        except FetchFailed:
            consumer.cancel()
            raise
        except StreamError as exc:
            consumer.cancel()
            raise FetchFailed(str(exc), self._report()) from exc
        finally:
            if not consumer.done():
                consumer.cancel()
            self.delivery.close()
            self.assemblies.clear()
            self.share.close()
            self.s._on_data = None
            if self.s._client is not None:
                self.s._client.set_on_data(None)
                if self.paused:
                    self.s._client.resume_reading()
        consumer.result()  # re-raise a callback's exception
        return self._report()

    def _report(self) -> FetchReport:
        return self.controller.finish(time.monotonic())

    async def _carry_out_pending(self) -> None:
        """The actions that wait: a reconnect, or the fetch's failure."""
        while self.pending:
            action = self.pending.popleft()
            if isinstance(action, ev.Fail):
                kind = TextNotConsumed if action.kind == ev.TEXT_NOT_CONSUMED else FetchFailed
                raise kind(action.message, self._report())
            await self._reconnect(action)

    async def _next_arrival(self, consumer: asyncio.Task) -> Arrival | None:
        """The next network event, or None when woken for another reason (a timer, the
        delivery's progress, an action to carry out)."""
        if self.pending:
            return None
        client = self.s._client
        getter = asyncio.ensure_future(client.queue.get()) if client is not None else None
        waker = asyncio.ensure_future(self.wake.wait())
        waits = {waker} | ({getter} if getter else set()) | (set() if consumer.done() else {consumer})
        due = self.controller.timer()
        timeout = None if due is None else max(due - time.monotonic(), 0.0)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waker.cancel()
        self.wake.clear()
        if getter is not None and not getter.done():
            getter.cancel()
            # waited for, not awaited: a cancel of this fetch that lands while the getter
            # unwinds still ends the fetch (asyncio.wait raises it), and the getter's
            # CancelledError is not raised here, where its traceback would hold this frame,
            # and through it the session and its consumer, in a cycle
            await asyncio.wait({getter})
            if not getter.cancelled():   # the item was taken just as we cancelled: keep it
                return getter.result()
        if getter is not None and getter in done:
            return getter.result()
        return None

    # ------------------------------------------------------------------ inputs
    def _feed(self, event: ev.Event) -> None:
        """One controller input; its actions carried out at once, or queued for the loop."""
        self.controller.handle(event)
        for action in self.controller.actions():
            self._perform(action)

    def _observe(self, event: ev.Event) -> None:
        """What the delivery reports: decodes, deliveries, recomputes, corrupt sections."""
        if isinstance(event, ev.Corrupt) and event.chunk in self.assemblies:
            self.assemblies[event.chunk].discard()   # the refetch resends the whole answer
        self._feed(event)
        if isinstance(event, ev.Corrupt):
            self.wake.set()

    def _translate(self, arrival: Arrival) -> None:
        event, at = arrival.event, arrival.at
        if self.pending:
            return   # the connection it came on is being replaced
        if isinstance(event, p.ChunkBegin):
            self._feed(ev.AnswerBegan(event.chunk, event.total_bytes, at))
            if not self.pending:   # the controller found the answer's size as asked
                self.assemblies[event.chunk] = Assembly(self.manifest, event.chunk, event.level, event.total_bytes,
                                                        event.first_layer)
        elif isinstance(event, p.ChunkPart):
            self._on_part(event.chunk, event.data, at)
        elif isinstance(event, p.ChunkEnd):
            self._feed(ev.AnswerEnded(event.chunk, event.cancelled, at))
        elif isinstance(event, p.Text):
            self._on_text(event.chunk, event.data, at)
        elif isinstance(event, p.Error):
            self._feed(ev.ConnectionBroken(f"sender error {event.code}: {event.message}", at) if event.fatal
                       else ev.SenderError(event.code, event.message, at))
        elif isinstance(event, p.ConnectionClosed):
            self._feed(ev.ConnectionBroken("connection closed" if event.clean else "connection lost", at))

    def _on_part(self, chunk: int, data: bytes, at: float) -> None:
        assembly = self.assemblies[chunk]
        try:
            sections = assembly.add(data)
        except codec.CorruptBitstream as exc:
            self._feed(ev.PartArrived(chunk, assembly.received, assembly.sections, at))
            self._feed(ev.Corrupt(chunk, 0, str(exc), at))
            return
        header = assembly.header
        for layer, section in sections:
            self.delivery.add_section(chunk, layer, header, self.s.profile, section)   # type: ignore[arg-type]
        self._feed(ev.PartArrived(chunk, assembly.received, assembly.sections, at))

    def _on_text(self, chunk: int, data: bytes, at: float) -> None:
        try:
            tokens = decode_tokens(data, expected_tokens=self.manifest.chunks[chunk].tokens,
                                   vocab_size=self.manifest.vocab_size)
        except ValueError as exc:
            self._feed(ev.ConnectionBroken(f"chunk {chunk}: bad text fallback: {exc}", at))
            return
        self.delivery.add_text(chunk, tokens)
        self._feed(ev.TextArrived(chunk, len(data), at))

    def _on_bytes(self) -> None:
        """After each socket read: the link is alive (a large part may still be coming in)."""
        client = self.s._client
        partial = client.conn.receiving_frame if client is not None and not client.closed else 0
        self.controller.handle(ev.Activity(time.monotonic(), partial))
        self._maybe_pause()

    # ------------------------------------------------------------------ actions
    def _perform(self, action: ev.Action) -> None:
        if isinstance(action, ev.SendRequest):
            self.assemblies.pop(action.chunk, None)   # its answer's CHUNK_BEGIN makes the next
            self.s.levels[action.chunk] = action.choice
            self.delivery.resolve(action.chunk, action.choice, action.first_layer)
            self._send(p.Request(chunk=action.chunk, level=action.choice, first_layer=action.first_layer))
        elif isinstance(action, ev.SendCancel):
            self._send(p.Cancel(chunk=action.chunk))
        elif isinstance(action, ev.ChunkFinished):
            if self.s._on_chunk is not None:
                self.s._on_chunk(self.controller.chunk_report(action.chunk))
        elif isinstance(action, ev.FailChunk):
            self.delivery.fail_chunk(action.chunk, FetchFailed(action.message, self._report()))
        else:
            if isinstance(action, ev.Reconnect) and self.s._client is not None:
                self.s._client.abort()   # nothing more is read from it
            self.pending.append(action)
            self.wake.set()

    def _send(self, event: p.Event) -> None:
        try:
            self.s._client.send(event)  # type: ignore[union-attr]
        except (ConnectionLost, p.ProtocolError):
            pass  # the connection-lost event that follows triggers the reconnect

    async def _reconnect(self, action: ev.Reconnect) -> None:
        """Another connection (the next sender, unless the cancel rule drops this one on
        purpose); ``Connected`` re-requests what was in flight."""
        session = self.s
        if not action.abort:
            session._server_index = (session._server_index + 1) % len(session._servers)
        self.paused = False   # a fresh connection reads
        await session._connect_any()
        client = session._client
        assert client is not None
        client.set_on_data(self._on_bytes)
        self._feed(ev.Connected(client.rtt, session.connect_seconds, time.monotonic(),
                                continuations=client.conn.continuations))

    # ------------------------------------------------------------------ backpressure
    def _buffered(self) -> int:
        """Received payload bytes not yet delivered: queued events, sections still being
        assembled from parts, and the delivery backlog."""
        client = self.s._client
        assembling = sum(self.assemblies[i].buffered for i in self.controller.inflight if i in self.assemblies)
        return self.delivery.backlog_bytes + assembling + (client.queued_bytes if client is not None else 0)

    def _maybe_pause(self) -> None:
        """After each socket read and each handled event: stop reading when over this
        session's limit or, holding more than its share, over the process's budget."""
        buffered = self._buffered()
        self.peak_backlog = max(self.peak_backlog, buffered)
        self.share.hold(buffered)
        client = self.s._client
        if (not self.paused and client is not None and not self.delivery.starved()
                and (buffered > self.s.max_buffered_bytes or self.share.over())):
            client.pause_reading()
            self.paused = self.share.paused = True
            self.pauses += 1
            self.controller.handle(ev.ReadingPaused(time.monotonic()))

    def _on_progress(self) -> None:
        """The delivery's backlog changed or its consumer moved on."""
        self.share.hold(self._buffered())
        self.share.waiting = self.delivery.waiting
        self._maybe_resume()

    def _admit(self, nbytes: int) -> bool:
        """Whether the delivery may hold ``nbytes`` more of decoded output ahead of its
        consumer: within the session's own ``max_buffered_bytes`` and the process's budget."""
        budget = self.share.budget
        return (self._buffered() + nbytes <= self.s.max_buffered_bytes
                and budget.total + nbytes <= budget.limit)

    def _maybe_resume(self) -> None:
        if not self.paused:
            return
        buffered = self._buffered()
        if buffered <= self.s.max_buffered_bytes // 2 and not self.share.over() or self.delivery.starved():
            self.paused = self.share.paused = False
            if self.s._client is not None:
                self.s._client.resume_reading()
            self._feed(ev.ReadingResumed(time.monotonic()))
            self.wake.set()
