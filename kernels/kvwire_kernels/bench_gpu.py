"""GPU decode benchmark (an NVIDIA GPU; pycuda built from a carried device kit; < 5 minutes).

    python -m kvwire_kernels.bench_gpu --kit .kit [--tokens 1536] [--chunks 2] [--json]
    python -m kvwire_kernels.bench_gpu --dry-run [--tokens 512 1024 1536] [--json]

On a GPU, for Llama-3-8B-shaped chunks (32 layers, 8 KV heads, head dim 128), per level:
entropy-only decode (the lane kernel alone, inputs on the device) and full decode (packed
upload, kernel, batched GEMM, written into one KV tensor) in GB/s of fp16-equivalent
output; the overlap ratio, the share of the decode hidden behind sections arriving at a
simulated 10, 25 and 100 Gbit/s; and whether the GPU's coefficients equal the CPU
decoder's bit for bit. Targets on an H200 (issue #16): entropy >= 150 GB/s and full
>= 100 GB/s at level 1, decode fully hidden behind 25 Gbit/s.

Without pycuda the script first builds it with ``KIT/install-pycuda.sh`` (a carried copy of
../shared/device-kit) into ``$SITE`` (default /tmp/site) and stops with the build's log if
that fails. With ``$OUT`` set (or ``--out``) the JSON report is rewritten there after every
measurement, so a run cut off still reports what it measured.

``--dry-run`` needs no GPU (nor pycuda): the lane kernel's registers, spills and shared
memory from ``nvcc --resource-usage``, and per level and chunk length the blob's bytes,
its lanes (one thread each), its launches (one per group of ``kvwire_kernels.gpu.GROUP_LAYERS``
layers) and the threads per SM the launch with the fewest lanes would fill on an H200
(``kvwire_kernels.occupancy``). The chunks are synthetic (``codec.synthetic``), the profile
calibrated on another draw, as in ``kvwire bench codec --workload llama``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import codec
from codec import container, layer_codec
from codec.profile import PREDICT_GROUPS
from codec.synthetic import synthetic_kv
from kvwire_kernels import gpu, occupancy

LLAMA = (32, 8, 128)
RATES_GBIT = (10.0, 25.0, 100.0)
REPORT_NAME = "bench_gpu.json"


@dataclass
class Prepared:
    """One level's blobs of the benchmark chunks and their sections (layer, bytes)."""

    level: int
    blobs: list[bytes]
    headers: list[codec.BlobHeader]
    sections: list[list[tuple[int, bytes]]]

    @property
    def fp16_bytes(self) -> int:
        return sum(2 * h.layers * 2 * h.tokens * h.channels for h in self.headers)


def prepare(shape: tuple[int, int, int], tokens: int, chunks: int, levels: list[int] | None = None,
            predict: int = 0, predict_maps: str = "all") -> tuple[codec.Profile, list[Prepared]]:
    """A profile calibrated on one synthetic draw, and per level ``chunks`` other draws
    encoded (no sink tokens: a context's later chunks have none). ``predict`` > 0: the
    profile predicts each layer from the one before (blob format 7, layers 0, predict, ..
    coded alone), so the decode adds each layer's prediction in turn; ``predict_maps`` its
    ``predict_groups`` (``kind``: the decode multiplies by the map's two diagonal blocks)."""
    profile = codec.calibrate([synthetic_kv(*shape, tokens, seed=1)], predict=predict, predict_groups=predict_maps)
    kvs = [synthetic_kv(*shape, tokens, seed=10 + i).half() for i in range(chunks)]
    out = []
    for level in range(len(profile.levels)) if levels is None else levels:
        blobs = [codec.encode(kv, level, profile, sink_tokens=0) for kv in kvs]
        headers = [codec.parse_header(b) for b in blobs]
        sections = [[(l, bytes(container.section(b, h, l))) for l in range(h.layers)] for b, h in zip(blobs, headers)]
        out.append(Prepared(level, blobs, headers, sections))
    return profile, out


def arrival_times(sizes: list[int], gbit_s: float) -> list[float]:
    """Seconds after the start at which each section's last byte lands, the sections sent
    back to back at ``gbit_s``."""
    times, sent = [], 0
    for size in sizes:
        sent += size
        times.append(8 * sent / (gbit_s * 1e9))
    return times


