"""CUDA decode kernels: compile in CI without a GPU, and check their logic bit for bit.

Without a GPU the kernel is still exercised: it is compiled as plain C++ through
kernels/kvwire_kernels/host_shim.h and run lane by lane, and its coefficients must equal the
numba decoder's exactly (same bytes in, same floats out). The GPU tests proper
skip with the reason when pycuda or a device is missing.
"""
from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec.synthetic import chained_kv
from codec import container, layer_codec, rans
from kvwire_kernels import gpu

from agreement import assert_decoders_agree

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
    return ctypes.CDLL(str(lib)).host_rans_decode_group


def _ptr(array: np.ndarray) -> ctypes.c_void_p:
    return array.ctypes.data_as(ctypes.c_void_p)


def _host_launch(fn, profile, coded_tokens, sections):
    """One launch of the host-compiled kernel over a group of (layer, lanes), packed as
    kvwire_kernels.gpu packs them: each section's [tokens, rows] coefficients and lane statuses."""
    from kvwire_kernels import packing

    buffer = np.full(packing.group_size(sections) + 64, 0xEE, dtype=np.uint8)
    group = packing.pack(sections, buffer, coded_tokens)
    tables = layer_codec.coder_tables(profile)
    out = np.full(group.out_floats, np.nan, dtype=np.float32)
    status = np.full(group.lanes, -1, dtype=np.int32)
    fn(_ptr(buffer), _ptr(buffer), ctypes.c_int(len(sections)), ctypes.c_int(group.lanes),
       *[_ptr(a) for a in (tables.freq, tables.cdf, tables.lut)], ctypes.c_int(coded_tokens), _ptr(out), _ptr(status))
    return [(l.coefficients(out), l.statuses(status)) for l in group.layers]


def _host_decode(fn, profile, slot, layer, coded_tokens, payload, version=container.FORMAT_VERSION):
    """One section through the host-compiled kernel, alone in its launch."""
    lanes = layer_codec.parse_lanes(profile, slot, layer, coded_tokens, payload, version)
    return _host_launch(fn, profile, coded_tokens, [(layer, lanes)])[0]


def _layer_payloads(blob: bytes):
    """(header, layer, lane payload) of every coded section (a raw one never reaches the kernel)."""
    header = codec.parse_header(blob)
    for layer in range(header.layers):
        if not header.is_raw(layer):
            yield header, layer, container.section(blob, header, layer)[header.sink_size:]


def _assert_kernel_matches(fn, profile, level, blob) -> list[int]:
    """Every coded layer of ``blob`` through the host-compiled kernel, all in one launch
    (one group), and through the numba decoder: the same floats, every lane OK; the lane
    shapes seen as (rows_per_lane, pieces)."""
    coded = [(header, layer, layer_codec.parse_lanes(profile, level, layer, header.coded_tokens, payload,
                                                     header.version)) for header, layer, payload in _layer_payloads(blob)]
    if not coded:
        return []
    tokens = coded[0][0].coded_tokens
    got = _host_launch(fn, profile, tokens, [(layer, lanes) for _, layer, lanes in coded])
    shapes = []
    for (_, layer, lanes), (coef, status) in zip(coded, got):
        assert (status == rans.OK).all()
        np.testing.assert_array_equal(coef, layer_codec.decode_coefficients(profile, layer, lanes, tokens))
        shapes.append((lanes.plan.rows_per_lane, lanes.plan.pieces))
    return shapes


def _kv(seed: int, tokens: int = 120) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(12, 12, generator=torch.Generator().manual_seed(7))
    return (torch.randn(2, 2, tokens, 12, generator=gen) @ mix).reshape(2, 2, tokens, 3, 4)


@pytest.mark.parametrize("delta", ["never", "always"])
def test_host_compiled_kernel_matches_cpu_decoder_bit_for_bit(host_kernel, delta: str) -> None:
    profile = codec.calibrate([_kv(1)], delta=delta)
    kv = _kv(2)
    kv[0, 1, 50] *= 400.0  # far outside the calibrated range: escapes
    shapes = []
    for level in range(len(profile.levels)):
        shapes += _assert_kernel_matches(host_kernel, profile, level, codec.encode(kv, level, profile))
    assert any(g > 1 for g, _ in shapes)  # lanes of several whole rows


