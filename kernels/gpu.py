"""GPU decode: the rANS lane kernel through PyCUDA, the inverse transform as a cuBLAS GEMM.

PyCUDA shares torch's primary context (``pycuda.autoprimaryctx``, never
``autoinit``), so device tensors pass between them by pointer. Each decoder owns
two CUDA streams: section bytes are copied host-to-device on ``copy_stream``
from page-locked memory while the previous section's kernel and GEMM run on
``decode_stream``; an event orders each decode after its own copy. The kernel
writes coefficients token-major ([tokens, rows]), which is exactly the GEMM's
left operand. Entropy decoding and dequantization are bit-identical to the CPU
decoder; the GEMM's summation order differs (cuBLAS vs MKL), so the output agrees
with the CPU to float32 rounding of the GEMM, not bit for bit.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import codec
from codec import container, layer_codec
from codec.profile import Profile

KERNEL_DIR = Path(__file__).resolve().parent
KERNEL_SOURCES = ("rans_decode.cu",)
THREADS_PER_BLOCK = 128


class GpuUnavailable(RuntimeError):
    """No usable GPU decode path: the message says what is missing."""


def availability() -> tuple[bool, str]:
    """(True, "") when GPU decode can run here, else (False, what is missing)."""
    try:
        import pycuda  # noqa: F401
    except ImportError:
        return False, "pycuda is not installed (pip install 'kvwire[cuda]')"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device (a CPU-only torch build, or no GPU/driver)"
    return True, ""


def kernel_source() -> str:
    return "\n".join((KERNEL_DIR / name).read_text() for name in KERNEL_SOURCES)


@dataclass
class _DeviceTables:
    freq: torch.Tensor
    cdf: torch.Tensor
    lut: torch.Tensor
    mean: torch.Tensor
    basis: torch.Tensor | None


class GpuDecoder:
    """Decodes blob sections straight into CUDA tensors of one device."""

    def __init__(self, device: str | torch.device = "cuda") -> None:
        ok, reason = availability()
        if not ok:
            raise GpuUnavailable(f"device='cuda' needs GPU decode: {reason}")
        import pycuda.autoprimaryctx  # noqa: F401  (binds torch's primary context)
        import pycuda.driver as cuda
        from pycuda.compiler import SourceModule

        self.device = torch.device(device)
        torch.cuda.init()
        cache = Path(os.environ.get("KVWIRE_CUDA_CACHE", Path.home() / ".cache" / "kvwire" / "cuda"))
        cache.mkdir(parents=True, exist_ok=True)
        self._module = SourceModule(kernel_source(), no_extern_c=True, cache_dir=str(cache),
                                    options=["-O3", "--fmad=false"])
        self._kernel = self._module.get_function("rans_decode_lanes")
        self._cuda = cuda
        self.copy_stream = cuda.Stream()
        self.decode_stream = cuda.Stream()
        self._torch_copy = torch.cuda.ExternalStream(self.copy_stream.handle, device=self.device)
        self._torch_decode = torch.cuda.ExternalStream(self.decode_stream.handle, device=self.device)
        self._tables: "weakref.WeakKeyDictionary[Profile, _DeviceTables]" = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ tables
    def _device_tables(self, profile: Profile) -> _DeviceTables:
        tables = self._tables.get(profile)
        if tables is None:
            host = layer_codec.coder_tables(profile)
            to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
            tables = _DeviceTables(freq=to(host.freq.view(np.int16)), cdf=to(host.cdf.view(np.int16)),
                                   lut=to(host.lut), mean=to(profile.mean),
                                   basis=None if profile.basis is None else to(profile.basis))
            self._tables[profile] = tables
        return tables

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """Async host-to-device copy on the copy stream from page-locked memory."""
        host = torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
        with torch.cuda.stream(self._torch_copy):
            return host.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ decode
    def decode_section(self, header: codec.BlobHeader, profile: Profile | None, layer: int,
                       section: bytes | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [tokens, heads, head_dim] on the GPU from one layer's section bytes."""
        resolved, slot = codec.resolve_profile(header, profile)
        view = container.verify_section(section, header, layer)
        channels = header.heads * header.head_dim
        sinks, tokens = header.sink_tokens, header.tokens
        item = torch.finfo(header.dtype).bits // 8
        sink_len = 2 * sinks * channels * item
        if len(view) < sink_len:
            raise codec.CorruptBitstream(f"layer {layer}'s section is shorter than its sink tokens")
        lanes = layer_codec.parse_lanes(resolved, slot, layer, tokens - sinks, view[sink_len:])
        plan = lanes.plan
        tables = self._device_tables(resolved)
        # stage every input on the copy stream; the decode stream waits on one event
        words = self._upload(lanes.words.view(np.int16))
        lane_start = self._upload(lanes.lane_start)
        states = self._upload(lanes.states.view(np.int32))
        lane_rows = self._upload(plan.lane_rows)
        step = self._upload(plan.step)
        group = self._upload(plan.group)
        table = self._upload(plan.table)
        shift = self._upload(plan.shift)
        sink_bits = self._upload(np.frombuffer(view[:sink_len], dtype=np.uint8)) if sinks else None
        copied = torch.cuda.Event()
        copied.record(self._torch_copy)
        self._torch_decode.wait_event(copied)
        coded = tokens - sinks
        coef = torch.empty((coded, plan.rows), dtype=torch.float32, device=self.device)
        status = torch.zeros(max(plan.lanes, 1), dtype=torch.int32, device=self.device)
        if plan.lanes:
            ptr = lambda t: np.uintp(t.data_ptr())  # noqa: E731
            self._kernel(ptr(words), ptr(lane_start), ptr(states), ptr(lane_rows), np.int32(plan.lanes),
                         ptr(step), ptr(group), ptr(table), ptr(shift), ptr(tables.freq), ptr(tables.cdf),
                         ptr(tables.lut), np.int32(coded), np.int32(plan.rows), ptr(coef), ptr(status),
                         block=(THREADS_PER_BLOCK, 1, 1),
                         grid=(math.ceil(plan.lanes / THREADS_PER_BLOCK), 1), stream=self.decode_stream)
        out = torch.empty((2, tokens, channels), dtype=header.dtype, device=self.device)
        with torch.cuda.stream(self._torch_decode):
            rows = (coef[:, : plan.kept[0]], coef[:, plan.kept[0]:])
            for kv in range(2):
                mean = tables.mean[layer, kv]
                if tables.basis is None:
                    out[kv, sinks:] = rows[kv] + mean
                else:
                    basis = tables.basis[layer, kv, : plan.kept[kv]]
                    out[kv, sinks:] = torch.addmm(mean.expand(coded, channels), rows[kv], basis)
            if sink_bits is not None:
                out[:, :sinks] = sink_bits.view(header.dtype).reshape(2, sinks, channels)
            failed = int(status.max().item())  # synchronises this stream only
        if failed:
            raise codec.CorruptBitstream(f"layer {layer}: entropy-coded data is corrupt (code {failed})")
        out = out.reshape(2, tokens, header.heads, header.head_dim)
        return out[0], out[1]


_decoders: dict[torch.device, GpuDecoder] = {}


def decoder(device: str | torch.device = "cuda") -> GpuDecoder:
    """The process-wide decoder of a device (compiles the kernel once)."""
    key = torch.device(device)
    if key not in _decoders:
        _decoders[key] = GpuDecoder(key)
    return _decoders[key]
