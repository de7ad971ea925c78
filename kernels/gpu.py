"""GPU decode: the rANS lane kernel through PyCUDA, the inverse transform as a cuBLAS GEMM.

PyCUDA shares torch's primary context (``pycuda.autoprimaryctx``, never
``autoinit``), so device tensors pass between them by pointer. Each decoder owns
two CUDA streams: section bytes are copied host-to-device on ``copy_stream``
from page-locked memory while the previous section's kernel and GEMM run on
``decode_stream``; an event orders each decode after its own copy. The kernel
writes coefficients token-major ([tokens, rows]), which is exactly the GEMM's
left operand. Entropy decoding and dequantization are bit-identical to the CPU
decoder; the GEMM's summation order differs (cuBLAS vs MKL), so the output agrees
with the CPU to float32 rounding of the GEMM, not bit for bit. A rotary profile's keys
get their RoPE back on the device after the GEMM (torch, float32), at the positions the
blob header records, as the CPU decoder does. ``decode_layers``
runs the stages as a two-deep pipeline (``kernels.pipeline``): section l+1 uploads
while section l decodes.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

import codec
from codec import container, layer_codec, rotary, transform
from codec.errors import GpuUnavailable
from codec.profile import Profile

from .pipeline import pipelined

KERNEL_DIR = Path(__file__).resolve().parent
KERNEL_SOURCES = ("rans_decode.cu",)
THREADS_PER_BLOCK = 128


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
    def stage(self, header: codec.BlobHeader, profile: Profile | None, layer: int,
              section: bytes | memoryview) -> "_Staged":
        """Verify and parse a section on the host, then queue its upload on the copy stream."""
        resolved, slot = codec.resolve_profile(header, profile)
        sink_bytes, payload = container.split_section(section, header, layer)
        sinks = self._upload(np.frombuffer(sink_bytes, dtype=np.uint8)) if len(sink_bytes) else None
        if header.is_raw(layer):  # the tokens verbatim: no kernel, only the copy
            plan, inputs = None, {"raw": self._upload(np.frombuffer(payload, dtype=np.uint8))}
        else:
            lanes = layer_codec.parse_lanes(resolved, slot, layer, header.coded_tokens, payload, header.version)
            plan = lanes.plan
            inputs = {name: self._upload(array) for name, array in (
                ("words", lanes.words.view(np.int16)), ("lane_start", lanes.lane_start),
                ("states", lanes.states.view(np.int32)), ("step", plan.step),
                ("group", plan.group), ("table", plan.table), ("shift", plan.shift))}
        copied = torch.cuda.Event()
        copied.record(self._torch_copy)
        return _Staged(header, resolved, layer, plan, inputs, sinks, copied)

    def launch(self, staged: "_Staged") -> "_Launched":
        """Queue the kernel and the inverse-transform GEMM on the decode stream."""
        header, plan, layer = staged.header, staged.plan, staged.layer
        self._torch_decode.wait_event(staged.copied)
        coded, tokens, sinks = header.coded_tokens, header.tokens, header.sink_tokens
        channels = header.heads * header.head_dim
        out = torch.empty((2, tokens, channels), dtype=header.dtype, device=self.device)
        if plan is None:
            status = torch.zeros(1, dtype=torch.int32, device=self.device)
            with torch.cuda.stream(self._torch_decode):
                out[:, sinks:] = staged.inputs["raw"].view(header.dtype).reshape(2, coded, channels)
                return self._finish_launch(staged, out, status)
        tables = self._device_tables(staged.profile)
        coef = torch.empty((coded, plan.rows), dtype=torch.float32, device=self.device)
        status = torch.zeros(max(plan.lanes, 1), dtype=torch.int32, device=self.device)
        if plan.lanes:
            ptr = lambda t: np.uintp(t.data_ptr())  # noqa: E731
            i = staged.inputs
            self._kernel(ptr(i["words"]), ptr(i["lane_start"]), ptr(i["states"]), np.int32(plan.lanes),
                         np.int32(plan.kept[0]), np.int32(plan.rows_per_lane), np.int32(plan.piece_tokens),
                         ptr(i["step"]), ptr(i["group"]), ptr(i["table"]),
                         ptr(i["shift"]), ptr(tables.freq), ptr(tables.cdf), ptr(tables.lut),
                         np.int32(coded), np.int32(plan.rows), ptr(coef), ptr(status),
                         block=(THREADS_PER_BLOCK, 1, 1),
                         grid=(math.ceil(plan.lanes / THREADS_PER_BLOCK), 1), stream=self.decode_stream)
        rope = staged.profile.rotary
        with torch.cuda.stream(self._torch_decode):
            rows = (coef[:, : plan.kept[0]], coef[:, plan.kept[0]:])
            for kv in range(2):
                mean = tables.mean[layer, kv]
                if tables.basis is None:
                    result = rows[kv] + mean
                else:
                    result = torch.addmm(mean.expand(coded, channels), rows[kv], tables.basis[layer, kv, : plan.kept[kv]])
                if kv == 0 and rope is not None:
                    result = rotary.rotate(result, rope, rope.angles(header.start + sinks, coded, self.device))
                out[kv, sinks:] = transform.clamp_to(result, header.dtype)
            return self._finish_launch(staged, out, status)

    def _finish_launch(self, staged: "_Staged", out: torch.Tensor, status: torch.Tensor) -> "_Launched":
        """Queue the sink tokens' copy and the completion event (on the decode stream)."""
        header = staged.header
        if staged.sinks is not None:
            out[:, :header.sink_tokens] = staged.sinks.view(header.dtype).reshape(2, header.sink_tokens, -1)
        done = torch.cuda.Event()
        done.record(self._torch_decode)
        return _Launched(header, staged.layer, out, status, done, staged)

    def finish(self, launched: "_Launched") -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for one section's decode; CorruptBitstream if any lane failed its checks."""
        launched.done.synchronize()
        failed = int(launched.status.max().item())
        if failed:
            raise codec.CorruptBitstream(f"layer {launched.layer}: entropy-coded data is corrupt (code {failed})")
        header = launched.header
        out = launched.out.reshape(2, header.tokens, header.heads, header.head_dim)
        return out[0], out[1]

    def decode_section(self, header: codec.BlobHeader, profile: Profile | None, layer: int,
                       section: bytes | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [tokens, heads, head_dim] on the GPU from one layer's section bytes."""
        return self.finish(self.launch(self.stage(header, profile, layer, section)))

    def decode_layers(self, header: codec.BlobHeader, profile: Profile | None,
                      sections: Iterable[tuple[int, bytes | memoryview]], depth: int = 2
                      ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(layer, k, v) in order, the upload of section l+1 overlapping the decode of l."""
        def submit(item: tuple[int, bytes | memoryview]) -> _Launched:
            return self.launch(self.stage(header, profile, item[0], item[1]))

        for launched, (k, v) in pipelined(sections, submit, lambda l: (l, self.finish(l)), depth):
            yield launched.layer, k, v


@dataclass
class _Staged:
    header: codec.BlobHeader
    profile: Profile
    layer: int
    plan: layer_codec.LayerPlan | None  # None for a raw section
    inputs: dict[str, torch.Tensor]
    sinks: torch.Tensor | None
    copied: torch.cuda.Event


@dataclass
class _Launched:
    header: codec.BlobHeader
    layer: int
    out: torch.Tensor
    status: torch.Tensor
    done: torch.cuda.Event
    staged: _Staged  # keeps the device inputs alive until the kernel has run


_decoders: dict[torch.device, GpuDecoder] = {}


def decoder(device: str | torch.device = "cuda") -> GpuDecoder:
    """The process-wide decoder of a device (compiles the kernel once)."""
    key = torch.device(device)
    if key not in _decoders:
        _decoders[key] = GpuDecoder(key)
    return _decoders[key]
