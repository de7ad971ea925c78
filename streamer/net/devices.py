"""Where decoded layers land: the codec's section decoder for a device, with the CUDA
backend (``kvwire_kernels``) imported only when a session or daemon asks for a CUDA device.

On a CUDA device the decoder is ``kvwire_kernels.stream``'s process-wide stream decoder of that
device: its ``submit`` takes each section as it lands and groups of layers upload and
decode overlapped (``kvwire_kernels.schedule``), which ``OrderedDelivery`` uses instead of a
blocking decode per section."""
from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import numba
import torch

import codec


def section_decoder(device: str | torch.device):
    """``codec.section_decoder(device)``, registering the CUDA backend first if needed;
    codec.GpuUnavailable says what is missing (pycuda, a GPU) when it cannot run here."""
    if torch.device(device).type == "cuda":
        import kvwire_kernels  # noqa: F401  (registers the CUDA section decoder with codec)
        from kvwire_kernels import stream

        return stream.stream_decoder(device)
    return codec.section_decoder(device)


_decode_pool: concurrent.futures.ThreadPoolExecutor | None = None


def decode_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads every session of the process decodes CPU sections on, one per core: a
    thread per session made memory and contention grow with the number of sessions, and a
    section now waits its turn instead.

    Each thread runs torch's and numba's kernels on itself alone (both libraries' thread
    counts are per thread, :func:`_one_core`), so sections decode side by side, one per
    core, rather than each splitting over every core. Split, every thread led its own
    OpenMP team, the teams outnumbered the cores, and OpenMP then stops its workers
    spinning between parallel regions: each of a section's many small regions paid a
    wake-up, decoding on a thread ran at half the speed it has on the main thread, and
    what spinning was left took cores from the event loop, which stamps the arrivals the
    link is measured by."""
    global _decode_pool
    if _decode_pool is None:
        _decode_pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kvwire-decode",
                                                             initializer=_one_core)
    return _decode_pool


#: Held while a decode thread sets its torch thread count (see :func:`_one_core`).
_thread_count_lock = threading.Lock()


def _one_core() -> None:
    """Run this thread's torch and numba kernels on one core, and nobody else's.

    ``torch.set_num_threads`` sets the calling thread's count and also the count every
    thread started afterwards begins with: left so, the decode threads would make every
    later thread of the process (a model server's worker, an executor's) compute on one
    core. So the process default is put back from a helper thread, which changes only
    its own count, once this thread's is fixed at one (``get_num_threads`` first fixes
    this thread's count from the default, so it is not read again later). numba goes first:
    starting its OpenMP threading layer resets the calling thread's OpenMP count."""
    numba.set_num_threads(1)
    with _thread_count_lock:
        default = torch.get_num_threads()
        torch.set_num_threads(1)
        restorer = threading.Thread(target=torch.set_num_threads, args=(default,), name="kvwire-thread-count")
        restorer.start()
        restorer.join()


def close_devices() -> None:
    """Stop the GPU stream decoders and release the devices, if any were started (they
    are all in ``kvwire_kernels.devices``' registry, stream decoders or not)."""
    registry = sys.modules.get("kvwire_kernels.devices")
    if registry is not None:
        registry.close_all()
