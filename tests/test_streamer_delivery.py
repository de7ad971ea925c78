"""OrderedDelivery on its own: order, exactly-once and corrupt-section handling,
with a fake decoder (no codec, no sockets)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

import codec
from streamer.fetch import events as ev
from streamer.net.delivery import TEXT, OrderedDelivery
from streamer_helpers import held_decode

LAYERS = 3


class _Header:
    """The fields of a blob header the delivery reads: a section's decoded size, and whether it is predicted."""
    raw_size = 64
    predicted = False


HEADER = _Header()


def _decoder(bad: set[tuple[int, int]]):
    """Decodes a section b'chunk,layer' to tensors holding those numbers; raises for ``bad``."""
    def decode(header, profile, layer, section):
        chunk = int(bytes(section).split(b",")[0])
        if (chunk, layer) in bad:
            bad.discard((chunk, layer))
            raise codec.CorruptBitstream("bad section")
        return torch.full((1,), float(chunk)), torch.full((1,), float(layer))
    return decode


def _on_corrupt(callback):
    """An observer that passes each Corrupt report to ``callback(chunk, layer, message)``."""
    return lambda event: callback(event.chunk, event.layer, event.message) if isinstance(event, ev.Corrupt) else None


async def _run(delivery: OrderedDelivery) -> None:
    await asyncio.wait_for(delivery.run(), 5.0)


async def test_layers_arrive_in_order_whatever_order_sections_land() -> None:
    seen: list[tuple] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = OrderedDelivery(chunks=2, layers=LAYERS, on_layer=lambda c, l, k, v: seen.append((c, l)),
                                   on_text=None, observe=lambda event: None, executor=pool,
                                   decode=_decoder(set()))
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(1, 0)
        for layer in reversed(range(LAYERS)):
            delivery.add_section(1, layer, HEADER, None, b"1,")
        delivery.resolve(0, 2)
        for layer in range(LAYERS):
            delivery.add_section(0, layer, HEADER, None, b"0,")
            delivery.add_section(0, layer, HEADER, None, b"0,")  # duplicates are ignored
        await consumer
    assert seen == [(c, l) for c in range(2) for l in range(LAYERS)]


@pytest.mark.parametrize("bad", [{(0, 1)}, {(0, 0), (0, 2)}], ids=["one", "two"])
async def test_corrupt_sections_are_replaced_by_one_refetch(bad: set) -> None:
    """A refetch resends every section of the chunk (delivered ones are skipped): one
    on_corrupt per bad answer, and a second bad section of that answer never wins."""
    seen: list[tuple] = []
    corrupt_calls: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder: dict = {}

        def on_corrupt(chunk: int, layer: int, exc: Exception) -> None:
            corrupt_calls.append(layer)
            for again in range(LAYERS):   # the refetched answer: clean this time
                holder["delivery"].add_section(chunk, again, HEADER, None, b"0,")

        delivery = OrderedDelivery(chunks=1, layers=LAYERS, on_layer=lambda c, l, k, v: seen.append((c, l)),
                                   on_text=None, observe=_on_corrupt(on_corrupt), executor=pool,
                                   decode=_decoder(set(bad)))
        holder["delivery"] = delivery
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 0)
        for layer in range(LAYERS):
            delivery.add_section(0, layer, HEADER, None, b"0,")
        await consumer
    assert seen == [(0, l) for l in range(LAYERS)]
    assert corrupt_calls == [min(bad)[1]]


async def test_text_after_delivered_layers_supersedes_them() -> None:
    """The session may switch a chunk to text after layers went out: on_text follows the
    delivered layers, which stay counted (the report's superseded_layers)."""
    events: list[tuple] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = OrderedDelivery(chunks=2, layers=LAYERS, on_layer=lambda c, l, k, v: events.append((c, l)),
                                   on_text=lambda c, ids: events.append((c, TEXT)),
                                   observe=lambda event: None, executor=pool, decode=_decoder(set()))
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 1)
        delivery.add_section(0, 0, HEADER, None, b"0,")
        while delivery.delivered_layers(0) < 1:
            await asyncio.sleep(0.001)
        delivery.resolve(0, TEXT)
        with pytest.raises(RuntimeError):
            delivery.resolve(0, 2)   # another level is no longer possible
        delivery.add_text(0, [1])
        delivery.resolve(1, TEXT)
        delivery.add_text(1, [2])
        await consumer
    assert events == [(0, 0), (0, TEXT), (1, TEXT)]
    assert delivery.delivered_layers(0) == 1 and delivery.delivered_layers(1) == 0


