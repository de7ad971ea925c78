"""``kvwire bench adversarial``: blob sizes on data unlike any calibration, and what
hostile blobs and profiles cost to reject.

Sizes: KV drawn from distributions far from real KV (a drifting random walk, Cauchy
heavy tails, huge values, a constant tensor) is encoded at every level, with a
profile calibrated on ordinary synthetic KV and with an embedded one; each blob is
reported against the input's fp16 size and its own header (FORMAT.md promises
``blob <= fp16 bytes + header`` for 16-bit inputs, thanks to raw sections).

Hostile inputs: hand-made from codec/FORMAT.md (a header claiming 2^21 tokens over
a few bytes of lanes, zstd bombs as embedded profiles, a profile whose kept rows
exceed its channels, impossible shapes), and hostile HTTP requests to the receiver
daemon (``streamer.tools.adversarial_http``: oversized request line and headers, a
huge Content-Length, chunked and gzip bodies past the limit, JSON too deep, invalid
UTF-8 in the path, slowloris, a flood of connections past the cap, a flood of
malformed requests), and hostile continuations of the wire protocol
(``streamer.tools.adversarial_wire``: a first layer out of range or on a text request
or a version 1 connection, sent to a sender; a sender's answer to a continuation that
does not repeat its first layer, claims more than the whole blob, or whose header does
not add up). Each runs in a fresh subprocess, after the codec's kernels (and the
daemon or sender) are warm, and reports the error, the seconds and the growth of peak
RSS while it was rejected (and whether the daemon or sender still answers).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from streamer.tools import adversarial_http, adversarial_wire

KINDS = ("random_walk", "cauchy", "huge", "constant")


# ------------------------------------------------------------------------ adversarial KV
def adversarial_kv(kind: str, layers: int = 4, tokens: int = 256, heads: int = 4, head_dim: int = 32,
                   seed: int = 0) -> torch.Tensor:
    """fp16 KV [layers, 2, tokens, heads, head_dim] of one hostile distribution."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, 2, tokens, heads, head_dim)
    if kind == "random_walk":   # drifts: every token moves away from the calibrated mean
        kv = torch.randn(shape, generator=gen).cumsum(dim=2)
    elif kind == "cauchy":      # heavy tails: most values small, a few enormous
        kv = torch.tan(torch.pi * (torch.rand(shape, generator=gen) - 0.5)).clamp(-6e4, 6e4)
    elif kind == "huge":        # the right shape of data at 1000x the scale
        kv = 1000.0 * torch.randn(shape, generator=gen)
    elif kind == "constant":
        kv = torch.full(shape, 3.25)
    else:
        raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)}")
    return kv.to(torch.float16)


def size_rows(layers: int = 4, tokens: int = 256, heads: int = 4, head_dim: int = 32) -> list[dict]:
    """One row per (kind, profile, level): blob bytes against fp16 bytes and the header.
    The profiles: a plain one, one predicting every layer but the first from the one
    before with low-rank maps (what ``kvwire calibrate`` fits for a causal LM), and none
    (the blob's embedded one)."""
    import codec
    from codec.synthetic import chained_kv, synthetic_kv

    profile = codec.calibrate([synthetic_kv(layers, heads, head_dim, 512, seed=1)])
    predicting = codec.calibrate([chained_kv(layers, heads, head_dim, 512, seed=1)], predict=layers,
                                 predict_groups="low-rank")
    rows = []
    for kind in KINDS:
        kv = adversarial_kv(kind, layers, tokens, heads, head_dim)
        fp16 = kv.numel() * 2
        for name, prof in (("calibrated", profile), ("predicted", predicting), ("embedded", None)):
            for level in [*range(len(codec.DEFAULT_TARGETS)), *(["exact"] if prof is not None else [])]:
                blob = codec.encode_exact(kv, prof) if level == "exact" else codec.encode(kv, level, prof)
                info = codec.inspect(blob)
                header = info["sections"]["header"] + info["sections"]["embedded_profile"]
                rows.append({"kind": kind, "profile": name, "level": level, "blob_bytes": len(blob),
                             "fp16_bytes": fp16, "header_bytes": header,
                             "ratio_fp16": round(len(blob) / fp16, 4),
                             "over_bound": len(blob) > fp16 * 1.01 + header,
                             "raw_layers": len(info["sections"].get("raw_layers", []))})
    return rows


