"""Synchronised batch norm's exchange inside the fused step on emulated GPUs: the statistics of
every layer (forward) and the sums of its backward are combined on the devices' streams, in
device order, with no host thread waiting for a GPU -- before, each exchange was an all-reduce
whose end the device's worker waited for, about 34 stalls of every GPU's queue per ResNet-18 step
(17 batch norm layers, forward and backward). The sums are bitwise those of the all-reduce they
replace, and the step is the float64 batch norm over the whole batch.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mgpu
from mgpu import _core, nn
from test_concise_step import fused_step_and_check
from test_data_parallel import LR, batch, tiny_net

pytestmark = pytest.mark.gpu

NUM_GPUS = mgpu.num_gpus()
EMULATED = bool(mgpu.build_info()["cuda_emulation"])
HERE = Path(__file__).resolve().parent

needs_two = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs (the emulated build)")


def _parts(k, n, seed):
    """What an exchange sums: zero-padded rows, one non-zero per device, plus random data
    (every value distinct, signed zeros included, so a different order of additions shows)."""
    rng = np.random.default_rng(seed)
    rows = [np.zeros(n, np.float32) for _ in range(k)]
    w = n // k
    for d in range(k):
        rows[d][d * w:(d + 1) * w] = rng.normal(size=w).astype(np.float32)
    dense = [(rng.normal(size=n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(np.float32)
             for _ in range(k)]
    if n >= 4:
        dense[0][:4] = [0.0, -0.0, -0.0, 1e-30]
        dense[-1][:4] = [-0.0, -0.0, 0.0, -1e-30]
    return rows, dense


def _stream_sum_equals_allreduce(k, n, seed):
    for parts in _parts(k, n, seed):
        a = [mgpu.array(p, device=mgpu.gpu(d)) for d, p in enumerate(parts)]
        b = [mgpu.array(p, device=mgpu.gpu(d)) for d, p in enumerate(parts)]
        _core._stream_sum([t._t for t in a])
        mgpu.allreduce(b)  # the exchange the fused step used before
        want = parts[0].copy()
        for p in parts[1:]:
            want = want + p  # device order
        for d in range(k):
            got, old = a[d].numpy(), b[d].numpy()
            assert got.tobytes() == old.tobytes(), f"k={k} n={n} device {d}"
            assert got.tobytes() == want.tobytes(), f"k={k} n={n} device {d} vs NumPy"


@needs_two
@pytest.mark.parametrize("n", [1, 7, 4099])
def test_stream_sum_is_bitwise_the_allreduce_it_replaces(n):
    _stream_sum_equals_allreduce(2, n, n)


@needs_two
def test_stream_sum_refuses_what_it_cannot_sum():
    a = mgpu.array(np.ones(3, np.float32), device=mgpu.gpu(0))
    with pytest.raises(ValueError, match="appears twice"):
        _core._stream_sum([a._t, a._t])
    with pytest.raises(ValueError, match="one size"):
        _core._stream_sum([a._t, mgpu.array(np.ones(4, np.float32), device=mgpu.gpu(1))._t])


def two_gpu_steps(sync):
    """The tiny residual net on gpu(0) and gpu(1), and a function that runs one fused step of it
    on a batch of 8."""
    devices = [mgpu.gpu(0), mgpu.gpu(1)]
    net = tiny_net(sync=sync)
    model = nn.DataParallel(net, device_ids=devices)
    trainer = mgpu.optim.SGD(model.parameters(), lr=LR)
    X, y = batch(8)
    Xt, yt = mgpu.array(X, device=devices[0]), mgpu.array(y, device=devices[0])
    return net, lambda: model.train_step(Xt, yt, nn.CrossEntropyLoss(), trainer)


def _host_waits_per_step(sync, steps=3):
    _, step = two_gpu_steps(sync)
    for _ in range(2):  # the first steps build the fused model and reserve memory
        step()
    mgpu.waitall()
    before = _core._gpu_host_waits()
    for _ in range(steps):
        step()
    mgpu.waitall()
    return (_core._gpu_host_waits() - before) / steps


@needs_two
def test_sync_batch_norm_adds_no_host_wait_to_a_step(monkeypatch):
    """The tiny residual net has 3 batch norm layers: 6 exchanges per step. Synchronised, its
    step must wait on the host no more often than the same step with per-replica statistics
    (both without CUDA graphs, which synchronised steps cannot use); each exchange that the host
    waits for adds one wait per GPU (12 per step here)."""
    monkeypatch.setenv("MGPU_CUDA_GRAPH", "0")
    plain = _host_waits_per_step(sync=False)
    synced = _host_waits_per_step(sync=True)
    print(f"host waits per step: per-replica BN {plain}, SyncBatchNorm {synced}")
    assert synced <= plain, (plain, synced)


@needs_two
def test_fused_sync_batch_norm_on_two_gpus_is_the_whole_batch_in_float64():
    fused_step_and_check(tiny_net(sync=True), [mgpu.gpu(0), mgpu.gpu(1)], *batch(9),
                         "stream-summed sync k=2")


_MORE = r"""
import conftest  # noqa: F401  (puts every test folder on sys.path, as under pytest)
import numpy as np
import mgpu
from test_concise_step import fused_step_and_check
from test_data_parallel import batch, tiny_net
import test_sync_bn_gpu as t

for k in (3, 4):
    for n in (1, 5, 1027):
        t._stream_sum_equals_allreduce(k, n, 10 * k + n)
print("SUMS OK")
# Two examples on three GPUs: the third replica is empty and joins every exchange with zeros.
fused_step_and_check(tiny_net(sync=True), [mgpu.gpu(i) for i in range(3)], *batch(2),
                     "batch 2 on 3 gpus")
fused_step_and_check(tiny_net(sync=True), [mgpu.gpu(i) for i in range(4)], *batch(11),
                     "batch 11 on 4 gpus")
print("STEPS OK")
"""


@pytest.mark.skipif(not EMULATED, reason="runs 4 emulated GPUs in a child")
def test_stream_sum_and_sync_steps_on_three_and_four_gpus():
    env = dict(os.environ, MGPU_EMULATED_GPUS="4")
    env.pop("MGPU_ALLREDUCE", None)
    try:
        run = subprocess.run([sys.executable, "-c", _MORE], cwd=HERE.parent, env=env,
                             capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung: {e.stdout!r}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "SUMS OK" in run.stdout and "STEPS OK" in run.stdout, run.stdout
