"""mgpu.batch_norm (d2l 12.6's ResNet-18) on every device against the float64 reference in
reference.py, with PyTorch's F.batch_norm semantics: training and evaluation, the running
statistics, accuracy when the mean dwarfs the spread, and the errors for bad arguments.

Inputs are drawn in float64, rounded to float32 once, and the reference sees those same float32
values, so the comparison measures only the op's own rounding (the tolerances of conftest.TOL)."""

import numpy as np
import pytest

import mgpu
import reference as ref
from conftest import assert_close, f32, on, other_device

# ---------------------------------------------------------------------------------------------
# batch_norm (d2l 12.6's ResNet-18): mgpu.batch_norm, PyTorch's F.batch_norm semantics
# ---------------------------------------------------------------------------------------------

BN_CASES = [
    pytest.param((2, 3, 5, 4), id="nchw"),
    pytest.param((1, 4, 3, 3), id="batch1-hw9"),
    pytest.param((3, 1, 7, 5), id="one-channel-odd"),
    pytest.param((3, 2, 33, 35), id="odd-several-cuda-chunks"),
    pytest.param((5, 3), id="2d-nc"),
    # (Batch 2 of 1x1 maps normalises to exactly -1, +1 whatever x is: dx cancels to ~eps / var,
    # so float32 rounding dominates it; 4 values per channel keep the test meaningful.)
    pytest.param((4, 6, 1, 1), id="1x1-maps"),
]


def _bn_inputs(rng, shape, affine, loc=0.0, scale=1.0):
    C = shape[1]
    x = f32(rng.normal(loc=loc, scale=scale, size=shape))
    gamma = f32(rng.uniform(0.5, 1.5, size=C) * rng.choice([-1.0, 1.0], size=C)) if affine else None
    beta = f32(rng.normal(size=C)) if affine else None
    return x, gamma, beta


@pytest.mark.parametrize("shape", BN_CASES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_batch_norm_training_forward_backward_and_running_stats(device, rng, shape, affine):
    x, gamma, beta = _bn_inputs(rng, shape, affine, loc=0.7, scale=1.3)
    C = shape[1]
    rm0, rv0 = f32(rng.normal(size=C)), f32(rng.uniform(0.5, 2.0, size=C))
    xt = on(x, device, True)
    gt = on(gamma, device, True) if affine else None
    bt = on(beta, device, True) if affine else None
    rm, rv = on(rm0, device), on(rv0, device)
    y = mgpu.batch_norm(xt, rm, rv, gt, bt, training=True, momentum=0.1, eps=1e-5)
    assert y.shape == shape and y.device == device
    y_ref, _, _ = ref.batch_norm_train_forward(x, gamma, beta, eps=1e-5)
    assert_close(y.numpy(), y_ref, "sum", "batch_norm forward (training)", device)
    rm_ref, rv_ref = ref.batch_norm_running_update(rm0, rv0, x, momentum=0.1)
    assert_close(rm.numpy(), rm_ref, "sum", "running_mean", device)
    assert_close(rv.numpy(), rv_ref, "sum", "running_var", device)

    dy = f32(rng.normal(size=shape))
    y.backward(on(dy, device))
    dx, dgamma, dbeta = ref.batch_norm_train_backward(x, gamma, dy, eps=1e-5)
    assert_close(xt.grad.numpy(), dx, "sum", "batch_norm dx (training)", device)
    if affine:
        assert_close(gt.grad.numpy(), dgamma, "sum", "batch_norm dgamma", device)
        assert_close(bt.grad.numpy(), dbeta, "sum", "batch_norm dbeta", device)


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (4, 5), (1, 2, 1, 1)])
def test_batch_norm_evaluation_uses_running_stats_and_leaves_them(device, rng, shape):
    x, gamma, beta = _bn_inputs(rng, shape, True)
    C = shape[1]
    rm0, rv0 = f32(rng.normal(size=C)), f32(rng.uniform(0.5, 2.0, size=C))
    xt, gt, bt = on(x, device, True), on(gamma, device, True), on(beta, device, True)
    rm, rv = on(rm0, device), on(rv0, device)
    y = mgpu.batch_norm(xt, rm, rv, gt, bt, training=False, eps=1e-3)
    assert_close(y.numpy(), ref.batch_norm_eval_forward(x, rm0, rv0, gamma, beta, eps=1e-3),
                 "sum", "batch_norm forward (evaluation)", device)
    dy = f32(rng.normal(size=shape))
    y.backward(on(dy, device))
    dx, dgamma, dbeta = ref.batch_norm_eval_backward(x, rm0, rv0, gamma, dy, eps=1e-3)
    assert_close(xt.grad.numpy(), dx, "sum", "batch_norm dx (evaluation)", device)
    assert_close(gt.grad.numpy(), dgamma, "sum", "batch_norm dgamma (evaluation)", device)
    assert_close(bt.grad.numpy(), dbeta, "sum", "batch_norm dbeta (evaluation)", device)
    np.testing.assert_array_equal(rm.numpy(), rm0.astype(np.float32))
    np.testing.assert_array_equal(rv.numpy(), rv0.astype(np.float32))


