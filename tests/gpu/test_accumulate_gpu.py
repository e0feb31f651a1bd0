"""Gradient accumulation on emulated GPUs: the fused step with ``accumulate=K`` on 1, 2 and 3
GPUs (each count in a fresh process with MGPU_EMULATED_GPUS set). Deterministic: bitwise the
parameters of one GPU and one batch (K = 1); otherwise the CPU devices' step to float tolerance,
with no more bucket all-reduces than one batch starts."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not mgpu.build_info().get("cuda_emulation"), reason="needs the emulated GPUs")]
TESTS = Path(__file__).resolve().parent.parent


def gpu_run(tmp_path, gpus, *configs):
    """dist_worker's accumulated mode on `gpus` emulated GPUs; returns {config: arrays}."""
    env = dict(os.environ, MGPU_TEST_ON_GPUS="1", MGPU_DIST_CHECK="0",
               MGPU_EMULATED_GPUS=str(gpus), PYTHONPATH=str(Path(mgpu.__file__).parent.parent))
    r = subprocess.run([sys.executable, str(TESTS / "dist_worker.py"), "accumulated",
                        str(tmp_path), str(gpus), *configs], env=env, cwd=TESTS,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for c in configs:
        shards, k = c.split(":")
        npz = np.load(tmp_path / f"acc_L{gpus}_{shards}_{k}.rank0.npz")
        out[c] = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    return out


def test_accumulation_on_one_two_and_three_emulated_gpus(tmp_path):
    nparams = len(list(dist_worker.bn_net().parameters()))
    one = gpu_run(tmp_path, 1, "8:1")["8:1"]
    two = gpu_run(tmp_path, 2, "8:2", "0:1", "0:4")
    three = gpu_run(tmp_path, 3, "8:4")["8:4"]
    for name, got in (("2 GPUs, accumulate=2", two["8:2"]), ("3 GPUs, accumulate=4", three)):
        for i in range(nparams):
            assert np.array_equal(got[i], one[i]), f"{name}: parameter {i} differs from 1 GPU"
    cpus = dist_worker.accumulated_steps([mgpu.cpu(0), mgpu.cpu(1)], 4)
    for i, (g, e) in enumerate(zip(two["0:4"][:-2], cpus[:-2])):
        assert_close(g, e, "sum", f"2 GPUs, accumulate=4: array {i} against 2 CPU devices")
    assert two["0:1"][-1][0] > 0
    assert np.array_equal(two["0:4"][-1], two["0:1"][-1]), \
        f"accumulate=4 started {two['0:4'][-1]} reductions, one batch {two['0:1'][-1]}"


@pytest.mark.skipif(mgpu.num_gpus() < 2, reason="needs 2 GPUs (the emulated build)")
def test_no_sync_on_two_emulated_gpus_sends_the_sum_once(tmp_path):
    """The book's loop on gpu(0), gpu(1): three micro-batches, two under no_sync, give the whole
    batch's gradients, and only the last backward copies gradients between the GPUs."""
    import json

    from mgpu import nn
    from mgpu.chapter import accumulated_backward
    gpus = [mgpu.gpu(0), mgpu.gpu(1)]
    rng = np.random.default_rng(4)
    X = mgpu.array(rng.standard_normal((18, 1, 8, 8)).astype(np.float32), device=gpus[0])
    y = mgpu.array(rng.integers(0, 10, size=18).astype(np.int32), device=gpus[0])
    loss = nn.CrossEntropyLoss()

    def net():
        mgpu.random.seed(3)
        return nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(4 * 8 * 8, 10))

    whole = net()
    loss(nn.DataParallel(whole, device_ids=gpus)(X), y).backward()
    acc = net()
    dp = nn.DataParallel(acc, device_ids=gpus)
    path = tmp_path / "trace.json"
    with mgpu.profile(str(path)):
        accumulated_backward(dp, loss, X, y, 3)
    copies = sum(1 for e in json.loads(path.read_text())["traceEvents"]
                 if e.get("name") == "to backward")
    assert copies == len(list(acc.parameters())), "one gradient copy per parameter"
    for i, (a, w) in enumerate(zip(acc.parameters(), whole.parameters())):
        assert_close(a.grad.numpy(), w.grad.numpy(), "sum", f"param {i}")
