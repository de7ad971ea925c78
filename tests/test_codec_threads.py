"""Codec kernels called from several threads at once (issue #15 finding 11).

Sessions decode on several threads. numba's ``workqueue`` threading layer (the one
left when neither tbb nor omp is installed) aborts the process on concurrent
launches; ``codec.parallel`` serializes launches then, and only then.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import codec
from codec import parallel
from codec.synthetic import synthetic_kv

ROOT = Path(__file__).resolve().parent.parent

# encodes and decodes on 4 threads at once; prints the layer and whether all agreed
SCRIPT = """
import threading, torch, codec
from codec import parallel
from codec.synthetic import synthetic_kv
kv = synthetic_kv(3, 2, 16, 300, seed=1)
profile = codec.calibrate([kv])
blob = codec.encode(kv, 1, profile)
ref = codec.decode(blob, profile)
same = []
def work():
    for _ in range(15):
        same.append(codec.encode(kv, 1, profile) == blob and torch.equal(codec.decode(blob, profile), ref))
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
print(parallel.threading_layer(), parallel.serialized(), len(same), all(same))
"""


def _decode_on_threads(blob: bytes, profile: codec.Profile, threads: int, rounds: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(rounds):
                out.append(codec.decode(blob, profile))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    return out


def test_concurrent_decodes_agree_with_a_single_one() -> None:
    kv = synthetic_kv(4, 2, 16, 400, seed=3)
    profile = codec.calibrate([kv])
    blob = codec.encode(kv.half(), 1, profile)
    embedded = codec.encode(kv.half(), 2)
    for b, p in ((blob, profile), (embedded, None)):
        ref = codec.decode(b, p)
        results = _decode_on_threads(b, p, threads=4, rounds=5)
        assert len(results) == 20 and all(torch.equal(r, ref) for r in results)


def test_threadsafe_layers_are_not_serialized() -> None:
    codec.decode(codec.encode(torch.randn(1, 2, 12, 1, 4), 1))  # a launch has happened
    layer = parallel.threading_layer()
    assert parallel.serialized() == (layer not in parallel.THREADSAFE_LAYERS + ("none",))


@pytest.mark.parametrize("layer", ["workqueue", "default"])
def test_concurrent_use_under_each_threading_layer(layer: str) -> None:
    """Under workqueue numba itself would abort ("Concurrent access has been detected");
    the codec serializes there and agrees with itself under any layer."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": layer}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    name, serialized, count, agreed = done.stdout.split()
    assert (count, agreed) == ("60", "True")
    if layer == "workqueue":
        assert (name, serialized) == ("workqueue", "True")
        assert "not thread-safe" in done.stderr
    else:
        assert serialized == str(name not in parallel.THREADSAFE_LAYERS)
