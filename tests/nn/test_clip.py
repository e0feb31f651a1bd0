"""mgpu.nn.utils.clip_grad_norm_ against NumPy float64: the global norm over parameters on two
devices, the scale min(1, max_norm / (norm + 1e-6)), other norms, nothing clipped below the
limit, the book's loop under DataParallel, and bad arguments that change nothing."""
import math

import numpy as np
import pytest
from mgpu.nn.utils import clip_grad_norm_

import mgpu
from conftest import assert_close
from mgpu import nn


def params_on_two_devices(rng, scale=1.0):
    """Three parameters, two on cpu(0) and one on cpu(1), with gradients; their host copies."""
    shapes, devices = [(3, 4), (5,), (2, 3, 2)], [mgpu.cpu(0), mgpu.cpu(0), mgpu.cpu(1)]
    ps, grads = [], []
    for s, d in zip(shapes, devices):
        p = nn.Parameter(mgpu.array(rng.normal(size=s).astype(np.float32), device=d))
        g = (rng.normal(size=s) * scale).astype(np.float32)
        p.grad = mgpu.array(g, device=d)
        ps.append(p)
        grads.append(g.astype(np.float64))
    return ps, grads


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_global_norm_over_two_devices_and_the_scale(rng, norm_type):
    ps, grads = params_on_two_devices(rng)
    flat = np.concatenate([g.ravel() for g in grads])
    norm = (np.abs(flat).max() if norm_type == math.inf
            else np.sum(np.abs(flat) ** norm_type) ** (1 / norm_type))
    max_norm = 0.25 * norm
    total = clip_grad_norm_(ps, max_norm, norm_type)
    assert total.device == ps[0].grad.device and total.shape == ()
    assert float(total) == pytest.approx(norm, rel=1e-6)
    coef = max_norm / (norm + 1e-6)
    for i, (p, g) in enumerate(zip(ps, grads)):
        assert_close(p.grad.numpy(), g * coef, "elementwise", f"clipped grad {i}", p.device)


def test_below_the_limit_nothing_changes(rng):
    ps, grads = params_on_two_devices(rng, scale=1e-3)
    total = clip_grad_norm_(ps, 10.0)
    assert float(total) == pytest.approx(np.sqrt(sum((g ** 2).sum() for g in grads)), rel=1e-6)
    for p, g in zip(ps, grads):
        np.testing.assert_array_equal(p.grad.numpy(), g.astype(np.float32))


def test_parameters_without_gradients_are_skipped(rng):
    ps, grads = params_on_two_devices(rng)
    ps[1].grad = None
    norm = np.sqrt(grads[0].__pow__(2).sum() + grads[2].__pow__(2).sum())
    assert float(clip_grad_norm_(iter(ps), 1.0)) == pytest.approx(norm, rel=1e-6)
    assert float(clip_grad_norm_([nn.Parameter(mgpu.ones((2,)))], 1.0)) == 0.0


def test_books_loop_under_data_parallel_clips_the_summed_gradients(rng):
    net = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    X = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=8)
    nn.CrossEntropyLoss()(model(mgpu.array(X)), mgpu.array(y)).backward()
    grads = [p.grad.numpy().astype(np.float64) for p in model.parameters()]
    norm = np.sqrt(sum((g ** 2).sum() for g in grads))
    total = clip_grad_norm_(model.parameters(), norm / 3)
    assert float(total) == pytest.approx(norm, rel=1e-6)
    for p, g in zip(model.parameters(), grads):
        assert_close(p.grad.numpy(), g * (norm / 3) / (norm + 1e-6), "elementwise", "DP grad")


def test_bad_arguments_change_nothing(rng):
    ps, grads = params_on_two_devices(rng)
    for kw, error, match in [
        (dict(max_norm=-1.0), ValueError, "max_norm must be"),
        (dict(max_norm=float("nan")), ValueError, "max_norm must be"),
        (dict(max_norm=1.0, norm_type=0), ValueError, "norm_type must be"),
        (dict(max_norm=1.0, norm_type=-2.0), ValueError, "norm_type must be"),
    ]:
        with pytest.raises(error, match=match):
            clip_grad_norm_(ps, **kw)
    with pytest.raises(TypeError, match="parameters\\[1\\] is a ndarray"):
        clip_grad_norm_([ps[0], np.ones(3)], 1.0)
    ps[2].grad = mgpu.array(np.array([[[np.inf, 0.0]] * 3] * 2, np.float32), device=mgpu.cpu(1))
    with pytest.raises(RuntimeError, match="is inf"):
        clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    for p, g in zip(ps[:2], grads[:2]):
        np.testing.assert_array_equal(p.grad.numpy(), g.astype(np.float32))


@pytest.mark.gpu
def test_global_norm_over_two_emulated_gpus(rng):
    if mgpu.num_gpus() < 2:
        pytest.skip(f"needs 2 GPUs (emulated build), this build has {mgpu.num_gpus()}")
    shapes = [(300,), (7, 5)]
    grads = [rng.normal(size=s) for s in shapes]
    ps = []
    for i, g in enumerate(grads):
        p = nn.Parameter(mgpu.zeros(g.shape, device=mgpu.gpu(i)))
        p.grad = mgpu.array(g.astype(np.float32), device=mgpu.gpu(i))
        ps.append(p)
    norm = np.sqrt(sum((g.astype(np.float32).astype(np.float64) ** 2).sum() for g in grads))
    total = clip_grad_norm_(ps, 1.0)
    assert float(total) == pytest.approx(norm, rel=1e-6) and total.device == mgpu.gpu(0)
    for i, (p, g) in enumerate(zip(ps, grads)):
        assert_close(p.grad.numpy(), g.astype(np.float32) / (norm + 1e-6), "elementwise",
                     f"clipped grad {i}", p.device)
