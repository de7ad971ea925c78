"""GPU decode benchmark (run on a machine with an NVIDIA GPU and pycuda; < 5 minutes).

    python -m kernels.bench_gpu [--tokens 1536] [--chunks 4] [--json]

Prints, for Llama-3-8B-shaped chunks (32 layers, 8 KV heads, head dim 128):
decode throughput in GB/s of fp16 output per level; the copy/decode overlap ratio
(pipelined time over max(copy-only time, decode-only time)); CPU-vs-GPU equality.
Targets on an H200: >= 150 GB/s at the default level, overlap <= 1.1.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import codec
from codec import container
from codec.synthetic import synthetic_kv
from kernels import gpu

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
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
