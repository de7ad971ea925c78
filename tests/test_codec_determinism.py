"""The encoder writes the same bytes whatever BLAS kernel the machine picks.

A KV store is filled on one machine and read on others, and the golden blobs
(tests/test_codec_golden.py) are re-encoded on whatever machine CI runs on: the
coefficients must not depend on how a float32 GEMM happens to round on this CPU. The
kernels are forced here through the libraries' own switches (OpenBLAS's core type for
numpy, MKL's instruction set and ATen's CPU capability for torch), in fresh processes
since each library reads its switch once at load. Before the transform's products ran
in float64 (codec.transform.forward, codec.control), numpy's OpenBLAS Haswell and
Prescott kernels gave different bytes for the golden input.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                 reason="the kernel switches named here are x86 ones")]

TESTS = Path(__file__).parent

#: each a set of switches that makes numpy's or torch's BLAS take another kernel
KERNELS = {
    "openblas-prescott": {"OPENBLAS_CORETYPE": "Prescott"},
    "openblas-sandybridge": {"OPENBLAS_CORETYPE": "Sandybridge"},
    "mkl-sse4.2-aten-default": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
}

ENCODE = f"""
import hashlib, sys
sys.path.insert(0, {str(TESTS)!r})
import codec, test_codec_golden as g
profile = codec.Profile.load(g.PROFILE_FILE)
blobs = [codec.encode(g.golden_input(), g.LEVEL, profile),
         codec.encode(g.rotary_input(), g.LEVEL, g.rotary_profile(profile), start=g.ROTARY_START),
         codec.encode(g.golden_input(tokens=g.PIECES_TOKENS), g.PIECES_LEVEL, profile)]
print(" ".join(hashlib.sha256(b).hexdigest() for b in blobs))
"""


def _digests(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", ENCODE], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.fixture(scope="module")
def here() -> str:
    return _digests({})


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_encode_is_the_same_on_every_blas_kernel(here: str, kernel: str) -> None:
    assert _digests(KERNELS[kernel]) == here, f"the {kernel} kernel encodes other bytes"