async def test_a_continuation_delivers_the_rest_of_a_chunk_at_its_level_each_layer_once() -> None:
    """Layer 0 of chunk 0 went out at level 0 and layer 1's level-0 section is decoded but
    not delivered when the chunk continues at level 2 from layer 1: that section is
    dropped, layers 1.. come from the continuation's answer (its own header), each once.
    A continuation from anywhere but the layers delivered is refused (a layer would come
    twice, or never)."""
    events: list[tuple] = []

    class Header2(_Header):
        pass

    continuation_header = Header2()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gate = asyncio.Event()

        async def on_layer(c, l, k, v):
            events.append((c, l, int(k.item())))
            if (c, l) == (0, 0):
                await gate.wait()

        delivery = OrderedDelivery(chunks=1, layers=LAYERS, on_layer=on_layer, on_text=None,
                                   observe=lambda event: None, executor=pool, decode=_decoder(set()))
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 0)
        delivery.add_section(0, 0, HEADER, None, b"0,")
        delivery.add_section(0, 1, HEADER, None, b"0,")   # decodes, then waits behind layer 0's call
        while delivery.delivered_layers(0) < 1:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="continue from layer 1"):
            delivery.resolve(0, 2, first_layer=2)
        delivery.resolve(0, 2, first_layer=1)
        gate.set()
        for layer in range(1, LAYERS):   # sections tagged "5": the continuation's
            delivery.add_section(0, layer, continuation_header, None, b"5,")
        await consumer
    assert events == [(0, 0, 0), (0, 1, 5), (0, 2, 5)]


async def test_switch_to_text_from_the_corrupt_callback_does_not_hang() -> None:
    """Regression: the session may give up on a chunk's layers inside on_corrupt."""
    texts: list[tuple] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder: dict = {}

        def on_corrupt(chunk: int, layer: int, exc: Exception) -> None:
            holder["delivery"].resolve(chunk, TEXT)
            holder["delivery"].add_text(chunk, [1, 2, 3])

        delivery = OrderedDelivery(chunks=1, layers=LAYERS, on_layer=lambda *a: pytest.fail("no layer expected"),
                                   on_text=lambda c, ids: texts.append((c, ids)), observe=_on_corrupt(on_corrupt),
                                   executor=pool, decode=_decoder({(0, 0)}))
        holder["delivery"] = delivery
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 1)
        delivery.add_section(0, 0, HEADER, None, b"0,")
        await consumer
    assert texts == [(0, [1, 2, 3])]


async def test_a_plain_on_text_recomputes_off_the_event_loop() -> None:
    """``on_text`` is a prefill: a plain function runs in a worker thread, so the event
    loop (which carries the later chunks' transfers) keeps running meanwhile; the
    planners count on that overlap (``adapt.overlap``). Here on_text waits for a flag the
    loop sets while it runs: on the loop's own thread it could never see it."""
    import threading

    loop_thread = threading.get_ident()
    started, flag = threading.Event(), threading.Event()
    calls: list[tuple] = []

    def on_text(chunk: int, token_ids: list[int]) -> None:
        started.set()
        calls.append((chunk, threading.get_ident() != loop_thread, flag.wait(5.0)))

    seen: list[tuple] = []
    observed: list = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = OrderedDelivery(chunks=2, layers=LAYERS, on_layer=lambda c, l, k, v: seen.append((c, l)),
                                   on_text=on_text, observe=observed.append, executor=pool,
                                   decode=_decoder(set()))
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, TEXT)
        before = time.monotonic()
        delivery.add_text(0, [1, 2, 3])
        while not started.is_set():
            await asyncio.sleep(0.001)
        # when it began is what the controller takes off the recompute it still counts owed
        began = [e for e in observed if isinstance(e, ev.RecomputeStarted)]
        assert len(began) == 1 and before <= began[0].at <= time.monotonic()
        delivery.resolve(1, 0)   # the next chunk lands while chunk 0 is recomputed
        for layer in range(LAYERS):
            delivery.add_section(1, layer, HEADER, None, b"1,")
        flag.set()
        await consumer
    assert calls == [(0, True, True)]
    assert seen == [(1, l) for l in range(LAYERS)]


