"""CUDA decode kernels: compile in CI without a GPU, and check their logic bit for bit.

Without a GPU the kernel is still exercised: it is compiled as plain C++ through
kernels/host_shim.h and run lane by lane, and its coefficients must equal the
numba decoder's exactly (same bytes in, same floats out). The GPU tests proper
skip with the reason when pycuda or a device is missing.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import container, layer_codec, rans
from kernels import gpu

KERNELS = Path(gpu.__file__).resolve().parent


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("source", sorted(p.name for p in KERNELS.glob("*.cu")))
def test_every_kernel_compiles_for_sm90(source: str, tmp_path: Path) -> None:
    result = subprocess.run(["nvcc", "--cubin", "-arch=sm_90", "--fmad=false", "-o", str(tmp_path / "k.cubin"),
                             str(KERNELS / source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    lib = tmp_path_factory.mktemp("kernel") / "host_kernel.so"
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-ffp-contract=off", "-I", str(KERNELS),
                    "-o", str(lib), str(KERNELS / "host_entry.cpp")], check=True)
    return ctypes.CDLL(str(lib)).host_rans_decode_lanes


def _ptr(array: np.ndarray) -> ctypes.c_void_p:
    return array.ctypes.data_as(ctypes.c_void_p)


def _host_decode(fn, profile, slot, layer, coded_tokens, payload):
    lanes = layer_codec.parse_lanes(profile, slot, layer, coded_tokens, payload)
    plan = lanes.plan
    tables = layer_codec.coder_tables(profile)
    arrays = [np.ascontiguousarray(a) for a in (lanes.words, lanes.lane_start, lanes.states, plan.lane_rows,
                                                plan.step, plan.group, plan.table, plan.shift,
                                                tables.freq, tables.cdf, tables.lut)]
    out = np.full((coded_tokens, plan.rows), np.nan, dtype=np.float32)
    status = np.full(max(plan.lanes, 1), -1, dtype=np.int32)
    fn(*[_ptr(a) for a in arrays[:4]], ctypes.c_int(plan.lanes), *[_ptr(a) for a in arrays[4:]],
       ctypes.c_int(coded_tokens), ctypes.c_int(plan.rows), _ptr(out), _ptr(status))
    return out, status[: plan.lanes]


def _layer_payloads(blob: bytes):
    header = codec.parse_header(blob)
    for layer in range(header.layers):
        assert not header.is_raw(layer)
        yield header, layer, container.section(blob, header, layer)[header.sink_size:]


def _kv(seed: int, tokens: int = 120) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(12, 12, generator=torch.Generator().manual_seed(7))
    return (torch.randn(2, 2, tokens, 12, generator=gen) @ mix).reshape(2, 2, tokens, 3, 4)


@pytest.mark.parametrize("delta", ["never", "always"])
def test_host_compiled_kernel_matches_cpu_decoder_bit_for_bit(host_kernel, delta: str) -> None:
    profile = codec.calibrate([_kv(1)], delta=delta)
    kv = _kv(2)
    kv[0, 1, 50] *= 400.0  # far outside the calibrated range: escapes
    for level in range(len(profile.levels)):
        blob = codec.encode(kv, level, profile)
        for header, layer, payload in _layer_payloads(blob):
            lanes = layer_codec.parse_lanes(profile, level, layer, header.coded_tokens, payload)
            expected = layer_codec.decode_coefficients(profile, layer, lanes, header.coded_tokens)
            got, status = _host_decode(host_kernel, profile, level, layer, header.coded_tokens, payload)
            assert (status == rans.OK).all()
            np.testing.assert_array_equal(got.T, expected)


def test_host_compiled_kernel_flags_corrupt_lanes(host_kernel) -> None:
    profile = codec.calibrate([_kv(1)])
    blob = codec.encode(_kv(3), 1, profile)
    header, layer, payload = next(_layer_payloads(blob))
    damaged = bytearray(payload)
    damaged[-7] ^= 0x5A  # inside the last lane's words
    _, status = _host_decode(host_kernel, profile, 1, layer, header.coded_tokens, memoryview(bytes(damaged)))
    lanes = layer_codec.parse_lanes(profile, 1, layer, header.coded_tokens, memoryview(bytes(damaged)))
    with pytest.raises(codec.CorruptBitstream):
        layer_codec.decode_coefficients(profile, layer, lanes, header.coded_tokens)
    assert (status != rans.OK).any()


def test_cuda_device_without_gpu_says_what_is_missing() -> None:
    ok, reason = gpu.availability()
    if ok:
        pytest.skip("a GPU is available here")
    blob = codec.encode(_kv(4), 1, None)
    with pytest.raises(gpu.GpuUnavailable, match="needs GPU decode: .+"):
        codec.decode(blob, device="cuda")


def test_codec_alone_names_the_missing_backend() -> None:
    """codec never imports kernels: without it, device="cuda" says to import it."""
    script = ("import codec, torch\n"
              "blob = codec.encode(torch.randn(1, 2, 8, 1, 4), 1, None)\n"
              "try:\n"
              "    codec.decode(blob, device='cuda')\n"
              "except codec.GpuUnavailable as exc:\n"
              "    print('GpuUnavailable:', exc)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert "GpuUnavailable:" in out.stdout and "import kernels" in out.stdout


def test_importing_kernels_registers_the_cuda_decoder() -> None:
    import kernels  # noqa: F401

    assert codec.backends._factories["cuda"] is gpu.decoder


@pytest.mark.gpu
def test_gpu_decode_matches_cpu() -> None:
    ok, reason = gpu.availability()
    if not ok:
        pytest.skip(f"GPU decode unavailable: {reason}")
    profile = codec.calibrate([_kv(1)])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for level in range(len(profile.levels)):
            blob = codec.encode(_kv(5).to(dtype), level, profile)
            cpu = codec.decode(blob, profile)
            cuda = codec.decode(blob, profile, device="cuda").cpu()
            tolerance = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype]
            torch.testing.assert_close(cuda.float(), cpu.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
def test_gpu_decodes_raw_sections_exactly() -> None:
    """A layer far from the calibration is stored raw (FORMAT.md): copied, bit for bit."""
    ok, reason = gpu.availability()
    if not ok:
        pytest.skip(f"GPU decode unavailable: {reason}")
    profile = codec.calibrate([_kv(1)])
    kv = _kv(6)
    kv[1] = kv[1].cumsum(dim=1) * 100   # layer 1 drifts: its lanes would outgrow it
    kv = kv.half()
    blob = codec.encode(kv, 0, profile)
    assert codec.inspect(blob)["sections"]["raw_layers"] == [1]
    cuda = codec.decode(blob, profile, device="cuda").cpu()
    assert torch.equal(cuda[1], kv[1])
    torch.testing.assert_close(cuda.float(), codec.decode(blob, profile).float(), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ host-side pipeline logic
def test_pipeline_submits_ahead_and_keeps_order() -> None:
    from kernels.pipeline import pipelined

    log: list[tuple[str, int]] = []

    def submit(i: int) -> int:
        log.append(("submit", i))
        return i

    def finish(i: int) -> int:
        log.append(("finish", i))
        return i * 10

    assert list(pipelined(range(5), submit, finish, depth=2)) == [0, 10, 20, 30, 40]
    # item i+1 is submitted (its upload queued) before item i is waited for
    for i in range(4):
        assert log.index(("submit", i + 1)) < log.index(("finish", i))
    # never more than `depth` submitted and unfinished
    outstanding = 0
    for kind, _ in log:
        outstanding += 1 if kind == "submit" else -1
        assert outstanding <= 2


def test_pipeline_stops_at_the_first_failure_in_order() -> None:
    from kernels.pipeline import pipelined

    def finish(i: int) -> int:
        if i == 2:
            raise codec.CorruptBitstream("layer 2")
        return i

    results = []
    with pytest.raises(codec.CorruptBitstream, match="layer 2"):
        for value in pipelined(range(5), lambda i: i, finish, depth=3):
            results.append(value)
    assert results == [0, 1]
    with pytest.raises(ValueError, match="depth"):
        list(pipelined(range(3), lambda i: i, lambda i: i, depth=0))