@pytest.mark.parametrize("delta", ["never", "always"])
@pytest.mark.parametrize("tokens", [1, 7, 1237])
def test_host_compiled_kernel_decodes_pieces_and_odd_shapes(host_kernel, delta: str, tokens: int) -> None:
    """Rows cut into pieces (a last piece shorter than the rest), odd head shapes, every level."""
    gen = torch.Generator().manual_seed(11)
    profile = codec.calibrate([torch.randn(2, 2, 300, 3, 5, generator=gen)], delta=delta)
    kv = torch.randn(2, 2, tokens + 4, 3, 5, generator=gen)
    kv[1, 0, -1] *= 300.0  # escapes
    shapes = []
    for level in range(len(profile.levels)):
        # one coded token of 15 huge values can cost more than raw (20 bytes of lane head)
        shapes += _assert_kernel_matches(host_kernel, profile, level, codec.encode(kv, level, profile))
    assert shapes
    if tokens == 1237:  # a prime: no piece length divides it
        assert any(pieces > 1 for _, pieces in shapes)
        pieces = [layer_codec.parse_lanes(profile, 0, 0, tokens, p, container.FORMAT_VERSION).plan
                  for _, _, p in _layer_payloads(codec.encode(kv, 0, profile))]
        assert all(tokens % plan.piece_tokens for plan in pieces if plan.pieces > 1)  # a short last piece
        if delta == "always":
            assert all(plan.piece_tokens % 10 == 0 for plan in pieces)


def test_host_compiled_kernel_reads_version_3_lanes(host_kernel) -> None:
    """The committed version 3 golden blob: whole-row lanes of G = ceil(4096 / N) rows."""
    data = Path(__file__).parent / "data"
    profile = codec.Profile.load(data / "golden_profile.safetensors")
    blob = (data / "golden_blob_v3.bin").read_bytes()
    assert codec.parse_header(blob).version == 3
    assert {g for g, _ in _assert_kernel_matches(host_kernel, profile, codec.parse_header(blob).level, blob)} == {14}


def test_host_compiled_kernel_reads_version_4_and_controlled_version_5_lanes(host_kernel) -> None:
    """The committed version 4 golden blob (the profile's steps), and version 5 sections
    whose steps the encoder moved far from the profile's (a chunk 10x louder than the
    calibration): the kernel takes each row's step from parse_lanes, bit for bit."""
    data = Path(__file__).parent / "data"
    profile = codec.Profile.load(data / "golden_profile.safetensors")
    blob = (data / "golden_blob_v4.bin").read_bytes()
    assert codec.parse_header(blob).version == 4
    assert _assert_kernel_matches(host_kernel, profile, codec.parse_header(blob).level, blob)
    profile = codec.calibrate([_kv(1)])
    kv = _kv(2)
    mean = kv.mean(dim=2, keepdim=True)
    blob = codec.encode(mean + 10.0 * (kv - mean), 2, profile)
    header, layer, payload = next(_layer_payloads(blob))
    steps = layer_codec.parse_lanes(profile, 2, layer, header.coded_tokens, payload, header.version).plan.steps
    assert steps[0] > 4 * float(profile.steps[2, layer, 0])
    assert _assert_kernel_matches(host_kernel, profile, 2, blob)


def test_host_compiled_kernel_flags_corrupt_lanes(host_kernel) -> None:
    profile = codec.calibrate([_kv(1)])
    blob = codec.encode(_kv(3), 1, profile)
    header, layer, payload = next(_layer_payloads(blob))
    damaged = bytearray(payload)
    damaged[-7] ^= 0x5A  # inside the last lane's words
    _, status = _host_decode(host_kernel, profile, 1, layer, header.coded_tokens, memoryview(bytes(damaged)))
    lanes = layer_codec.parse_lanes(profile, 1, layer, header.coded_tokens, memoryview(bytes(damaged)),
                                    header.version)
    with pytest.raises(codec.CorruptBitstream):
        layer_codec.decode_coefficients(profile, layer, lanes, header.coded_tokens)
    assert (status != rans.OK).any()
    # a damaged final state: only that lane is flagged
    good = layer_codec.parse_lanes(profile, 1, layer, header.coded_tokens, payload, header.version)
    assert good.plan.lanes > 1
    forged = bytearray(payload)
    struct.pack_into("<I", forged, layer_codec.LANE_HEAD.size + 4, 0xFFFF)  # lane 1's state < 2^16
    _, status = _host_decode(host_kernel, profile, 1, layer, header.coded_tokens, memoryview(bytes(forged)))
    assert list(np.flatnonzero(status != rans.OK)) == [1]


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
    assert "GpuUnavailable:" in out.stdout and "import kvwire_kernels" in out.stdout