def test_batch_norm_running_stats_by_hand(device):
    """One channel holding 1, 2, 3, 5 (N=2, H=1, W=2): mean 2.75, unbiased var 2.9166...;
    momentum 0.25 from running (1, 2) twice."""
    x = np.array([[[[1.0, 2.0]]], [[[3.0, 5.0]]]], dtype=np.float32)
    rm, rv = on([1.0], device), on([2.0], device)
    for _ in range(2):
        mgpu.batch_norm(on(x, device), rm, rv, training=True, momentum=0.25)
    mean, var_unbiased = 2.75, (1.75 ** 2 + 0.75 ** 2 + 0.25 ** 2 + 2.25 ** 2) / 3
    want_m = 0.75 * (0.75 * 1.0 + 0.25 * mean) + 0.25 * mean
    want_v = 0.75 * (0.75 * 2.0 + 0.25 * var_unbiased) + 0.25 * var_unbiased
    assert_close(rm.numpy(), [want_m], "elementwise", "running_mean by hand", device)
    assert_close(rv.numpy(), [want_v], "elementwise", "running_var by hand", device)


def test_batch_norm_without_running_stats_in_training(device, rng):
    x, gamma, beta = _bn_inputs(rng, (3, 2, 4, 4), True)
    y = mgpu.batch_norm(on(x, device), None, None, on(gamma, device), on(beta, device),
                        training=True)
    assert_close(y.numpy(), ref.batch_norm_train_forward(x, gamma, beta)[0], "sum",
                 "batch_norm without running stats", device)


@pytest.mark.parametrize("loc, scale", [(50.0, 1.0), (1e4, 1.0), (-3e3, 0.01)])
def test_batch_norm_is_accurate_when_mean_dwarfs_std(device, rng, loc, scale):
    """A one-pass float E[x^2] - E[x]^2 loses the variance entirely here; the shifted double sums
    keep it to float precision."""
    shape = (4, 3, 9, 11)
    x = f32(rng.normal(loc=loc, scale=scale, size=shape))
    mean, var = mgpu._core.batch_norm_stats(on(x, device)._t)
    mean_ref, var_ref = ref.batch_norm_stats(x)
    assert_close(mean.numpy(), mean_ref, "elementwise", "batch_norm_stats mean", device)
    assert_close(var.numpy(), var_ref, "sum", "batch_norm_stats var", device)
    y = mgpu.batch_norm(on(x, device), None, None, training=True, eps=1e-8)
    # y's error is set by mean rounded to float32 (|mean| * 6e-8) over std.
    tol = 4 * np.spacing(np.float32(abs(loc))) / scale
    y_ref = ref.batch_norm_train_forward(x, eps=1e-8)[0]
    err = np.abs(y.numpy() - y_ref).max()
    assert err <= max(tol, 1e-5), f"batch_norm forward on {device}: max error {err:.3g}"