class _StreamFake:
    """A stream decoder's interface (``kvwire_kernels.stream.StreamDecoder``): ``submit`` returns a
    future, resolved at once unless its header is held; ``cancel`` records the header and
    cancels its pending futures, as the real one does."""

    def __init__(self, held=(), bad=()) -> None:
        self.held, self.bad = set(held), set(bad)
        self.pending: list[tuple[object, concurrent.futures.Future]] = []
        self.cancelled: list[object] = []

    def submit(self, header, profile, layer, section) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if header in self.held:
            self.pending.append((header, future))
        elif (header, layer) in self.bad:
            future.set_exception(codec.CorruptBitstream("bad section"))
        else:
            future.set_result((torch.zeros(1), torch.full((1,), float(layer))))
        return future

    def cancel(self, header) -> None:
        self.cancelled.append(header)
        for _, future in [p for p in self.pending if p[0] is header]:
            future.cancel()


def _answer(delivery: OrderedDelivery, chunk: int, header, layers=range(LAYERS)) -> None:
    """The sections of one answer for ``chunk`` (a refetch resends them all)."""
    for layer in layers:
        delivery.add_section(chunk, layer, header, None, b"")


def _streamed(fake: _StreamFake, pool, seen: list, chunks: int = 1, on_corrupt=lambda *a: None) -> OrderedDelivery:
    return OrderedDelivery(chunks=chunks, layers=LAYERS, on_layer=lambda c, l, k, v: seen.append((c, l)),
                           on_text=lambda c, ids: seen.append((c, TEXT)), observe=_on_corrupt(on_corrupt),
                           executor=pool, decode=fake)


async def test_a_stream_decoder_is_told_of_a_retargeted_chunk_once_and_of_a_delivered_one_never() -> None:
    """Chunk 0 is retargeted to text while its sections are held in the decoder (the
    consumer waits on one of them): the decoder cancels that chunk once. Chunk 1 is an
    ordinary chunk: never cancelled."""
    first, second = _Header(), _Header()
    fake, seen = _StreamFake(held={first}), []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = _streamed(fake, pool, seen, chunks=2)
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 1)
        _answer(delivery, 0, first, range(2))
        await asyncio.sleep(0.01)   # the consumer now awaits layer 0's held decode
        delivery.resolve(0, TEXT)
        delivery.add_text(0, [1])
        delivery.resolve(1, 1)
        _answer(delivery, 1, second)
        await consumer
    assert fake.cancelled == [first]
    assert seen == [(0, TEXT)] + [(1, l) for l in range(LAYERS)]


async def test_a_stream_decoder_is_told_of_a_failed_chunk_once() -> None:
    header, failure = _Header(), RuntimeError("stays corrupt")
    fake, seen = _StreamFake(held={header}), []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = _streamed(fake, pool, seen)
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 1)
        _answer(delivery, 0, header, range(1))
        await asyncio.sleep(0.01)   # the consumer awaits the held decode, which is cancelled
        delivery.fail_chunk(0, failure)
        delivery.fail_chunk(0, failure)
        with pytest.raises(RuntimeError, match="stays corrupt"):
            await consumer
    assert fake.cancelled == [header]
    assert seen == []


async def test_a_stream_decoder_forgets_both_answers_of_a_refetched_chunk() -> None:
    """Layer 1 of the first answer is corrupt; the refetch is a new header whose layer 0 is
    skipped (it went out): the first answer is cancelled when the second lands, and the
    second once the chunk is delivered, as the decoder still waits for its layer 0."""
    first, again = _Header(), _Header()
    fake, seen = _StreamFake(bad={(first, 1)}), []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder: dict = {}

        delivery = holder["delivery"] = _streamed(fake, pool, seen,
                                                  on_corrupt=lambda chunk, *_: _answer(holder["delivery"], chunk, again))
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 1)
        _answer(delivery, 0, first)
        await consumer
    assert seen == [(0, l) for l in range(LAYERS)]
    assert fake.cancelled == [first, again]