def test_importing_kernels_registers_the_cuda_decoder() -> None:
    import kvwire_kernels  # noqa: F401

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
            assert_decoders_agree(codec.decode(blob, profile, device="cuda").cpu(), cpu, profile)


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
    assert_decoders_agree(cuda, codec.decode(blob, profile), profile)


# ------------------------------------------------------------------ the GPU adapter's host side
def test_device_strings_name_a_cuda_device() -> None:
    from kvwire_kernels import devices

    assert devices.device_index("cuda") == 0
    assert devices.device_index("cuda:1") == 1
    assert devices.device_index(torch.device("cuda", 3)) == 3
    for bad in ("cpu", "meta", "cuda:x", "gpu:0", ""):
        with pytest.raises(ValueError):
            devices.device_index(bad)


def test_missing_gpu_is_a_typed_error_naming_what_is_missing() -> None:
    from kvwire_kernels import devices

    ok, reason = devices.availability()
    if ok:
        pytest.skip("a GPU is available here")
    with pytest.raises(codec.GpuUnavailable, match=r"device='cuda:1' needs GPU decode: .+"):
        devices.require("cuda:1")
    with pytest.raises(codec.GpuUnavailable, match="needs GPU decode"):
        gpu.decoder("cuda:1")
    with pytest.raises(ValueError):
        gpu.decoder("cpu")


def test_one_launch_decodes_a_group_and_flags_only_the_corrupt_sections_lanes(host_kernel) -> None:
    """The adapter's one upload and one launch per group: every layer's lane arrays and
    the section table packed into one buffer (kvwire_kernels.packing), one grid over all the
    group's lanes; a lane damaged in one section is flagged in that section alone."""
    from kvwire_kernels import packing

    profile = codec.calibrate([_kv(1)], delta="always")
    blob = codec.encode(_kv(2), 1, profile)
    header = codec.parse_header(blob)
    payloads = {layer: payload for _, layer, payload in _layer_payloads(blob)}
    group = [(layer, layer_codec.parse_lanes(profile, 1, layer, header.coded_tokens, p, header.version))
             for layer, p in payloads.items()]
    assert len(group) == 2
    buffer = np.zeros(packing.group_size(group), dtype=np.uint8)
    packed = packing.pack(group, buffer, header.coded_tokens)
    assert packed.used == buffer.size and packed.lanes == sum(lanes.plan.lanes for _, lanes in group)
    assert all(o % packing.ALIGN == 0 for l in packed.layers for o in l.offsets.values())
    table = packing.table(buffer, packed)
    assert list(table["first_lane"]) == [0, group[0][1].plan.lanes] and list(table["out"]) == [l.out for l in packed.layers]
    back = packing.view(buffer, packed.layers[1], group[1][1])
    np.testing.assert_array_equal(back["words"], group[1][1].words)
    got = _host_launch(host_kernel, profile, header.coded_tokens, group)
    for (layer, lanes), (coef, status) in zip(group, got):
        assert (status == rans.OK).all()
        np.testing.assert_array_equal(coef, layer_codec.decode_coefficients(profile, layer, lanes, header.coded_tokens))
    damaged = bytearray(payloads[1])
    damaged[-7] ^= 0x5A   # inside layer 1's last lane's words
    group[1] = (1, layer_codec.parse_lanes(profile, 1, 1, header.coded_tokens, memoryview(bytes(damaged)),
                                          header.version))
    (coef0, status0), (_, status1) = _host_launch(host_kernel, profile, header.coded_tokens, group)
    assert (status0 == rans.OK).all() and (status1 != rans.OK).any()
    np.testing.assert_array_equal(coef0, layer_codec.decode_coefficients(profile, 0, group[0][1], header.coded_tokens))


