"""GPU decode benchmark (run on a machine with an NVIDIA GPU and pycuda; < 5 minutes).

    python -m kernels.bench_gpu [--tokens 1536] [--chunks 4] [--json]
    python -m kernels.bench_gpu --dry-run [--tokens 512 1024 1536] [--json]

Prints, for Llama-3-8B-shaped chunks (32 layers, 8 KV heads, head dim 128):
decode throughput in GB/s of fp16 output per level; the copy/decode overlap ratio
(pipelined time over max(copy-only time, decode-only time)); CPU-vs-GPU equality.
Targets on an H200: >= 150 GB/s at the default level, overlap <= 1.1.

``--dry-run`` needs no GPU (nor pycuda): the lane kernel's registers and shared memory
from ``nvcc --resource-usage``, and per level and chunk length the blob's bytes, its
lanes (one thread each) and the threads per SM they would fill on an H200
(``kernels.occupancy``). The chunks are synthetic (``codec.synthetic``), the profile
calibrated on another draw, as in ``kvwire bench codec --workload llama``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import codec
from codec import container
from codec.synthetic import synthetic_kv
from kernels import gpu, occupancy

LLAMA = (32, 8, 128)


def _sections(blob: bytes):
    header = codec.parse_header(blob)
    return header, [bytes(container.section(blob, header, l)) for l in range(header.layers)]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _timings(decoder: gpu.GpuDecoder, profile, prepared, repeat: int) -> dict[str, float]:
    """Seconds for: uploads only; kernels + GEMMs only (inputs already on the device);
    the pipelined decode (uploads overlapping decodes), all over the same sections."""
    items = [(header, layer, section) for header, sections in prepared for layer, section in enumerate(sections)]
    staged = [decoder.stage(h, profile, l, s) for h, l, s in items]

    def pipeline() -> None:
        for header, sections in prepared:
            for _ in decoder.decode_layers(header, profile, enumerate(sections)):
                pass

    return {
        "copy_seconds": _best(lambda: [decoder.stage(h, profile, l, s) for h, l, s in items], repeat),
        "decode_seconds": _best(lambda: [decoder.finish(decoder.launch(st)) for st in staged], repeat),
        "pipeline_seconds": _best(pipeline, repeat),
    }


def lane_rows(profile: codec.Profile, tokens: list[int], seed: int = 2) -> list[dict]:
    """Per chunk length and level: blob bytes and lanes of one synthetic chunk of the
    profile's shape (no sink tokens: a context's later chunks have none)."""
    longest = synthetic_kv(profile.layers, profile.heads, profile.head_dim, max(tokens), seed=seed).half()
    rows = []
    for n in tokens:
        for level in range(len(profile.levels)):
            info = codec.inspect(codec.encode(longest[:, :, :n], level, profile, sink_tokens=0))
            rows.append({"tokens": n, "level": level, "bytes": info["total_bytes"], "lanes": info["lanes"],
                         "bits_per_element": round(info["bits_per_element"], 4)})
    return rows


def dry_run(tokens: list[int], calibration_tokens: int) -> dict:
    """Occupancy of the lane kernel on an H200 for Llama-shaped chunks, without a GPU."""
    try:
        resources = occupancy.kernel_resources(gpu.KERNEL_DIR / "rans_decode.cu")
    except RuntimeError as exc:
        raise SystemExit(f"--dry-run: {exc}") from exc
    profile = codec.calibrate([synthetic_kv(*LLAMA, calibration_tokens, seed=1)])
    rows = [{**row, **occupancy.fill(occupancy.H200, resources, gpu.THREADS_PER_BLOCK, row["lanes"])}
            for row in lane_rows(profile, tokens)]
    return {"device": occupancy.H200.name, "sms": occupancy.H200.sms,
            "threads_per_sm": occupancy.H200.threads_per_sm, "kernel": "rans_decode_lanes",
            "registers": resources.registers, "shared_bytes": resources.shared_bytes,
            "threads_per_block": gpu.THREADS_PER_BLOCK, "shape": list(LLAMA), "rows": rows}


def _print_dry_run(report: dict) -> None:
    print(f"{report['kernel']}: {report['registers']} registers/thread, {report['shared_bytes']} B shared/block, "
          f"{report['threads_per_block']} threads/block (nvcc --resource-usage, sm_90)")
    print(f"{report['device']}: {report['sms']} SMs x {report['threads_per_sm']} threads; "
          f"Llama-3-8B shape {tuple(report['shape'])}, one synthetic chunk, sinks 0")
    print("tokens level   bytes      bits/el  lanes   threads/SM (resident max)  device fill")
    for r in report["rows"]:
        print(f"{r['tokens']:6d} {r['level']:5d} {r['bytes']:10d} {r['bits_per_element']:8.3f} {r['lanes']:7d} "
              f"{r['threads_per_sm']:9d} ({r['resident_threads_per_sm']:4d})          {100 * r['fraction_of_device']:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="tokens per chunk (default 1536; --dry-run: 512 1024 1536)")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calibration-tokens", type=int, default=1536,
                        help="tokens of the synthetic draw the profile is fitted on (--dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: registers, lanes per chunk and H200 occupancy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.dry_run:
        report = dry_run(args.tokens or [512, 1024, 1536], args.calibration_tokens)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_dry_run(report)
        return
    args.tokens = (args.tokens or [1536])[0]
    ok, reason = gpu.availability()
    if not ok:
        raise SystemExit(f"GPU benchmark needs a GPU: {reason}")
    decoder = gpu.decoder("cuda")
    profile = codec.calibrate([synthetic_kv(*LLAMA, args.tokens, seed=1)])
    chunks = [synthetic_kv(*LLAMA, args.tokens, seed=10 + i).half() for i in range(args.chunks)]
    results = []
    for level in range(len(profile.levels)):
        blobs = [codec.encode(c, level, profile, sink_tokens=0) for c in chunks]
        prepared = [_sections(b) for b in blobs]
        _timings(decoder, profile, prepared[:1], 1)  # warm-up: kernel load, tables
        t = _timings(decoder, profile, prepared, args.repeat)
        out_bytes = sum(c.numel() * 2 for c in chunks)
        cpu = codec.decode(blobs[0], profile)
        cuda = codec.decode(blobs[0], profile, device="cuda").cpu()
        max_diff = float((cpu.float() - cuda.float()).abs().max())
        results.append({"level": level, "bits_per_element": 8 * sum(map(len, blobs)) / sum(c.numel() for c in chunks),
                        "decode_gb_s": out_bytes / t["pipeline_seconds"] / 1e9, **t,
                        "overlap_ratio": t["pipeline_seconds"] / max(t["copy_seconds"], t["decode_seconds"]),
                        "cpu_gpu_max_abs_diff": max_diff})
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=2))
        return
    print(f"GPU decode on {torch.cuda.get_device_name()}: {args.chunks} chunks x {args.tokens} tokens, "
          f"Llama-3-8B shape {LLAMA}")
    for r in results:
        print(f"  level {r['level']}: {r['bits_per_element']:.2f} bits/el  {r['decode_gb_s']:.1f} GB/s fp16 out  "
              f"overlap {r['overlap_ratio']:.2f}  max|cpu-gpu| {r['cpu_gpu_max_abs_diff']:.3g}")


if __name__ == "__main__":
    main()