async def test_decoding_ahead_waits_for_the_budget_but_the_next_layer_never_does() -> None:
    """With no room to decode ahead, a section waits coded until the consumer needs it;
    the consumer still gets every layer in order, and what a started section holds is
    counted with its decoded output until the consumer has it."""
    seen: list[tuple[int, int]] = []
    handed: list[tuple[int, int]] = []
    room = {"bytes": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        def decode(header, profile, layer, section):
            handed.append((int(bytes(section).split(b",")[0]), layer))
            return _decoder(set())(header, profile, layer, section)

        delivery = OrderedDelivery(chunks=2, layers=LAYERS, on_layer=lambda c, l, k, v: seen.append((c, l)),
                                   on_text=None, observe=lambda event: None, executor=pool, decode=decode)
        delivery.admit = lambda nbytes: nbytes <= room["bytes"]
        delivery.resolve(1, 0)
        for layer in range(LAYERS):
            delivery.add_section(1, layer, HEADER, None, b"1,")
        await asyncio.sleep(0.05)
        assert handed == [] and delivery.waiting           # chunk 1 is not needed yet: it waits
        assert delivery.backlog_bytes == LAYERS * len(b"1,")
        delivery.resolve(0, 0)
        delivery.add_section(0, 0, HEADER, None, b"0,")    # needed next: starts at once
        assert delivery.backlog_bytes == LAYERS * len(b"1,") + len(b"0,") + HEADER.raw_size
        consumer = asyncio.create_task(_run(delivery))
        await asyncio.sleep(0.05)
        assert seen == [(0, 0)] and handed == [(0, 0)]
        room["bytes"] = HEADER.raw_size                      # room for one section ahead
        delivery.pump()
        for layer in range(1, LAYERS):
            delivery.add_section(0, layer, HEADER, None, b"0,")
        await consumer
    assert seen == [(c, l) for c in range(2) for l in range(LAYERS)]
    assert not delivery.waiting and delivery.backlog_bytes == 0



async def test_a_section_reports_its_own_decode_time_not_its_wait_behind_the_others() -> None:
    """Sections handed at once to one decode thread wait behind each other; each reports
    the seconds its own decode took (the controller queues them itself, as the simulator
    does), so a chunk's sum is its decode, not the backlog counted once per section. Layer
    0's decode is held until every section is handed; the others, queued behind it,
    decode at once and report less than it."""
    release = threading.Event()
    decode = held_decode(0, release)
    observed: list = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        delivery = OrderedDelivery(chunks=1, layers=LAYERS, on_layer=lambda *a: None, on_text=None,
                                   observe=observed.append, executor=pool, decode=decode)
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 0)
        for layer in range(LAYERS):
            delivery.add_section(0, layer, HEADER, None, b"0,")
        await asyncio.sleep(0.2)
        release.set()
        await consumer
    seconds = {e.layer: e.seconds for e in observed if isinstance(e, ev.SectionDecoded)}
    assert sorted(seconds) == list(range(LAYERS))
    assert all(seconds[layer] < seconds[0] for layer in range(1, LAYERS))


class _PredictedHeader(_Header):
    """A predicted blob's header (format 7): its sections decode in order, with a chain."""
    predicted = True


class _Profile:
    restart = 2   # layers 0, 2, 4 coded alone


def _chained_decoder(order: list[tuple[int, int]], bad: set[tuple[int, int]] = frozenset()):
    """Decodes b'tag,' sections like ``codec.decode_section`` a predicted blob's: refuses a
    layer whose chain does not hold the layer before it (unless coded alone), advances the
    chain, and records (tag, layer) in decode order."""
    bad = set(bad)

    def decode(header, profile, layer, section, chain=None):
        tag = int(bytes(section).split(b",")[0])
        if layer % profile.restart and chain.layer != layer - 1:
            raise ValueError(f"layer {layer} decoded after layer {chain.layer}")
        time.sleep(0.002)   # long enough for a decode beside it to show
        order.append((tag, layer))
        chain.layer = layer
        if (tag, layer) in bad:
            bad.discard((tag, layer))
            raise codec.CorruptBitstream("bad section")
        return torch.full((1,), float(tag)), torch.full((1,), float(layer))
    return decode