def test_a_group_past_the_kernels_32_bit_offsets_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwire_kernels import packing

    profile = codec.calibrate([_kv(1)])
    blob = codec.encode(_kv(2), 1, profile)
    header = codec.parse_header(blob)
    group = [(layer, layer_codec.parse_lanes(profile, 1, layer, header.coded_tokens, p, header.version))
             for _, layer, p in _layer_payloads(blob)]
    buffer = np.zeros(packing.group_size(group), dtype=np.uint8)
    monkeypatch.setattr(packing, "LIMIT", packing.group_size(group) - 1)
    with pytest.raises(ValueError, match="too large for one launch"):
        packing.pack(group, buffer, header.coded_tokens)
    monkeypatch.setattr(packing, "LIMIT", int(group[0][1].lane_start[-1]))
    with pytest.raises(ValueError, match="32-bit word offsets"):
        packing.group_size(group)


@pytest.mark.gpu
def test_gpu_decode_into_caller_tensors_overlapped() -> None:
    """Several groups through two buffers: the caller's tensors filled, layers in order."""
    ok, reason = gpu.availability()
    if not ok:
        pytest.skip(f"GPU decode unavailable: {reason}")
    profile = codec.calibrate([_kv(1)])
    blob = codec.encode(_kv(5).half(), 1, profile)
    header = codec.parse_header(blob)
    kv = torch.empty(header.shape, dtype=header.dtype, device="cuda")
    decoder = gpu.GpuDecoder("cuda:0", group_layers=1)
    try:
        sections = ((l, container.section(blob, header, l)) for l in range(header.layers))
        got = [layer for layer, _, _ in decoder.decode_into(header, profile, sections,
                                                              outs={l: kv[l] for l in range(header.layers)})]
        assert got == list(range(header.layers))
        assert_decoders_agree(kv.cpu(), codec.decode(blob, profile), profile)
    finally:
        decoder.close()


class _FakeCuda:
    """PyCUDA's few calls the adapter makes, on the host: events fire at once, a copy is a memmove."""

    class Event:
        recorded = False

        def record(self, stream) -> None:
            self.recorded = True

        def synchronize(self) -> None:
            assert self.recorded

        def query(self) -> bool:
            return self.recorded

    class Stream:
        def wait_for_event(self, event) -> None:
            assert event.recorded   # never waits on an event not yet recorded

        def synchronize(self) -> None:
            pass

    @staticmethod
    def pagelocked_empty(size: int, dtype) -> np.ndarray:
        return np.empty(size, dtype)

    @staticmethod
    def memcpy_htod_async(dest: int, src: np.ndarray, stream) -> None:
        ctypes.memmove(dest, src.ctypes.data, src.nbytes)


class _HostDecoder:
    """gpu.GpuDecoder's own decode code on the host: CPU tensors for device memory, the
    host-compiled kernel for the CUDA one (same pointer arguments), fake streams and events."""

    launch_group = gpu.GpuDecoder.launch_group
    coder_tables = gpu.GpuDecoder.coder_tables
    decode_into = gpu.GpuDecoder.decode_into
    decode_layers = gpu.GpuDecoder.decode_layers
    decode_section = gpu.GpuDecoder.decode_section
    scheduling = gpu.GpuDecoder.scheduling

    def __init__(self, kernel, group_layers: int) -> None:
        import contextlib
        import threading

        self.index, self.device, self.group_layers, self._buffer_count = 0, torch.device("cpu"), group_layers, 2
        self._cuda, self._coder, self._lock = _FakeCuda, gpu.coder_cache(), threading.Lock()
        self.copy_stream = self.decode_stream = _FakeCuda.Stream()
        self.current = self.decode_context = contextlib.nullcontext
        self.buffers = gpu.Buffers(self, 2)

        self.launches: list[int] = []   # the lanes of each launch

        def launch(*args, block, grid, stream) -> None:
            assert stream is self.decode_stream and block[0] * grid[0] >= int(args[3])
            self.launches.append(int(args[3]))
            kernel(*[ctypes.c_void_p(int(a)) if isinstance(a, np.uintp) else ctypes.c_int(int(a)) for a in args])
        self._kernel = launch