def test_batch_norm_only_weights_require_grad(device, rng):
    x, gamma, beta = _bn_inputs(rng, (3, 2, 4, 3), True)
    xt, gt, bt = on(x, device), on(gamma, device, True), on(beta, device, True)
    dy = f32(rng.normal(size=x.shape))
    mgpu.batch_norm(xt, None, None, gt, bt, training=True).backward(on(dy, device))
    _, dgamma, dbeta = ref.batch_norm_train_backward(x, gamma, dy)
    assert xt.grad is None
    assert_close(gt.grad.numpy(), dgamma, "sum", "dgamma", device)
    assert_close(bt.grad.numpy(), dbeta, "sum", "dbeta", device)


def test_batch_norm_errors_are_clear_and_change_nothing(device, rng):
    C = 3
    x = on(rng.normal(size=(2, C, 4, 4)), device)
    rm, rv = on(np.zeros(C), device), on(np.ones(C), device)

    def unchanged():
        np.testing.assert_array_equal(rm.numpy(), np.zeros(C, dtype=np.float32))
        np.testing.assert_array_equal(rv.numpy(), np.ones(C, dtype=np.float32))

    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        mgpu.batch_norm(on(rng.normal(size=(1, C)), device), rm, rv, training=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        mgpu.batch_norm(on(rng.normal(size=(1, C, 1, 1)), device), rm, rv, training=True)
    with pytest.raises(ValueError, match="4 dims"):
        mgpu.batch_norm(on(rng.normal(size=(2, C, 4)), device), rm, rv, training=True)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        mgpu.batch_norm(x, rm, rv, on(np.ones(C + 1), device), training=True)
    with pytest.raises(ValueError, match=r"running_var must have shape \(3,\)"):
        mgpu.batch_norm(x, rm, on(np.ones(2), device), training=True)
    with pytest.raises(ValueError, match="is on"):
        mgpu.batch_norm(x, rm, rv, on(np.ones(C), other_device(device)), training=True)
    with pytest.raises(TypeError, match="float32"):
        mgpu.batch_norm(x, rm, rv, on(np.ones(C), device).astype(np.int32), training=True)
    with pytest.raises(TypeError, match="mgpu Tensor"):
        mgpu.batch_norm(np.ones((2, C, 4, 4), np.float32), rm, rv, training=True)
    with pytest.raises(TypeError, match="weight must be an mgpu Tensor"):
        mgpu.batch_norm(x, rm, rv, np.ones(C, np.float32), training=True)
    with pytest.raises(ValueError, match="eps must be > 0"):
        mgpu.batch_norm(x, rm, rv, training=True, eps=0.0)
    with pytest.raises(ValueError, match="running_mean and running_var are needed"):
        mgpu.batch_norm(x, None, None, training=False)
    unchanged()
    # The engine's own checks, for callers (the fused step) that bypass the Python ones.
    core = mgpu._core
    with pytest.raises(ValueError, match="batch_norm_stats: x must have 4 dims"):
        core.batch_norm_stats(on(np.ones((2, 3, 4)), device)._t)
    with pytest.raises(ValueError, match="no elements per channel"):
        core.batch_norm_stats(on(np.ones((0, 3)), device)._t)
    with pytest.raises(TypeError, match="float32"):
        core.batch_norm_stats(on(np.ones((2, 3)), device).astype(np.int32)._t)
    with pytest.raises(ValueError, match="eps must be a positive number"):
        core.batch_norm_forward(x._t, rm._t, rv._t, None, None, 0.0)
    with pytest.raises(ValueError, match=r"mean must have shape \(3,\)"):
        core.batch_norm_forward(x._t, on(np.ones(4), device)._t, rv._t, None, None, 1e-5)
    with pytest.raises(ValueError, match="same device|device"):
        core.batch_norm_forward(x._t, on(np.ones(C), other_device(device))._t, rv._t, None, None,
                                1e-5)
    with pytest.raises(ValueError, match="count"):
        core.batch_norm_backward(x._t, x._t, rm._t, rv._t, None, rm._t, rm._t, 0.0, 1e-5, True)
    with pytest.raises(ValueError, match="dy has shape"):
        core.batch_norm_backward_reduce(x._t, on(np.ones((2, C, 4, 3)), device)._t, rm._t, rv._t,
                                        1e-5)
    unchanged()
