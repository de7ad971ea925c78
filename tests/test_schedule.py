"""The upload/decode overlap scheduler (kernels/kvwire_kernels/schedule.py) driven through a fake GPU.

The fake backend carries the commands out on a simulated clock with one copy stream and
one decode stream, as kernels/kvwire_kernels/gpu.py does on a real one, and records what each buffer
was doing when: the tests then check the rules the scheduler promises.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest

from kvwire_kernels.schedule import Deliver, Event, Launch, Scheduler, Upload, Verify


class FakeGpu:
    """Streams on a clock: a copy takes ``copy_s`` and a decode ``decode_s`` per layer."""

    def __init__(self, copy_s: float = 1.0, decode_s: float = 1.0) -> None:
        self.copy_s, self.decode_s = copy_s, decode_s
        self.now = 0.0                      # host time
        self.copy_free = self.decode_free = 0.0
        self.events: dict[Event, float] = {}
        self.verified: Counter = Counter()
        self.uses: dict[int, list[dict]] = defaultdict(list)   # buffer -> its uses in order
        self.delivered: list[tuple[int, int, float]] = []
        self.decode_end: dict[tuple[int, int], float] = {}       # (chunk, layer) -> decoded at

    def fired(self, event: Event | None) -> float:
        return 0.0 if event is None else self.events[event]   # KeyError: waits on an unrecorded event

    def run(self, commands) -> None:
        for command in commands:
            if isinstance(command, Verify):
                self.verified[command.chunk, command.layer] += 1
            elif isinstance(command, Upload):
                self.now = max(self.now, self.fired(command.host_wait))   # the host blocks to refill
                start = max(self.copy_free, self.now, self.fired(command.device_wait))
                self.copy_free = start + self.copy_s * len(command.layers)
                self.events[Event("copied", command.chunk, command.group)] = self.copy_free
                self.uses[command.buffer].append({"key": (command.chunk, command.group), "host_write": self.now,
                                                  "copy": (start, self.copy_free)})
            elif isinstance(command, Launch):
                start = max(self.decode_free, self.fired(command.after))
                self.decode_free = start + self.decode_s * len(command.layers)
                self.events[Event("decoded", command.chunk, command.group)] = self.decode_free
                use = self.uses[command.buffer][-1]
                assert use["key"] == (command.chunk, command.group)   # decodes the buffer its upload filled
                use["decode"] = (start, self.decode_free)
                for layer in command.layers:
                    self.decode_end[command.chunk, layer] = self.decode_free
            else:
                assert isinstance(command, Deliver)
                at = self.fired(command.after)
                self.delivered += [(command.chunk, layer, at) for layer in command.layers]


def _stream(scheduler: Scheduler, gpu: FakeGpu, chunks: int, layers: int, order, arrival_s: float = 0.0,
            first: int = 0):
    """Open chunks ``first`` .. ``first + chunks - 1`` and feed each one's layers in
    ``order(chunk)``; returns, per section, how many sections of its chunk arrived after
    it before its group was uploaded."""
    waited: dict[tuple[int, int], int] = {}
    for chunk in range(first, first + chunks):
        scheduler.open_chunk(chunk, layers)
        seen: list[int] = []
        for layer in order(chunk):
            gpu.now += arrival_s
            seen.append(layer)
            commands = scheduler.arrived(chunk, layer)
            gpu.run(commands)
            for command in commands:
                if isinstance(command, Upload):
                    for l in command.layers:
                        waited[chunk, l] = len(seen) - 1 - seen.index(l)
    return waited


@pytest.mark.parametrize("group_layers", [1, 3, 4, 32])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("buffers", [2, 3])
def test_rules_hold_for_any_arrival_order(group_layers: int, shuffled: bool, buffers: int) -> None:
    chunks, layers = 4, 10
    rng = random.Random(group_layers * 7 + buffers)
    orders = {c: (rng.sample(range(layers), layers) if shuffled else list(range(layers))) for c in range(chunks)}
    scheduler, gpu = Scheduler(group_layers, buffers), FakeGpu(copy_s=1.3, decode_s=0.7)
    waited = _stream(scheduler, gpu, chunks, layers, orders.__getitem__, arrival_s=0.5)
    # CRC and lane table checked once per section
    assert gpu.verified == Counter({(c, l): 1 for c in range(chunks) for l in range(layers)})
    # a buffer is refilled only after the last copy out of it, copied to only after its last decode
    for uses in gpu.uses.values():
        for before, after in zip(uses, uses[1:]):
            assert after["host_write"] >= before["copy"][1]
            assert after["copy"][0] >= before["decode"][1]
    # layers delivered in order, each after its decode
    for chunk in range(chunks):
        got = [(layer, at) for c, layer, at in gpu.delivered if c == chunk]
        assert [layer for layer, _ in got] == list(range(layers))
        assert all(at >= gpu.decode_end[chunk, layer] for layer, at in got)
    # a layer is uploaded no later than one group after its bytes arrive
    assert max(waited.values()) <= group_layers - 1


def test_chunk_i_decodes_while_chunk_i_plus_1_uploads() -> None:
    scheduler, gpu = Scheduler(group_layers=4), FakeGpu(copy_s=1.0, decode_s=1.0)
    _stream(scheduler, gpu, chunks=2, layers=8, order=lambda c: range(8))
    decodes = [u["decode"] for uses in gpu.uses.values() for u in uses if u["key"][0] == 0]
    copies = [u["copy"] for uses in gpu.uses.values() for u in uses if u["key"][0] == 1]
    assert any(d0 < c1 and c0 < d1 for d0, d1 in decodes for c0, c1 in copies)
    # pipelined: the whole stream takes less than copying and decoding one after the other
    assert gpu.decode_free < 2 * 8 * (1.0 + 1.0)


def test_a_partial_group_goes_on_flush_and_at_the_chunks_last_layer() -> None:
    scheduler = Scheduler(group_layers=4)
    scheduler.open_chunk(0, 6)
    assert scheduler.arrived(0, 0) == [Verify(0, 0)]
    flushed = scheduler.flush()
    assert [type(c) for c in flushed] == [Upload, Launch, Deliver] and flushed[0].layers == (0,)
    assert scheduler.flush() == []
    commands = [c for layer in range(1, 6) for c in scheduler.arrived(0, layer)]
    assert [c.layers for c in commands if isinstance(c, Upload)] == [(1, 2, 3, 4), (5,)]
    assert [c.layers for c in commands if isinstance(c, Deliver)] == [(1, 2, 3, 4), (5,)]


def test_a_cancelled_chunk_leaves_nothing_and_its_buffers_are_reused_in_order() -> None:
    """Chunk 0 is cancelled while its first group is still being copied (and a second
    group is half full): the scheduler holds nothing of it, delivers no more of it, and
    chunk 1's groups in the same buffers still wait for its copy and decode."""
    scheduler, gpu = Scheduler(group_layers=4, buffers=2), FakeGpu(copy_s=5.0, decode_s=3.0)
    scheduler.open_chunk(0, 8)
    for layer in range(6):
        gpu.run(scheduler.arrived(0, layer))
    copy_end = gpu.events[Event("copied", 0, 0)]
    assert gpu.now < copy_end                       # mid-upload
    scheduler.cancel(0)
    assert scheduler.open_chunks == ()
    assert scheduler.flush() == []                  # layers 4 and 5 were dropped, not uploaded
    with pytest.raises(ValueError, match="not opened"):
        scheduler.arrived(0, 6)
    scheduler.cancel(0)                             # cancelling again does nothing
    _stream(scheduler, gpu, 1, 8, order=lambda c: range(8), first=1)
    for uses in gpu.uses.values():
        for before, after in zip(uses, uses[1:]):
            assert after["host_write"] >= before["copy"][1]
            assert after["copy"][0] >= before["decode"][1]
    assert gpu.uses[0][0]["key"] == (0, 0) and gpu.uses[0][1]["key"][0] == 1   # buffer 0 reused after chunk 0
    assert [layer for c, layer, _ in gpu.delivered if c == 0] == [0, 1, 2, 3]   # delivered before the cancel
    assert [layer for c, layer, _ in gpu.delivered if c == 1] == list(range(8))
    assert scheduler.open_chunks == ()


def test_cancelled_chunks_do_not_accumulate() -> None:
    """A long-lived receiver cancelling chunk after chunk holds no more than one."""
    scheduler, gpu = Scheduler(group_layers=3), FakeGpu()
    for chunk in range(1000):
        scheduler.open_chunk(chunk, 32)
        for layer in range(chunk % 7):
            gpu.run(scheduler.arrived(chunk, layer))
        scheduler.cancel(chunk)
        assert scheduler.open_chunks == ()


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="group_layers"):
        Scheduler(0)
    with pytest.raises(ValueError, match="buffers"):
        Scheduler(2, buffers=1)
    scheduler = Scheduler(2)
    with pytest.raises(ValueError, match="not opened"):
        scheduler.arrived(0, 0)
    scheduler.open_chunk(0, 3)
    with pytest.raises(ValueError, match="already open"):
        scheduler.open_chunk(0, 3)
    scheduler.arrived(0, 1)
    with pytest.raises(ValueError, match="arrived twice"):
        scheduler.arrived(0, 1)
    with pytest.raises(ValueError, match="out of range"):
        scheduler.arrived(0, 3)