# ------------------------------------------------------------------------ hostile inputs
FIXED = struct.Struct("<4sBBBBHHHHI8sI")   # FORMAT.md, "Fixed header"
ENTRY = struct.Struct("<IIB")              # FORMAT.md: (length, crc32, mode) per section
START = struct.Struct("<I")                # FORMAT.md: version 3's start position, after the fixed header
#: FORMAT.md, version 5: n_lanes, piece, rows_per_lane, the section's K and V steps and kept rows
LANE_HEAD = struct.Struct("<IHHffHH")
FORMAT_VERSION = 5


def table_offset(version: int) -> int:
    """Where a blob's section table starts (FORMAT.md): after the fixed header, and from
    version 3 after the start position too."""
    return FIXED.size + (START.size if version >= 3 else 0)


def hand_blob(*, tokens: int, heads: int, head_dim: int, sections: list[bytes], profile_id: str,
              modes: list[int] | None = None, dtype: int = 1, level: int = 0, sinks: int = 0,
              embedded: bytes = b"", version: int = FORMAT_VERSION, start: int = 0) -> bytes:
    """A blob assembled by hand from FORMAT.md (valid CRCs, whatever the fields say)."""
    fixed = FIXED.pack(b"KVWB", version, dtype, level, 1 if embedded else 0, len(sections), heads, head_dim,
                       sinks, tokens, bytes.fromhex(profile_id), len(embedded))
    if version >= 3:
        fixed += START.pack(start)
    return seal(fixed, sections, modes or [0] * len(sections), embedded)


def seal(fixed: bytes, sections: list[bytes], modes: list[int], embedded: bytes = b"") -> bytes:
    """The fixed-header bytes as given (32, then version 3's start), then the section table (lengths and CRCs of
    ``sections``), ``embedded``, the header CRC and the sections (FORMAT.md)."""
    body = fixed + b"".join(ENTRY.pack(len(s), zlib.crc32(s), m) for s, m in zip(sections, modes)) + embedded
    return body + struct.pack("<I", zlib.crc32(body)) + b"".join(sections)


def lane_payload(lanes: int, words: int, piece: int = 0, rows_per_lane: int = 1, *,
                 kept: tuple[int, int] = (1, 1), steps: tuple[float, float] = (1.0, 1.0)) -> bytes:
    """A version 5 lane section (no sinks) of ``lanes`` lanes of the given shape, kept rows
    and steps (FORMAT.md, "Rows and lanes"), the last lane holding ``words`` zero words
    (< 2^16), the others none."""
    counts = [0] * (lanes - 1) + [words]
    return (LANE_HEAD.pack(lanes, piece, rows_per_lane, *steps, *kept)
            + struct.pack(f"<{lanes}I", *([1 << 16] * lanes))
            + struct.pack(f"<{lanes}H", *counts) + bytes(2 * words))


def _small_profile():
    import codec

    gen = torch.Generator().manual_seed(0)
    return codec.calibrate([torch.randn(1, 2, 64, 1, 2, generator=gen)], sink_tokens=0)


#: FORMAT.md: the longest piece a lane may hold, a multiple of the usual delta group (10)
_LONGEST_PIECE = 16380


