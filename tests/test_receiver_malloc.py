"""The receiver's glibc malloc tuning and periodic trim (``streamer.receiver.malloc``):
which settings it applies and which it leaves to the environment, the trim loop, a no-op
off glibc, and the daemon starting and stopping it. No RSS figures (the machine is shared):
``kvwire bench load`` measures those."""
from __future__ import annotations

import asyncio
import threading

import pytest

from streamer.receiver import malloc
from streamer.receiver.daemon import Receiver, ReceiverConfig


class FakeLibc:
    """Records mallopt and malloc_trim calls (and the threads the trims ran on);
    ``trimmed`` is set after ``stop_after`` trims. Made inside a running loop."""

    def __init__(self, accept: bool = True, stop_after: int = 2) -> None:
        self.mallopts: list[tuple[int, int]] = []
        self.trims = 0
        self.threads: set[int] = set()
        self.accept = accept
        self.stop_after = stop_after
        self.trimmed = asyncio.Event()
        self._loop = asyncio.get_event_loop()

    def mallopt(self, param: int, value: int) -> int:
        self.mallopts.append((param, value))
        return 1 if self.accept else 0

    def malloc_trim(self, pad: int) -> int:
        assert pad == 0
        self.trims += 1
        self.threads.add(threading.get_ident())
        if self.trims >= self.stop_after:
            self._loop.call_soon_threadsafe(self.trimmed.set)
        return 1


def test_settings_leave_what_the_environment_chose() -> None:
    both = {malloc.M_ARENA_MAX: malloc.ARENA_MAX, malloc.M_MMAP_THRESHOLD: malloc.MMAP_THRESHOLD}
    assert malloc.settings({}) == both
    assert malloc.settings({"MALLOC_ARENA_MAX": "4"}) == {malloc.M_MMAP_THRESHOLD: malloc.MMAP_THRESHOLD}
    assert malloc.settings({"MALLOC_MMAP_THRESHOLD_": "65536"}) == {malloc.M_ARENA_MAX: malloc.ARENA_MAX}
    assert malloc.settings({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=4096"}) == {}
    assert malloc.settings({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}) == both


async def test_tune_applies_the_settings_glibc_accepts() -> None:
    libc = FakeLibc()
    assert malloc.Malloc(libc).tune({}) == {"arena_max": malloc.ARENA_MAX, "mmap_threshold": malloc.MMAP_THRESHOLD}
    assert sorted(libc.mallopts) == sorted([(malloc.M_ARENA_MAX, malloc.ARENA_MAX),
                                            (malloc.M_MMAP_THRESHOLD, malloc.MMAP_THRESHOLD)])
    assert malloc.Malloc(FakeLibc(accept=False)).tune({}) == {}


def test_this_process_is_tuned_and_trimmed_when_it_runs_glibc() -> None:
    m = malloc.Malloc.here()
    if not m.available:
        pytest.skip("not glibc")
    # the same values as the receiver daemon sets (the tests may have started one already)
    assert m.tune({"MALLOC_ARENA_MAX": "2"}) == {"mmap_threshold": malloc.MMAP_THRESHOLD}
    m.trim()


async def test_trim_runs_every_period_until_cancelled() -> None:
    libc = FakeLibc(stop_after=3)
    tuning = malloc.Tuning({}, seconds=0.001, malloc=malloc.Malloc(libc))
    await asyncio.wait_for(libc.trimmed.wait(), 30)
    tuning.stop()
    await asyncio.sleep(0)
    trims = libc.trims
    await asyncio.sleep(0.01)
    assert libc.trims == trims
    assert tuning.describe() == (f"arena_max={malloc.ARENA_MAX}, mmap_threshold={malloc.MMAP_THRESHOLD}, "
                                 "trimmed every 0.001 s")


async def test_a_trim_runs_off_the_event_loop_which_keeps_serving_meanwhile() -> None:
    """A trim walks glibc's free lists with each arena locked (tens of ms with a few
    hundred MB of holes): it runs on a worker thread. Here a trim that cannot end until
    the loop has run a callback after it began: on the loop's own thread it never would."""
    began, release = threading.Event(), threading.Event()

    class SlowLibc(FakeLibc):
        def malloc_trim(self, pad: int) -> int:
            began.set()
            assert release.wait(10), "the event loop did not run while the trim held its thread"
            return super().malloc_trim(pad)

    libc = SlowLibc(stop_after=1)
    tuning = malloc.Tuning({}, seconds=0.001, malloc=malloc.Malloc(libc))
    while not began.is_set():
        await asyncio.sleep(0.001)
    release.set()   # only a loop that runs during the trim gets here
    await asyncio.wait_for(libc.trimmed.wait(), 10)
    tuning.stop()
    assert threading.get_ident() not in libc.threads


async def test_off_glibc_nothing_runs() -> None:
    m = malloc.Malloc(None)
    assert not m.available and m.tune({}) == {} and m.trim() is False
    await malloc.trim_periodically(m, 0.001)   # returns at once
    tuning = malloc.Tuning({}, malloc=m)
    assert tuning.describe() == "not glibc: left as it is"
    tuning.stop()


async def test_the_daemon_trims_while_it_runs_and_stops_on_close() -> None:
    receiver = await Receiver(ReceiverConfig(servers=[("127.0.0.1", 1)], trim_seconds=0.5)).start("127.0.0.1", 0)
    try:
        assert (receiver._malloc is not None) == malloc.Malloc.here().available
    finally:
        await receiver.close()
    if receiver._malloc is not None and receiver._malloc._task is not None:
        await asyncio.sleep(0)
        assert receiver._malloc._task.cancelled() or receiver._malloc._task.done()
    untouched = await Receiver(ReceiverConfig(servers=[("127.0.0.1", 1)], trim_seconds=None)).start("127.0.0.1", 0)
    try:
        assert untouched._malloc is None
    finally:
        await untouched.close()
    with pytest.raises(ValueError, match="trim_seconds"):
        ReceiverConfig(servers=[("127.0.0.1", 1)], trim_seconds=0)