def _sections(blob: bytes):
    header = codec.parse_header(blob)
    return header, [(l, bytes(container.section(blob, header, l))) for l in range(header.layers)]


def test_the_decoder_forgets_a_profiles_tables_with_the_profile(host_kernel) -> None:
    """The device tables of a profile live as long as the profile: a receiver that sees
    many profiles over its life does not keep them all (the CPU side does the same)."""
    import gc

    decoder = _HostDecoder(host_kernel, group_layers=2)
    kv = torch.randn(2, 2, 64, 2, 8)
    profile = codec.calibrate([kv], sink_tokens=0)
    header, sections = _sections(codec.encode(kv.half(), 1, profile, sink_tokens=0))
    list(decoder.decode_into(header, profile, iter(sections)))
    assert len(decoder._coder) == 1
    del profile
    gc.collect()
    assert len(decoder._coder) == 0


def test_adapter_decodes_into_caller_tensors_through_the_host_kernel(host_kernel) -> None:
    """GpuDecoder.decode_into's commands carried out on the host: one packed upload and one
    kernel launch (over all its lanes) per group, the batched GEMM; equal to the CPU
    decoder as FORMAT.md allows (tests/agreement.py)."""
    profile = codec.calibrate([torch.cat([_kv(1, tokens=300), _kv(2, tokens=300)])])
    kv = torch.cat([_kv(5), _kv(6)]).half()            # 4 layers
    blob = codec.encode(kv, 1, profile)
    header, sections = _sections(blob)
    out = torch.empty(header.shape, dtype=header.dtype)
    decoder = _HostDecoder(host_kernel, group_layers=3)
    got = [l for l, _, _ in decoder.decode_into(header, profile, iter(sections), outs={l: out[l] for l in range(4)})]
    assert got == [0, 1, 2, 3]
    lanes = codec.inspect(blob)["sections"]["lanes"]
    assert decoder.launches == [sum(lanes[:3]), lanes[3]]   # one launch per group, over all its lanes
    want = codec.decode(blob, profile)
    assert_decoders_agree(out, want, profile)


