"""LeNet's fused step with precision="bf16" on GPUs: the products run ops/bf16_gpu.h's kernels,
which give the CPU's bfloat16 products' bits (tests/gpu/test_bf16_gpu.py), so the step keeps
tests/step/test_lenet_bf16.py's bound against the NumPy float64 step with bfloat16-rounded
operands; the deterministic step gives the same bits on 1 and 2 GPUs. The CPU step differs in
its last bits: its convolutions sum in other orders (float32's kernels on rounded operands, the
lane convolutions' pair products), and a last-bit difference can round a later operand to the
other bfloat16 neighbour. So the GPU step is compared with the CPU's within the reference's own
bound (both lie within it), not bit for bit."""
import numpy as np
import pytest

import mgpu
from test_lenet_bf16 import (
    LR,
    TIGHT,
    check_against_reference,
    exact,
    fused_step,
    normwise,
    problem,
    reference_step,
    updates,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(mgpu.num_gpus() < 2, reason="needs 2 GPUs (emulated or real)")]


def gpus(k=2):
    """The first k GPUs (called inside the tests: a build without GPUs skips them unbuilt)."""
    return [mgpu.gpu(i) for i in range(k)]


def test_lenet_bf16_step_on_two_gpus_is_the_rounded_reference_and_the_cpus():
    X, y, params = problem(seed=1, n=13)
    after, losses = fused_step(X, y, params, gpus(), "bf16")
    got = check_against_reference(X, y, params, after, losses[0], "bf16 step on 2 gpus")
    cpu, cpu_losses = fused_step(X, y, params, [mgpu.cpu(0), mgpu.cpu(1)], "bf16")
    for i, (d, c) in enumerate(zip(got, updates(params, cpu))):
        assert normwise(d, c) <= 2 * TIGHT, f"param {i}: gpus vs cpu devices"
    # ... and bf16 took effect on the GPUs: float32's step is elsewhere, beyond its rounding.
    after32, _ = fused_step(X, y, params, gpus(), "float32")
    _, grads_x = reference_step(X, y, params, exact)
    for i, (d, d32, g) in enumerate(zip(got, updates(params, after32), grads_x)):
        assert normwise(d, d32) > 10 * normwise(d32, LR / len(X) * g), f"param {i}"


def test_lenet_bf16_deterministic_has_the_same_bits_on_one_and_two_gpus():
    X, y, params = problem(seed=2, n=8)
    one, l1 = fused_step(X, y, params, gpus(1), "bf16", deterministic=True, steps=2)
    two, l2 = fused_step(X, y, params, gpus(), "bf16", deterministic=True, steps=2)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a.tobytes() == b.tobytes(), f"param {i}: 1 vs 2 gpus"
    assert l1 == l2
    assert not np.array_equal(one[0], params[0])