def write_report(report: dict, out_dir: str | None) -> None:
    """Rewrite the report in ``out_dir`` (if any): a cut-off run still leaves its figures."""
    _write_out(out_dir, REPORT_NAME, json.dumps(report, indent=2))


def _write_out(out_dir: str | None, name: str, text: str) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / name).write_text(text)


def ensure_pycuda(kit: str | None, site: str) -> None:
    """Import pycuda, building it from the device kit first when it is missing; SystemExit
    with the build's log when the build leaves no importable pycuda in ``site``.

    What decides is whether pycuda then imports from ``site`` in a fresh interpreter, not
    the script's exit status: the kit's script ends with an import check run from inside
    the unpacked source tree, where ``pycuda`` is the source folder without its compiled
    ``_driver`` module, so it fails after a good install. A non-zero status with a working
    import is reported on stderr, never hidden."""
    try:
        import pycuda  # noqa: F401
        return
    except ImportError:
        pass
    if not kit:
        raise SystemExit("pycuda is not installed: pass --kit DIR (a copy of ../shared/device-kit) to build it")
    script = Path(kit) / "install-pycuda.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={**os.environ, "SITE": site})
    log = result.stdout + result.stderr
    _write_out(os.environ.get("OUT"), "pycuda_build.log", log)
    probe = subprocess.run([sys.executable, "-c", "import pycuda.driver"], capture_output=True, text=True,
                           cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": site})
    if probe.returncode != 0:
        raise SystemExit(f"pycuda build failed ({script}, exit {result.returncode}):\n{log[-4000:]}\n"
                         f"import pycuda.driver from {site}:\n{probe.stderr[-2000:]}")
    if result.returncode != 0:
        print(f"note: {script} exited {result.returncode}, but pycuda.driver imports from {site}; "
              "going on (the script's last lines are in pycuda_build.log)", file=sys.stderr)
    sys.path.insert(0, site)
    importlib.import_module("pycuda")


def _timed(fn, repeat: int) -> float:
    """Best wall seconds of ``fn`` over ``repeat`` runs, the GPU idle before and after each."""
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure_level(decoder, profile: codec.Profile, prepared: Prepared, repeat: int) -> dict:
    """Entropy-only and full decode GB/s, the overlap behind each arrival rate, and the
    CPU-vs-GPU coefficient check, for one level."""
    from kvwire_kernels import packing, reconstruct

    header0 = prepared.headers[0]
    kv = torch.empty(header0.shape, dtype=header0.dtype, device=decoder.device)
    outs = {l: kv[l] for l in range(header0.layers)}

    def full() -> None:
        for header, sections in zip(prepared.headers, prepared.sections):
            for _ in decoder.decode_into(header, profile, iter(sections), outs=outs):
                pass

    # entropy only: each group of the decoder's layers packed and uploaded once, then one
    # launch per group, as the full decode makes them
    slot = codec.resolve_profile(header0, profile)[1]
    launches = []
    for header, sections in zip(prepared.headers, prepared.sections):
        parsed = [reconstruct.parse_section(header, profile, slot, l, s) for l, s in sections]
        coded = [(p.layer, p.lanes) for p in parsed if p.lanes is not None]
        for at in range(0, len(coded), decoder.group_layers):
            group = coded[at:at + decoder.group_layers]
            host = torch.empty(packing.group_size(group), dtype=torch.uint8).numpy()
            packed = packing.pack(group, host, header.coded_tokens)
            coef = torch.empty(packed.out_floats, dtype=torch.float32, device=decoder.device)
            status = torch.zeros(packed.lanes, dtype=torch.int32, device=decoder.device)
            launches.append((torch.from_numpy(host).to(decoder.device), packed, group, header.coded_tokens,
                             coef, status))
    tables = decoder.coder_tables(profile)

    def entropy() -> None:
        with decoder.current():
            for device, packed, _, coded, coef, status in launches:
                decoder.launch_group(device.data_ptr(), packed, tables, coded, coef, status)

    full()  # warm-up: kernel load, tables, buffers
    entropy()
    t_full, t_entropy = _timed(full, repeat), _timed(entropy, repeat)
    mismatched = checked = 0
    for device, packed, group, coded, coef, status in launches:   # every layer of every chunk
        mismatched += int(status.max().item() != 0) if packed.lanes else 0
        for layout, (layer, lanes) in zip(packed.layers, group):
            got = layout.coefficients(coef).cpu()
            cpu = layer_codec.decode_coefficients(profile, layer, lanes, coded)
            mismatched += int(not torch.equal(got, torch.from_numpy(cpu)))
            checked += 1
    row = {"level": prepared.level, "bits_per_element": 8 * sum(map(len, prepared.blobs)) * 2 / prepared.fp16_bytes,
           "entropy_gb_s": prepared.fp16_bytes / t_entropy / 1e9, "full_gb_s": prepared.fp16_bytes / t_full / 1e9,
           "entropy_seconds": t_entropy, "full_seconds": t_full,
           "coefficients_equal_cpu": mismatched == 0, "layers_checked": checked,
           "launches_per_chunk": len(launches) // len(prepared.headers)}
    for rate in RATES_GBIT:
        row[f"hidden_at_{rate:g}gbit"] = _hidden_share(decoder, profile, prepared, rate, t_full)
    return row


def _hidden_share(decoder, profile, prepared: Prepared, gbit_s: float, t_full: float) -> float:
    """Share of the decode hidden behind sections arriving at ``gbit_s``, through the
    session's path (``kvwire_kernels.stream``): 1 - (last layer out - last byte in) / decode alone."""
    from kvwire_kernels.stream import StreamDecoder

    sections = [(header, layer, section) for header, chunk in zip(prepared.headers, prepared.sections)
                for layer, section in chunk]
    times = arrival_times([len(s) for _, _, s in sections], gbit_s)
    stream = StreamDecoder(decoder)
    try:
        start = time.perf_counter()
        futures = []
        for (header, layer, section), at in zip(sections, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(stream.submit(header, profile, layer, section))
        for future in futures:
            future.result()
        exposed = max(0.0, time.perf_counter() - start - times[-1])
    finally:
        stream.close()
    return max(0.0, 1.0 - exposed / t_full)


def run_gpu(args: argparse.Namespace) -> dict:
    """The GPU measurements, the report rewritten after each level."""
    ok, reason = gpu.availability()
    if not ok:
        raise SystemExit(f"GPU benchmark needs a GPU: {reason}")
    decoder = gpu.decoder("cuda")
    report = {"device": torch.cuda.get_device_name(), "shape": list(args.shape), "tokens": args.tokens[0],
              "chunks": args.chunks, "group_layers": decoder.group_layers, "predict": args.predict,
              "predict_maps": args.predict_maps, "results": []}
    write_report(report, args.out)
    profile, levels = prepare(tuple(args.shape), args.tokens[0], args.chunks, predict=args.predict,
                              predict_maps=args.predict_maps)
    for prepared in levels:
        report["results"].append(measure_level(decoder, profile, prepared, args.repeat))
        write_report(report, args.out)
    return report


def lane_rows(profile: codec.Profile, tokens: list[int], seed: int = 2,
              group_layers: int = gpu.GROUP_LAYERS) -> list[dict]:
    """Per chunk length and level: blob bytes and lanes of one synthetic chunk of the
    profile's shape (no sink tokens: a context's later chunks have none), its launches (one
    per group of ``group_layers`` layers) and the fewest lanes one of them has."""
    longest = synthetic_kv(profile.layers, profile.heads, profile.head_dim, max(tokens), seed=seed).half()
    rows = []
    for n in tokens:
        for level in range(len(profile.levels)):
            info = codec.inspect(codec.encode(longest[:, :, :n], level, profile, sink_tokens=0))
            per_layer = info["sections"]["lanes"]
            groups = [sum(per_layer[at:at + group_layers]) for at in range(0, len(per_layer), group_layers)]
            rows.append({"tokens": n, "level": level, "bytes": info["total_bytes"], "lanes": info["lanes"],
                         "launches": len(groups), "lanes_per_launch": min(groups),
                         "bits_per_element": round(info["bits_per_element"], 4)})
    return rows


def dry_run(tokens: list[int], calibration_tokens: int, shape: tuple[int, int, int] = LLAMA) -> dict:
    """Occupancy of the lane kernel on an H200 for chunks of ``shape``, without a GPU."""
    try:
        resources = occupancy.kernel_resources(gpu.KERNEL_DIR / "rans_decode.cu")
    except RuntimeError as exc:
        raise SystemExit(f"--dry-run: {exc}") from exc
    profile = codec.calibrate([synthetic_kv(*shape, calibration_tokens, seed=1)])
    rows = []
    for row in lane_rows(profile, tokens):
        fill = occupancy.fill(occupancy.H200, resources, gpu.THREADS_PER_BLOCK, row["lanes_per_launch"])
        rows.append({**row, **{k: v for k, v in fill.items() if k != "lanes"}})
    return {"device": occupancy.H200.name, "sms": occupancy.H200.sms,
            "threads_per_sm": occupancy.H200.threads_per_sm, "kernel": "rans_decode_group",
            "registers": resources.registers, "shared_bytes": resources.shared_bytes,
            "spill_bytes": resources.spill_bytes, "threads_per_block": gpu.THREADS_PER_BLOCK,
            "group_layers": gpu.GROUP_LAYERS, "shape": list(shape), "rows": rows}


def _print_dry_run(report: dict) -> None:
    print(f"{report['kernel']}: {report['registers']} registers/thread, {report['spill_bytes']} B spilled, "
          f"{report['shared_bytes']} B shared/block, {report['threads_per_block']} threads/block "
          f"(nvcc --resource-usage, sm_90)")
    print(f"{report['device']}: {report['sms']} SMs x {report['threads_per_sm']} threads; "
          f"shape {tuple(report['shape'])} (layers, KV heads, head dim), one synthetic chunk, sinks 0; "
          f"one launch per group of {report['group_layers']} layers")
    print("tokens level   bytes      bits/el  lanes   launches  lanes/launch (fewest)  threads/SM (resident max)"
          "  device fill")
    for r in report["rows"]:
        print(f"{r['tokens']:6d} {r['level']:5d} {r['bytes']:10d} {r['bits_per_element']:8.3f} {r['lanes']:7d} "
              f"{r['launches']:9d} {r['lanes_per_launch']:13d}          {r['threads_per_sm']:9d} "
              f"({r['resident_threads_per_sm']:4d})          {100 * r['fraction_of_device']:5.1f}%")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="tokens per chunk (default 1536; --dry-run: 512 1024 1536)")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calibration-tokens", type=int, default=1536,
                        help="tokens of the synthetic draw the profile is fitted on (--dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: registers, lanes per chunk and H200 occupancy")
    parser.add_argument("--shape", type=int, nargs=3, default=list(LLAMA), metavar=("LAYERS", "HEADS", "HEAD_DIM"),
                        help="KV shape of the chunks (default Llama-3-8B's 32 8 128)")
    parser.add_argument("--predict", type=int, default=0, metavar="N",
                        help="blobs of a profile that predicts each layer from the one before (format 7; "
                             "layers 0, N, 2N, .. coded alone): what the prediction adds to a decode")
    parser.add_argument("--predict-maps", choices=PREDICT_GROUPS, default=None,
                        help="with --predict: the maps (kvwire calibrate --predict-maps; default low-rank, "
                             "as kvwire calibrate fits for a causal LM)")
    parser.add_argument("--kit", default=None, help="a copy of ../shared/device-kit: builds pycuda if missing")
    parser.add_argument("--site", default=os.environ.get("SITE", "/tmp/site"), help="where the kit installs pycuda")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder the JSON report is rewritten in")
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.predict_maps is not None and not args.predict:
        parser.error("--predict-maps chooses the maps of --predict N; give both")
    args.predict_maps = args.predict_maps or "low-rank"
    if args.dry_run:
        report = dry_run(args.tokens or [512, 1024, 1536], args.calibration_tokens, tuple(args.shape))
        write_report(report, args.out)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_dry_run(report)
        return
    args.tokens = args.tokens or [1536]
    ensure_pycuda(args.kit, args.site)
    report = run_gpu(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"GPU decode on {report['device']}: {args.chunks} chunks x {args.tokens[0]} tokens, "
          f"shape {tuple(args.shape)}, groups of {report['group_layers']} layers")
    for r in report["results"]:
        hidden = "  ".join(f"{rate:g} Gbit/s {100 * r[f'hidden_at_{rate:g}gbit']:.0f}%" for rate in RATES_GBIT)
        print(f"  level {r['level']}: {r['bits_per_element']:.2f} bits/el  entropy {r['entropy_gb_s']:.1f} GB/s  "
              f"full {r['full_gb_s']:.1f} GB/s  hidden: {hidden}  coefficients equal CPU: "
              f"{r['coefficients_equal_cpu']}")


if __name__ == "__main__":
    main()