def _predicted_answer(delivery: OrderedDelivery, layers: range, tag: int) -> None:
    """One answer's sections (a header of its own), tagged ``tag``, for chunk 0."""
    header = _PredictedHeader()
    for layer in layers:
        delivery.add_section(0, layer, header, _Profile(), f"{tag},".encode())


async def test_a_predicted_chunks_sections_decode_in_order_in_one_chain() -> None:
    """Two workers, sections landing at once: each layer of a predicted answer decodes after
    the one before it (never beside it), and every layer is delivered once, in order."""
    order: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []
    layers = 6
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        delivery = OrderedDelivery(chunks=1, layers=layers, on_layer=lambda c, l, k, v: seen.append((c, l)),
                                   on_text=None, observe=lambda event: None, executor=pool,
                                   decode=_chained_decoder(order))
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 0)
        _predicted_answer(delivery, range(layers), 0)
        await consumer
    assert order == [(0, l) for l in range(layers)]
    assert seen == [(0, l) for l in range(layers)]


async def test_a_predicted_continuation_decodes_the_layers_before_it_as_context() -> None:
    """Three of six layers went out at level 0 when the chunk continues at level 2: the
    answer starts at layer 2 (coded alone), layer 2 feeds the chain and is not delivered
    again, layers 3.. are delivered from the continuation, each layer once."""
    order: list[tuple[int, int]] = []
    events: list[tuple[int, int]] = []
    handed: list[int] = []
    layers = 6
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gate = asyncio.Event()

        async def on_layer(c, l, k, v):
            events.append((l, int(k.item())))
            if l == 2:
                await gate.wait()

        def observe(event):
            if isinstance(event, ev.SectionHanded):
                handed.append(event.layer)

        delivery = OrderedDelivery(chunks=1, layers=layers, on_layer=on_layer, on_text=None, observe=observe,
                                   executor=pool, decode=_chained_decoder(order),
                                   resume_layer=lambda level, delivered: delivered - delivered % 2)
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 0)
        _predicted_answer(delivery, range(4), 0)
        while delivery.delivered_layers(0) < 3:
            await asyncio.sleep(0.001)
        with pytest.raises(RuntimeError, match="only continue from layer 2"):
            delivery.resolve(0, 2, first_layer=3)
        delivery.resolve(0, 2, first_layer=2)
        gate.set()
        _predicted_answer(delivery, range(2, layers), 5)
        await consumer
    assert events == [(0, 0), (1, 0), (2, 0), (3, 5), (4, 5), (5, 5)]
    assert order[-4:] == [(5, 2), (5, 3), (5, 4), (5, 5)]   # the continuation's chain, from layer 2
    assert handed[-4:] == [2, 3, 4, 5]   # the context layer counts as decoding work


async def test_a_corrupt_predicted_layer_cuts_off_the_layers_predicted_from_it() -> None:
    """Layer 1 of a predicted answer fails its checks: layers 2 (coded alone) decodes, layer
    3 (predicted from 2) too, but the consumer stops at layer 1 and the refetch (from layer
    0 = the delivered count's restart) replaces every layer not delivered, decoded afresh
    in its own chain; one Corrupt per bad answer."""
    order: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []
    corrupt: list[int] = []
    layers = 4
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        holder: dict = {}

        def on_corrupt(chunk: int, layer: int, message: str) -> None:
            corrupt.append(layer)
            _predicted_answer(holder["delivery"], range(layers), 7)

        delivery = OrderedDelivery(chunks=1, layers=layers, on_layer=lambda c, l, k, v: seen.append((l, int(k.item()))),
                                   on_text=None, observe=_on_corrupt(on_corrupt), executor=pool,
                                   decode=_chained_decoder(order, bad={(0, 1)}),
                                   resume_layer=lambda level, delivered: delivered - delivered % 2)
        holder["delivery"] = delivery
        consumer = asyncio.create_task(_run(delivery))
        delivery.resolve(0, 0)
        _predicted_answer(delivery, range(layers), 0)
        await consumer
    assert corrupt == [1]
    assert seen == [(0, 0), (1, 7), (2, 7), (3, 7)]
    assert [layer for tag, layer in order if tag == 7] == [0, 1, 2, 3]   # the old chain may still run beside