def test_adapter_copies_raw_sections_and_sinks(host_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group with no coded layer (layer 0 stored raw) needs no upload; sinks verbatim."""
    profile = codec.calibrate([_kv(1, tokens=300)])
    encode_layer = layer_codec.encode_layer

    def raw_layer_0(profile, slot, layer, *args, **kwargs):
        if layer == 0:
            raise layer_codec.NotCodable("test")
        return encode_layer(profile, slot, layer, *args, **kwargs)

    monkeypatch.setattr(layer_codec, "encode_layer", raw_layer_0)
    kv = _kv(5).half()
    blob = codec.encode(kv, 1, profile, sink_tokens=4)
    header, sections = _sections(blob)
    assert header.is_raw(0) and not header.is_raw(1)
    decoder = _HostDecoder(host_kernel, group_layers=1)
    got = {l: torch.stack([k, v]) for l, k, v in decoder.decode_into(header, profile, iter(sections))}
    assert torch.equal(got[0], kv[0]) and torch.equal(got[1][:, :4], kv[1][:, :4])
    want = codec.decode(blob, profile)[1]
    assert_decoders_agree(got[1], want, profile)


@pytest.mark.parametrize("maps", ["all", "kind", "low-rank"])
def test_adapter_decodes_predicted_blobs_and_cuts_off_what_a_corrupt_layer_feeds(host_kernel, maps: str) -> None:
    """Format 6 through GpuDecoder's own code: groups of 4 layers, each group's batched
    GEMM then each layer's prediction in turn (the chain crosses groups; K-from-K maps by
    their blocks, low-rank maps through their factors), equal to the CPU decoder as
    FORMAT.md allows. A corrupt section in a stream
    decoder's chunk fails its layer and the layers predicted from it up to the next intra
    layer; that one decodes."""
    from kvwire_kernels.stream import StreamDecoder

    profile = codec.calibrate([chained_kv(6, 3, 4, 400, seed) for seed in (1, 2)], predict=3, predict_groups=maps)
    blob = codec.encode(chained_kv(6, 3, 4, 120, 3).half(), 1, profile)
    header, sections = _sections(blob)
    want = codec.decode(blob, profile)
    decoder = _HostDecoder(host_kernel, group_layers=4)
    got = {l: torch.stack([k, v]) for l, k, v in decoder.decode_into(header, profile, iter(sections))}
    assert sorted(got) == list(range(6))
    for l in got:
        assert_decoders_agree(got[l], want[l], profile)
    with pytest.raises(ValueError, match="decode them in order from layer 3"):
        decoder.decode_section(header, profile, 4, sections[4][1])
    k, v = decoder.decode_section(header, profile, 3, sections[3][1])   # intra: alone
    assert_decoders_agree(torch.stack([k, v]), want[3], profile)

    stream = StreamDecoder(_HostDecoder(host_kernel, group_layers=2), idle_seconds=0.01)
    try:
        futures = []
        for layer, section in sections:
            if layer == 1:
                section = bytes(section[:-1]) + bytes([section[-1] ^ 1])
            futures.append(stream.submit(header, profile, layer, section))
        for layer, future in enumerate(futures):
            if layer in (1, 2):
                with pytest.raises(codec.CorruptBitstream, match=f"layer {layer}"):
                    future.result(timeout=60)
            else:
                assert_decoders_agree(torch.stack(future.result(timeout=60)), want[layer], profile)
    finally:
        stream.close()


def test_device_decode_computes_each_sections_crc_once(host_kernel, monkeypatch: pytest.MonkeyPatch,
                                                      crc_calls) -> None:
    """codec.decode_layers(device="cuda") (and codec.decode's device path: both go through
    codec.api._device_layers) with the host decoder registered for "cuda": every
    section's CRC is computed exactly once, by the decoder's Verify, and a corrupt or
    truncated section is still refused."""
    profile = codec.calibrate([torch.cat([_kv(1, tokens=300), _kv(2, tokens=300)])])
    blob = codec.encode(torch.cat([_kv(5), _kv(6)]).half(), 1, profile)
    header = codec.parse_header(blob)
    want = codec.decode(blob, profile)
    decoder = _HostDecoder(host_kernel, group_layers=3)
    monkeypatch.setitem(codec.backends._factories, "cuda", lambda device: decoder)
    crc_calls.clear()
    got = {l: torch.stack([k, v]) for l, k, v in codec.decode_layers(blob, profile, device="cuda")}
    at = header.offsets
    assert [crc_calls[bytes(blob[at[l]:at[l + 1]])] for l in range(header.layers)] == [1] * header.layers
    assert sorted(got) == list(range(header.layers))
    for layer, kv in got.items():
        assert_decoders_agree(kv, want[layer], profile)
    damaged = bytearray(blob)
    damaged[at[2] + 9] ^= 0x10
    with pytest.raises(codec.CorruptBitstream, match="layer 2's section checksum"):
        list(codec.decode_layers(bytes(damaged), profile, device="cuda"))
    with pytest.raises(codec.CorruptBitstream, match="layer 3's section is"):
        list(codec.decode_layers(blob[:-1], profile, device="cuda"))


def test_stream_decoder_overlaps_chunks_and_reports_corrupt_sections(host_kernel) -> None:
    """kvwire_kernels.stream: sections of three chunks interleaved, one corrupt: every other
    layer's future gets its K and V, the corrupt one CorruptBitstream, and a resent copy
    of it (a refetch) decodes."""
    from kvwire_kernels.stream import StreamDecoder

    profile = codec.calibrate([torch.cat([_kv(1, tokens=300), _kv(2, tokens=300)])])
    blobs = [codec.encode(torch.cat([_kv(10 + i), _kv(20 + i)]).half(), 1, profile, sink_tokens=0)
             for i in range(3)]
    parsed = [_sections(b) for b in blobs]
    stream = StreamDecoder(_HostDecoder(host_kernel, group_layers=2), idle_seconds=0.01)
    try:
        futures = {}
        for layer in range(4):
            for chunk, (header, sections) in enumerate(parsed):
                section = sections[layer][1]
                if (chunk, layer) == (1, 2):
                    section = bytes(section[:-1]) + bytes([section[-1] ^ 1])
                futures[chunk, layer] = stream.submit(header, profile, layer, section)
        for (chunk, layer), future in futures.items():
            if (chunk, layer) == (1, 2):
                with pytest.raises(codec.CorruptBitstream, match="layer 2"):
                    future.result(timeout=60)
                continue
            k, v = future.result(timeout=60)
            want = codec.decode(blobs[chunk], profile)[layer]
            assert_decoders_agree(torch.stack([k, v]), want, profile)
        header, sections = parsed[1]
        k, v = stream.submit(header, profile, 2, sections[2][1]).result(timeout=60)
        assert (torch.stack([k, v]).float() - codec.decode(blobs[1], profile)[2].float()).abs().max() < 1e-2
    finally:
        stream.close()
    # the refetch was a one-layer chunk: every chunk completed, nothing is held
    assert stream._state.runs == {} and stream._state.scheduler.open_chunks == () and not stream._state.by_header


def test_stream_decoder_cancel_forgets_a_chunk_with_a_group_in_flight(host_kernel) -> None:
    """A chunk cancelled with one group decoded and a layer waiting for its group: that
    layer's future is cancelled, a section sent for it later too, the next chunk decodes
    through the same buffers, and the worker and its scheduler hold nothing."""
    from kvwire_kernels.stream import StreamDecoder

    profile = codec.calibrate([torch.cat([_kv(1, tokens=300), _kv(2, tokens=300)])])
    blobs = [codec.encode(torch.cat([_kv(30 + i), _kv(40 + i)]).half(), 1, profile, sink_tokens=0) for i in range(2)]
    (header, sections), (header1, sections1) = (_sections(b) for b in blobs)
    stream = StreamDecoder(_HostDecoder(host_kernel, group_layers=2), idle_seconds=600)   # no idle flush
    try:
        first = [stream.submit(header, profile, l, sections[l][1]) for l in range(3)]
        stream.cancel(header)
        late = stream.submit(header, profile, 3, sections[3][1])
        rest = [stream.submit(header1, profile, l, sections1[l][1]) for l in range(4)]
        want = codec.decode(blobs[1], profile)
        for layer, future in enumerate(rest):
            k, v = future.result(timeout=60)
            assert_decoders_agree(torch.stack([k, v]), want[layer], profile)
        assert [f.done() and not f.cancelled() for f in first[:2]] == [True, True]   # decoded before the cancel
        assert first[2].cancelled() and late.cancelled()
    finally:
        stream.close()
    assert stream._state.runs == {} and stream._state.scheduler.open_chunks == () and not stream._state.by_header


def test_one_registry_holds_one_decoder_and_one_stream_decoder_per_device(host_kernel,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """kvwire_kernels.devices' registry: gpu.decoder and stream.stream_decoder share it, so
    ``cuda`` and ``cuda:0`` get one decoder (one primary context) and one stream decoder
    on it, ``cuda:1`` device 1's; close_all stops each stream before its decoder and
    forgets them; a device that cannot be opened registers nothing."""
    from kvwire_kernels import devices, stream

    monkeypatch.setattr(devices, "_opened", {})
    built, closed = [], []

    def fake_decoder(device: torch.device) -> _HostDecoder:
        d = _HostDecoder(host_kernel, group_layers=2)
        d.index = device.index
        d.close = lambda: closed.append(("decoder", d.index))
        built.append(device.index)
        return d

    stream_close = stream.StreamDecoder.close

    def logged_close(self) -> None:
        closed.append(("stream", self.decoder.index))
        stream_close(self)

    monkeypatch.setattr(gpu, "GpuDecoder", fake_decoder)
    monkeypatch.setattr(stream.StreamDecoder, "close", logged_close)
    s0 = stream.stream_decoder("cuda")
    assert stream.stream_decoder("cuda:0") is s0 and gpu.decoder(torch.device("cuda", 0)) is s0.decoder
    s1 = stream.stream_decoder("cuda:1")
    assert s1.decoder.index == 1 and gpu.decoder("cuda:1") is s1.decoder and built == [0, 1]
    devices.close_all()
    assert closed == [("stream", 0), ("decoder", 0), ("stream", 1), ("decoder", 1)]
    assert not s0._thread.is_alive() and not s1._thread.is_alive()
    assert gpu.decoder("cuda") is not s0.decoder and built == [0, 1, 0]   # built anew after close_all
    devices.close_all()

    def unavailable(device: torch.device):
        raise codec.GpuUnavailable("no device here")

    monkeypatch.setattr(gpu, "GpuDecoder", unavailable)
    with pytest.raises(codec.GpuUnavailable, match="no device here"):
        stream.stream_decoder("cuda:2")
    with pytest.raises(ValueError):
        stream.stream_decoder("cpu")
    assert devices._opened == {}


# ------------------------------------------------------------------ occupancy (bench_gpu --dry-run)
def test_occupancy_arithmetic_on_an_h200() -> None:
    from kvwire_kernels import occupancy

    h200 = occupancy.H200
    light = occupancy.Resources(registers=32, shared_bytes=0)
    assert occupancy.resident_threads_per_sm(h200, light, 128) == 2048
    assert occupancy.resident_threads_per_sm(h200, occupancy.Resources(64, 0), 128) == 1024
    # 255 registers round up to 8192 per warp: 2 blocks of 4 warps
    assert occupancy.resident_threads_per_sm(h200, occupancy.Resources(255, 0), 128) == 256
    assert occupancy.resident_threads_per_sm(h200, occupancy.Resources(32, 100 << 10), 128) == 256
    few = occupancy.fill(h200, light, 128, lanes=640)       # issue #16: a version 3 layer
    assert few["threads_per_sm"] == 5 and few["fraction_of_device"] < 0.01
    full = occupancy.fill(h200, light, 128, lanes=132 * 2048 * 2)
    assert full["threads_per_sm"] == 2048 and full["fraction_of_device"] == 1.0 and full["waves"] == 2


def test_resource_usage_is_parsed_from_nvcc_output() -> None:
    from kvwire_kernels import occupancy

    text = ("ptxas info    : Compiling entry function 'rans_decode_group' for 'sm_90'\n"
            "ptxas info    : Function properties for rans_decode_group\n"
            "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
            "ptxas info    : Used 40 registers, used 0 barriers, 1024 bytes smem, 424 bytes cmem[0]\n")
    assert occupancy.parse_resource_usage(text) == occupancy.Resources(40, 1024, 8)
    assert occupancy.parse_resource_usage("ptxas info    : Used 32 registers, used 0 barriers") \
        == occupancy.Resources(32, 0)
    with pytest.raises(ValueError, match="no register count"):
        occupancy.parse_resource_usage("nvcc: error")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_lane_kernel_resources_leave_an_sm_full() -> None:
    """One thread per lane only pays if the kernel is light enough for 2048 threads per SM."""
    from kvwire_kernels import occupancy

    resources = occupancy.kernel_resources(KERNELS / "rans_decode.cu")
    assert 0 < resources.registers <= 32 and resources.shared_bytes == 0
    assert occupancy.resident_threads_per_sm(occupancy.H200, resources, gpu.THREADS_PER_BLOCK) == 2048


def test_dry_run_lane_rows_count_the_blobs_lanes() -> None:
    """bench_gpu --dry-run's lanes are inspect's, per level and chunk length."""
    from codec.synthetic import synthetic_kv
    from kvwire_kernels import bench_gpu

    profile = codec.calibrate([synthetic_kv(2, 2, 8, 200, seed=1)])
    rows = bench_gpu.lane_rows(profile, [64, 130], group_layers=1)
    assert [(r["tokens"], r["level"]) for r in rows] == [(n, l) for n in (64, 130) for l in range(5)]
    blob = codec.encode(synthetic_kv(2, 2, 8, 130, seed=2).half()[:, :, :64], 1, profile, sink_tokens=0)
    info = codec.inspect(blob)
    assert rows[1]["lanes"] == info["lanes"] > 0 and rows[1]["bytes"] == len(blob)
    assert rows[1]["launches"] == 2 and rows[1]["lanes_per_launch"] == min(info["sections"]["lanes"])
    whole = bench_gpu.lane_rows(profile, [64], group_layers=2)[1]   # both layers in one launch
    assert whole["launches"] == 1 and whole["lanes_per_launch"] == info["lanes"]
