"""How much of a GPU one launch of the lane kernel fills: pure arithmetic, no GPU needed.

``python -m kvwire_kernels.bench_gpu --dry-run`` feeds it the kernel's registers and shared
memory (``nvcc --resource-usage``) and the lane count of a launch (a group of layers);
one thread decodes one lane, so a launch with fewer lanes than the device holds threads
leaves it idle however fast each thread is (issue #16).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Device:
    """The per-SM limits that bound resident threads (CUDA occupancy calculator terms)."""

    name: str
    sms: int
    threads_per_sm: int
    registers_per_sm: int
    shared_per_sm: int
    blocks_per_sm: int
    register_unit: int = 256  # registers are allocated per warp in units of this many
    warp: int = 32


#: H200 (Hopper, sm_90): 132 SMs x 2048 threads, 64K registers and 228 KiB shared memory per SM
H200 = Device("H200", sms=132, threads_per_sm=2048, registers_per_sm=65536, shared_per_sm=228 << 10,
              blocks_per_sm=32)


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel."""

    registers: int
    shared_bytes: int
    spill_bytes: int = 0   # bytes stored to local memory per thread (registers capped)


def resident_threads_per_sm(device: Device, resources: Resources, threads_per_block: int) -> int:
    """Most threads of this kernel one SM holds at once (limited by threads, registers,
    shared memory and blocks per SM)."""
    warps = -(-threads_per_block // device.warp)
    per_warp = -(-max(resources.registers, 1) * device.warp // device.register_unit) * device.register_unit
    blocks = min(device.blocks_per_sm, device.threads_per_sm // threads_per_block,
                 device.registers_per_sm // (per_warp * warps))
    if resources.shared_bytes:
        blocks = min(blocks, device.shared_per_sm // resources.shared_bytes)
    return blocks * threads_per_block


def fill(device: Device, resources: Resources, threads_per_block: int, lanes: int) -> dict:
    """Threads per SM a launch of ``lanes`` threads keeps busy, against what the SM can hold."""
    resident = resident_threads_per_sm(device, resources, threads_per_block)
    per_sm = min(resident, -(-lanes // device.sms))
    return {"lanes": lanes, "threads_per_sm": per_sm, "resident_threads_per_sm": resident,
            "device_thread_slots": device.sms * device.threads_per_sm,
            "fraction_of_device": per_sm * device.sms / (device.sms * device.threads_per_sm),
            "waves": -(-lanes // (resident * device.sms)) if resident else None}


_PTXAS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")
_SPILL = re.compile(r"(\d+) bytes spill stores")


def parse_resource_usage(text: str) -> Resources:
    """Registers and static shared memory from ``nvcc --resource-usage`` output (one kernel)."""
    registers = _PTXAS.search(text)
    if registers is None:
        raise ValueError(f"no register count in nvcc's resource usage: {text.strip()[:300]}")
    shared, spill = _SHARED.search(text), _SPILL.search(text)
    return Resources(int(registers.group(1)), int(shared.group(1)) if shared else 0,
                     int(spill.group(1)) if spill else 0)


def kernel_resources(source: Path, arch: str = "sm_90") -> Resources:
    """Compile ``source`` to a cubin with nvcc and read its resource usage (RuntimeError
    without nvcc or when it fails)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit to read the kernel's registers")
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([nvcc, "--cubin", f"-arch={arch}", "--fmad=false", "--resource-usage",
                                 "-o", str(Path(tmp) / "k.cubin"), str(source)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source.name}: {result.stderr.strip()[:500]}")
    return parse_resource_usage(result.stdout + result.stderr)
