"""The CUDA device hook of sessions and the receiver daemon, without a GPU.

A CUDA device's decoder is kvwire_kernels.stream's stream decoder; OrderedDelivery hands it each
section through ``submit`` (no executor thread blocked per section), and the typed errors
say what is missing where there is no GPU.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import torch

import codec
from streamer.net import devices
from streamer.net.delivery import OrderedDelivery
from streamer.receiver.daemon import check_device


class _Header:
    """The fields of a blob header the delivery reads: a section's decoded size, and whether it is predicted."""
    raw_size = 64
    predicted = False


HEADER = _Header()


def _gpu_missing() -> bool:
    from kvwire_kernels import devices as kernel_devices

    return not kernel_devices.availability()[0]


@pytest.mark.skipif(not _gpu_missing(), reason="a GPU is available here")
def test_cuda_without_a_gpu_is_a_typed_error_and_the_daemon_refuses_at_start() -> None:
    with pytest.raises(codec.GpuUnavailable, match="needs GPU decode"):
        devices.section_decoder("cuda:1")
    with pytest.raises(ValueError, match="cannot decode"):
        check_device("cuda")
    devices.close_devices()   # nothing was started: a no-op


class _Submitting:
    """A stream decoder's interface: submit returns a future resolved on another thread."""

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def submit(self, header, profile, layer, section) -> concurrent.futures.Future:
        self.submitted.append(layer)
        future: concurrent.futures.Future = concurrent.futures.Future()
        value = torch.full((2, 1), float(layer))
        threading.Timer(0.01 * (3 - layer), future.set_result, ((value, value),)).start()  # out of order
        return future

    def cancel(self, header) -> None:   # never called: the chunk is delivered in full
        raise AssertionError("an ordinary chunk is never cancelled")

    def __call__(self, *args):   # the blocking form, never used when submit exists
        raise AssertionError("OrderedDelivery must use submit")


async def test_ordered_delivery_submits_sections_to_a_stream_decoder() -> None:
    decoder, got = _Submitting(), []
    executor = concurrent.futures.ThreadPoolExecutor(1)
    delivery = OrderedDelivery(chunks=1, layers=3, on_layer=lambda c, l, k, v: got.append((l, float(k[0, 0]))),
                               on_text=None, observe=lambda event: None, executor=executor, decode=decoder)
    delivery.resolve(0, 1)
    for layer in range(3):
        delivery.add_section(0, layer, HEADER, None, b"x")
    await asyncio.wait_for(delivery.run(), 5)
    executor.shutdown()
    assert decoder.submitted == [0, 1, 2]
    assert got == [(0, 0.0), (1, 1.0), (2, 2.0)]


THREAD_COUNTS = """
import threading, numba, torch
from streamer.net import devices
torch.set_num_threads(3)
pool = devices.decode_executor()
decoding = pool.submit(lambda: (torch.get_num_threads(), numba.get_num_threads())).result()
later = []
thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
thread.start(); thread.join()
print(decoding[0], decoding[1], later[0], torch.get_num_threads())
"""


def test_decode_threads_run_on_one_core_and_leave_later_threads_theirs() -> None:
    """A decode thread computes on one core, and a thread started after the decode pool
    (a model server's worker) still gets the process's count: torch.set_num_threads also
    sets what later threads start with, and numba's first launch resets the calling
    thread's count. In a fresh process, where both libraries start for the first time."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", THREAD_COUNTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "3", "3"]