def _many_tokens():
    """FORMAT.md: 2^21 tokens are cut into pieces of at most 16383 tokens, 129 per kept
    row (one lane each); 8 words in all."""
    profile = _small_profile()
    kept = (int(profile.kept[0, 0, 0]), int(profile.kept[0, 0, 1]))
    lanes = sum(kept) * -(-(1 << 21) // _LONGEST_PIECE)
    payload = lane_payload(lanes, 8, _LONGEST_PIECE, kept=kept, steps=tuple(map(float, profile.steps[0, 0])))
    blob = hand_blob(tokens=1 << 21, heads=1, head_dim=2, sections=[payload], profile_id=profile.id, dtype=3)
    return blob, profile


def _gigabyte_claim():
    """An ~11 KB coded section whose header claims 2^14 tokens x 2^14 channels of float32:
    2 GiB of K and V, over 1 GiB per K or V (FORMAT.md, "Limits": output per byte)."""
    blob = hand_blob(tokens=1 << 14, heads=128, head_dim=128, sections=[lane_payload(4, 5_400)],
                     profile_id="00" * 8, dtype=3)
    return blob, None


def _rotary_many_tokens():
    """As ``_many_tokens`` with a RoPE profile, at position 2^30: a decoder that built its
    angle tables before checking the output would make 2^21 x 2 floats of them."""
    import codec

    gen = torch.Generator().manual_seed(0)
    profile = codec.calibrate([torch.randn(1, 2, 64, 1, 2, generator=gen)], sink_tokens=0,
                              rotary=codec.Rotary(head_dim=2, dim=2, theta=10_000.0))
    kept = (int(profile.kept[0, 0, 0]), int(profile.kept[0, 0, 1]))
    lanes = sum(kept) * -(-(1 << 21) // _LONGEST_PIECE)
    payload = lane_payload(lanes, 8, _LONGEST_PIECE, kept=kept, steps=tuple(map(float, profile.steps[0, 0])))
    blob = hand_blob(tokens=1 << 21, heads=1, head_dim=2, sections=[payload], profile_id=profile.id, dtype=3,
                     start=1 << 30)
    return blob, profile


def _profile_claiming_a_gigabyte() -> bytes:
    """A 16 KB profile file whose safetensors header gives its basis 1 GiB of float32
    (2 x 16384 x 8192), the data not there."""
    header = json.dumps({"basis": {"dtype": "F32", "shape": [1, 2, 16384, 8192], "data_offsets": [0, 1 << 30]}})
    header_bytes = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + bytes(16 * 1024)


def _embedded_bomb(declare_size: bool):
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=declare_size).compress(bytes(64 << 20))
    blob = hand_blob(tokens=8, heads=1, head_dim=2, sections=[lane_payload(2, 0)], profile_id="00" * 8,
                     embedded=frame)
    return blob, None


def _exact_level_coded_section():
    """A blob at the exact level (FORMAT.md: every section raw) whose one section is coded:
    a decoder that took the level on trust would decode lanes no profile level describes."""
    blob = hand_blob(tokens=8, heads=1, head_dim=2, sections=[lane_payload(2, 0)], profile_id=_small_profile().id,
                     level=255)
    return blob, _small_profile()


def _wide_channels():
    blob = hand_blob(tokens=1, heads=0xFFFF, head_dim=0xFFFF, sections=[lane_payload(1, 0)],
                     profile_id="00" * 8)
    return blob, None


def _profile_kept_past_channels() -> bytes:
    """A profile file whose basis has 8 rows past its channels, all kept (kept <= rows
    holds, rows <= channels does not)."""
    from safetensors.numpy import save

    p = _small_profile()
    channels = p.channels
    basis = np.zeros((p.layers, 2, channels + 8, channels), np.float32)
    basis[:, :, : p.basis.shape[2]] = p.basis
    arrays = {name: getattr(p, name) for name in ("mean", "steps", "delta_group", "shift", "table", "tables")}
    arrays.update(basis=basis, kept=np.full_like(p.kept, channels + 8),
                  metadata=np.frombuffer(p._metadata_json().encode(), dtype=np.uint8))
    return save(arrays)


def _decode(blob_and_profile) -> None:
    import codec

    blob, profile = blob_and_profile
    codec.decode(blob, profile)


def _parse_profile(data: bytes) -> None:
    import codec

    codec.Profile.from_bytes(data)


#: name -> (build the input, reject it); each is one hostile input of issue #15
HOSTILE: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {
    "blob_claiming_2^21_tokens": (_many_tokens, _decode),
    "blob_11kb_claiming_1gib": (_gigabyte_claim, _decode),
    "embedded_profile_zstd_bomb": (lambda: _embedded_bomb(True), _decode),
    "embedded_profile_unsized_zstd_bomb": (lambda: _embedded_bomb(False), _decode),
    "blob_with_65535x65535_channels": (_wide_channels, _decode),
    "exact_level_blob_with_a_coded_section": (_exact_level_coded_section, _decode),
    "profile_kept_past_channels": (_profile_kept_past_channels, _parse_profile),
    "rotary_blob_claiming_2^21_tokens_at_2^30": (_rotary_many_tokens, _decode),
    "profile_16kb_claiming_1gib_basis": (_profile_claiming_a_gigabyte, _parse_profile),
}


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark, VmHWM (Linux clear_refs 5), where allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss_kib() -> int:
    """VmHWM (the peak since the last reset), else the process's peak RSS since it began."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_one(name: str, store: str | None = None) -> dict:
    """Build and reject one hostile input here (meant for a fresh process); ``store``: the
    wire inputs' store, filled by ``adversarial_wire.prepare`` (None: filled here)."""
    import codec

    if name in adversarial_http.NAMES:
        return adversarial_http.run_one(name, _reset_peak_rss, _peak_rss_kib)
    if name in adversarial_wire.NAMES:
        if store is None:
            codec.warm_up()   # the put encodes here
        return adversarial_wire.run_one(name, _reset_peak_rss, _peak_rss_kib, store)
    codec.warm_up()
    build, reject = HOSTILE[name]
    data = build()
    _reset_peak_rss()
    before = _peak_rss_kib()
    start = time.perf_counter()
    try:
        reject(data)
        error = None
    except Exception as exc:  # reported, not judged here: the tests judge the type
        error = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    after = _peak_rss_kib()
    return {"input": name, "error": error, "seconds": round(seconds, 4),
            "peak_rss_growth_mb": round((after - before) / 1024, 1)}


def hostile_rows(names: tuple[str, ...] = tuple(HOSTILE), store: str | None = None) -> list[dict]:
    """Hostile inputs (default: the codec's), each in its own subprocess (``store``: see
    ``run_one``)."""
    rows = []
    for name in names:
        done = subprocess.run([sys.executable, "-m", "streamer.tools.adversarial", "--one", name]
                              + (["--store", store] if store is not None else []),
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            rows.append({"input": name, "error": f"process exited {done.returncode}: {done.stderr[-400:]}",
                         "seconds": None, "peak_rss_growth_mb": None})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def wire_rows() -> list[dict]:
    """The wire protocol's hostile inputs, each in its own subprocess, all served from one
    store filled here first (a child then only starts a sender)."""
    import codec

    codec.warm_up()
    with tempfile.TemporaryDirectory(prefix="kvwire-hostile-wire-") as root:
        asyncio.run(adversarial_wire.prepare(root))
        return hostile_rows(adversarial_wire.NAMES, root)


# ------------------------------------------------------------------------ CLI
def _handler(args: argparse.Namespace) -> int:
    report = {}
    if args.what in ("sizes", "all"):
        report["sizes"] = size_rows(tokens=args.tokens)
    if args.what in ("hostile", "all"):
        report["hostile"] = hostile_rows()
    if args.what in ("http", "all"):
        report["http"] = hostile_rows(adversarial_http.NAMES)
    if args.what in ("wire", "all"):
        report["wire"] = wire_rows()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for row in report.get("sizes", []):
        print(f"{row['kind']:12s} {row['profile']:10s} L{row['level']}  {row['blob_bytes']:8d} B  "
              f"{row['ratio_fp16']:.3f}x fp16  header {row['header_bytes']:6d} B  raw layers {row['raw_layers']}"
              + ("  OVER BOUND" if row["over_bound"] else ""))
    for row in report.get("hostile", []) + report.get("http", []) + report.get("wire", []):
        up = "" if "daemon_up" not in row else "  daemon up" if row["daemon_up"] else "  DAEMON DOWN"
        print(f"{row['input']:38s} {row['seconds']} s  peak RSS +{row['peak_rss_growth_mb']} MB{up}  {row['error']}")
    return 0


def register(bench_subparsers) -> None:
    bench = bench_subparsers.add_parser("adversarial", help="blob sizes on hostile data; cost of hostile blobs, "
                                                             "HTTP requests and continuations",
                                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("what", nargs="?", choices=("sizes", "hostile", "http", "wire", "all"), default="all",
                       help="blob sizes, the codec's hostile inputs, hostile HTTP requests, hostile "
                            "continuations of the wire protocol, or all")
    bench.add_argument("--tokens", type=int, default=256, help="tokens per adversarial tensor (default 256)")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.set_defaults(handler=_handler)


if __name__ == "__main__":  # the per-input subprocess of hostile_rows
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", required=True,
                        choices=sorted(HOSTILE) + list(adversarial_http.NAMES) + list(adversarial_wire.NAMES))
    parser.add_argument("--store", help="the wire inputs' store, filled by adversarial_wire.prepare")
    arguments = parser.parse_args()
    print(json.dumps(run_one(arguments.one, arguments.store)))
