"""Gradients all-reduced in bfloat16 (``comm_dtype="bf16"``) by the bucketed all-reduce: CPU
devices with ``MGPU_CPU_SHARED_UPDATE=0`` (their threads' reduce-scatter and all-gather) and the
GPUs of one process (NCCL's ncclBfloat16, the emulator's sums in device order; the peer copies'
reduce-scatter and all-gather). Each device's gradients are rounded to bfloat16, added in float32
in device order, the sum rounded to bfloat16 once and the float32 parameters updated with it:
checked exactly against NumPy on a problem whose float32 gradients are exact, half the bytes of
float32 (counted), and the CPU devices' bits equal the shared update's."""
import numpy as np
import pytest

import dist_worker
import mgpu
from comm_dtype_worker import dyadic_problem, exact_grads, step
from mgpu import nn, optim
from test_accumulate import batches
from test_bfloat16 import reference_bits, widened
from test_comm_dtype import ranges
from test_deterministic import assert_bitwise

CPUS = [mgpu.cpu(i) for i in range(3)]


def bf16(x):
    """x (exact in float32) rounded to bfloat16 by the reference rounding, as float32."""
    x = np.asarray(x, np.float32)
    return widened(reference_bits(x)).reshape(x.shape)


def reference(k):
    """The reduced gradients of k replicas (or ranks), each on its contiguous rows: every
    replica's exact gradient rounded to bfloat16, the rounded values added in float32 in
    replica order, the sum rounded to bfloat16 once."""
    X, y = dyadic_problem()
    parts = [exact_grads(X[a:b], y[a:b]) for a, b in ranges(len(y), k)]
    out = []
    for i in range(2):
        acc = bf16(parts[0][i])
        for p in parts[1:]:
            acc = (acc + bf16(p[i])).astype(np.float32)
        out.append(bf16(acc))
    float32 = [sum(p[i] for p in parts).astype(np.float32) for i in range(2)]
    return out, float32


def check_step(devices):
    got, bytes16 = step(devices, "bf16")
    f32, bytes32 = step(devices, "float32")
    want, exact = reference(len(devices))
    for i, name in enumerate(("weight", "bias")):
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"bf16 {name} gradient sum")
        np.testing.assert_array_equal(f32[i], exact[i], err_msg=f"float32 {name} gradient sum")
    # The weight gradients need more than bfloat16's 8 significant bits: the paths differ.
    assert not np.array_equal(got[0], f32[0])
    assert bytes32 == 4 * sum(g.size for g in got) and bytes16 * 2 == bytes32, (bytes16, bytes32)


@pytest.mark.parametrize("k", [2, 3])
def test_cpu_bucketed_allreduce_rounds_sums_in_order_and_rounds_again(k, monkeypatch):
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "0")
    check_step(CPUS[:k])


def bn_steps(devices, comm_dtype):
    """Three momentum-SGD steps of a batch-norm net (tests/dist_worker.bn_net); its parameters."""
    net = dist_worker.bn_net()
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for Xn, yn in batches(3):
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer,
                      comm_dtype=comm_dtype)
    return [p.numpy() for p in net.parameters()]


def test_cpu_bucketed_bf16_gives_the_shared_updates_bits(monkeypatch):
    """Both CPU paths round, add and round again in one order, so training keeps its bits
    whichever path MGPU_CPU_SHARED_UPDATE picks."""
    shared = bn_steps(CPUS[:3], "bf16")
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "0")
    bucketed = bn_steps(CPUS[:3], "bf16")
    assert_bitwise(bucketed, shared, "bucketed against shared update")
    assert any(not np.array_equal(a, b) for a, b in zip(bucketed, bn_steps(CPUS[:3], "float32")))


needs_2_gpus = pytest.mark.skipif(mgpu.num_gpus() < 2,
                                  reason="needs 2 GPUs (the emulated build: MGPU_EMULATED_GPUS=2)")


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("path", ["nccl", "peer"])
def test_gpus_allreduce_in_bf16(path, monkeypatch):
    """ncclBfloat16 on 2 GPUs (one addition per element, so real NCCL's rounding of its partial
    sums gives these bits too), and the peer-copy path, which sums as the CPU devices do."""
    if path == "peer":
        monkeypatch.setenv("MGPU_ALLREDUCE", "peer")
    check_step([mgpu.gpu(0), mgpu.gpu(1)])
