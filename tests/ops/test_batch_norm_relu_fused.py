"""Batch norm + ReLU (+ residual add) as one layer of the fused step ("fused layers"):
the fused kernels against NumPy float64, and the fused step with the fusion on (the default) equal
to the same step with MGPU_FUSE_LAYERS=0, bit for bit (the fused kernels keep the unfused ops'
arithmetic order), for the small residual net and ResNet-18, per-replica and synchronised batch
norm, 1 and 2 CPU devices; on emulated GPUs the Model fuses nothing (the kernels are CPU ones)."""
import numpy as np
import pytest

import mgpu
import reference as ref
from conftest import assert_close
from mgpu import _core, nn
from mgpu.models import resnet18
from test_data_parallel import batch, tiny_net

EPS = 1e-5


def _t(a, device):
    return mgpu.array(np.ascontiguousarray(a, dtype=np.float32), device=device)._t


def _np(t):
    return mgpu.Tensor(t).numpy()


def _per_channel(v, x):
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def reference(x, gamma, beta, shortcut, dy, eps=EPS):
    """float64: y = relu(bn_train(x) + shortcut), and (dx, dgamma, dbeta, dshortcut) by the chain
    rule through the relu's mask, the add and batch norm's batch statistics."""
    z, _, _ = ref.batch_norm_train_forward(x, gamma, beta, eps=eps)
    if shortcut is not None:
        z = z + shortcut
    y = np.maximum(z, 0.0)
    dz = np.where(z > 0, dy.astype(np.float64), 0.0)
    dx, dgamma, dbeta = ref.batch_norm_train_backward(x, gamma, dz, eps=eps)
    return y, dx, dgamma, dbeta, dz


# Odd sizes: C = 1 and 3, N*H*W and H*W not multiples of 8 or 16 (the AVX2 / AVX-512 widths),
# 2-d input (H = W = 1), and one ResNet-18-like shape.
SHAPES = [(3, 1, 5, 7), (2, 3, 3, 3), (5, 3), (1, 4, 1, 17), (4, 16, 6, 6)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("add", [False, True], ids=["bn_relu", "bn_add_relu"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_fused_kernels_against_float64(device, shape, add, affine):
    if device.kind != _core.DeviceKind.CPU:
        pytest.skip("the fused kernels are CPU kernels (test_fusion_choice: a GPU refuses them)")
    rng = np.random.default_rng(hash((shape, add, affine)) % 2**32)
    C = shape[1]
    # A per-channel offset (mean far from 0) and scale, so the shifted sums matter.
    x = (rng.normal(size=shape) * _per_channel(rng.uniform(0.5, 2.0, C), np.zeros(shape))
         + _per_channel(rng.normal(size=C) * 3, np.zeros(shape))).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32) if affine else None
    beta = rng.normal(size=C).astype(np.float32) * 0.3 if affine else None
    shortcut = rng.normal(size=shape).astype(np.float32) if add else None
    dy = rng.normal(size=shape).astype(np.float32)
    y_ref, dx_ref, dgamma_ref, dbeta_ref, dsc_ref = reference(x, gamma, beta, shortcut, dy)

    xt = _t(x, device)
    mean, var = _core.batch_norm_stats(xt)
    g = _t(gamma, device) if affine else None
    b = _t(beta, device) if affine else None
    s = _t(shortcut, device) if add else None
    y = _core.batch_norm_act_forward(xt, mean, var, g, b, s, EPS)
    assert_close(_np(y), y_ref, "sum", "fused forward", device)
    sum_dz, sum_dz_xhat = _core.batch_norm_act_backward_reduce(xt, y, _t(dy, device), mean, var,
                                                               EPS)
    assert_close(_np(sum_dz), dbeta_ref, "sum", "sum(dz) = dbeta", device)
    assert_close(_np(sum_dz_xhat), dgamma_ref, "sum", "sum(dz * xhat) = dgamma", device)
    count = float(x.size // C)
    dx, dsc = _core.batch_norm_act_backward(xt, y, _t(dy, device), mean, var, g, sum_dz,
                                            sum_dz_xhat, count, EPS, add)
    assert_close(_np(dx), dx_ref, "sum", "fused dx", device)
    if add:
        assert_close(_np(dsc), dsc_ref, "elementwise", "the shortcut's gradient", device)
    else:
        assert dsc is None


def test_fused_kernels_equal_the_unfused_ops_bitwise():
    """On CPU the one-pass kernels give the bits of batch_norm_forward + add + relu and of
    relu_backward + batch_norm_backward_reduce + batch_norm_backward (what the fused step relies
    on for fusion on == fusion off)."""
    rng = np.random.default_rng(3)
    shape = (3, 5, 7, 9)
    x, s, dy = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    gamma, beta = rng.uniform(0.5, 1.5, 5).astype(np.float32), rng.normal(size=5).astype(np.float32)
    dev = mgpu.cpu(0)
    xt, st, dyt, gt, bt = (_t(a, dev) for a in (x, s, dy, gamma, beta))
    mean, var = _core.batch_norm_stats(xt)
    y = _core.batch_norm_act_forward(xt, mean, var, gt, bt, st, EPS)
    z = mgpu.Tensor(_core.batch_norm_forward(xt, mean, var, gt, bt, EPS)) + mgpu.Tensor(st)
    y_unfused = np.maximum(z.numpy(), 0)
    np.testing.assert_array_equal(_np(y), y_unfused)
    dz = np.where(y_unfused > 0, dy, 0).astype(np.float32)
    dzt = _t(dz, dev)
    a, b = _core.batch_norm_backward_reduce(xt, dzt, mean, var, EPS)
    a2, b2 = _core.batch_norm_act_backward_reduce(xt, y, dyt, mean, var, EPS)
    np.testing.assert_array_equal(_np(a2), _np(a))
    np.testing.assert_array_equal(_np(b2), _np(b))
    dx = _core.batch_norm_backward(xt, dzt, mean, var, gt, a, b, 3 * 7 * 9, EPS, True)
    dx2, dsc = _core.batch_norm_act_backward(xt, y, dyt, mean, var, gt, a, b, 3 * 7 * 9, EPS, True)
    np.testing.assert_array_equal(_np(dx2), _np(dx))
    np.testing.assert_array_equal(_np(dsc), dz)


# batch_norm_backward_full's channel groups: one channel per task (big planes), several with a
# last group cut short (C = 37 at 4x4: groups of 4), HW a multiple of 16 or not, HW = 1 (2-d x),
# C = 1 and 3, batch 1.
FULL_SHAPES = [(3, 1, 5, 7), (2, 3, 3, 3), (5, 3), (1, 4, 1, 17), (4, 16, 6, 6), (3, 37, 4, 4),
               (2, 19, 7, 7), (2, 2, 64, 64), (40, 9)]


@pytest.mark.parametrize("shape", FULL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", ["bn", "bn_relu", "bn_add_relu"])
def test_backward_full_against_float64_and_the_two_ops(device, shape, kind):
    """batch_norm_backward_full (the sums and dx in one op, what the step runs without
    synchronised statistics) against float64, and bitwise equal to the reduce + dx ops it
    replaces (plain: batch_norm_backward_reduce + batch_norm_backward; with y:
    batch_norm_act_backward_reduce + batch_norm_act_backward; with y on CPU devices only)."""
    if kind != "bn" and device.kind != _core.DeviceKind.CPU:
        pytest.skip("the fused relu's kernels are CPU kernels (test_fusion_choice)")
    rng = np.random.default_rng(hash((shape, kind)) % 2**32)
    C = shape[1]
    x = (rng.normal(size=shape) * _per_channel(rng.uniform(0.5, 2.0, C), np.zeros(shape))
         + _per_channel(rng.normal(size=C) * 3, np.zeros(shape))).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    beta = rng.normal(size=C).astype(np.float32) * 0.3
    shortcut = rng.normal(size=shape).astype(np.float32) if kind == "bn_add_relu" else None
    dy = rng.normal(size=shape).astype(np.float32)
    count = float(x.size // C)
    xt, dyt, g, b = _t(x, device), _t(dy, device), _t(gamma, device), _t(beta, device)
    mean, var = _core.batch_norm_stats(xt)
    if kind == "bn":
        dx_ref, dgamma_ref, dbeta_ref = ref.batch_norm_train_backward(x, gamma, dy, eps=EPS)
        yt = None
        a, b2 = _core.batch_norm_backward_reduce(xt, dyt, mean, var, EPS)
        dx_two = _core.batch_norm_backward(xt, dyt, mean, var, g, a, b2, count, EPS, True)
        dsc_two = None
    else:
        _, dx_ref, dgamma_ref, dbeta_ref, dsc_ref = reference(x, gamma, beta, shortcut, dy)
        sc = _t(shortcut, device) if shortcut is not None else None
        yt = _core.batch_norm_act_forward(xt, mean, var, g, b, sc, EPS)
        a, b2 = _core.batch_norm_act_backward_reduce(xt, yt, dyt, mean, var, EPS)
        dx_two, dsc_two = _core.batch_norm_act_backward(xt, yt, dyt, mean, var, g, a, b2, count,
                                                        EPS, True)
    want_sc = kind != "bn"
    s1, s2, dx, dsc = _core.batch_norm_backward_full(xt, yt, dyt, mean, var, g, EPS, True, want_sc)
    assert_close(_np(s1), dbeta_ref, "sum", "sum(dz) = dbeta", device)
    assert_close(_np(s2), dgamma_ref, "sum", "sum(dz * xhat) = dgamma", device)
    assert_close(_np(dx), dx_ref, "sum", "dx", device)
    np.testing.assert_array_equal(_np(s1), _np(a))
    np.testing.assert_array_equal(_np(s2), _np(b2))
    np.testing.assert_array_equal(_np(dx), _np(dx_two))
    if want_sc:
        assert_close(_np(dsc), dsc_ref, "elementwise", "the shortcut's gradient", device)
        np.testing.assert_array_equal(_np(dsc), _np(dsc_two))
    else:
        assert dsc is None
    # The sums alone, and the shortcut's gradient without dx: the same bits.
    t1, t2, no_dx, dsc_only = _core.batch_norm_backward_full(xt, yt, dyt, mean, var, g, EPS,
                                                             False, want_sc)
    assert no_dx is None
    np.testing.assert_array_equal(_np(t1), _np(s1))
    np.testing.assert_array_equal(_np(t2), _np(s2))
    if want_sc:
        np.testing.assert_array_equal(_np(dsc_only), _np(dsc))


def test_backward_full_rejects_bad_arguments():
    dev = mgpu.cpu(0)
    xt = _t(np.ones((2, 3, 4, 4)), dev)
    mean, var = _core.batch_norm_stats(xt)
    with pytest.raises(ValueError, match="needs y"):
        _core.batch_norm_backward_full(xt, None, xt, mean, var, None, EPS, True, True)
    with pytest.raises(ValueError, match="dy has shape"):
        _core.batch_norm_backward_full(xt, None, _t(np.ones((2, 3, 4)), dev), mean, var, None,
                                       EPS, True, False)
    with pytest.raises(ValueError, match="eps"):
        _core.batch_norm_backward_full(xt, xt, xt, mean, var, None, 0.0, True, False)


def test_fused_kernels_reject_a_misshaped_shortcut_and_y():
    dev = mgpu.cpu(0)
    xt = _t(np.ones((2, 3, 4, 4)), dev)
    mean, var = _core.batch_norm_stats(xt)
    with pytest.raises(ValueError, match="shortcut has shape"):
        _core.batch_norm_act_forward(xt, mean, var, None, None, _t(np.ones((2, 3, 4, 5)), dev),
                                     EPS)
    with pytest.raises(ValueError, match="y has shape"):
        _core.batch_norm_act_backward_reduce(xt, _t(np.ones((2, 3, 4)), dev), xt, mean, var, EPS)


# --- the fused step: fusion on equals fusion off ----------------------------------------------

def _run(make_net, devices, X, y, fuse, monkeypatch, steps=2, sync=False):
    """Steps of the fused step (momentum, weight decay) with MGPU_FUSE_LAYERS as given -> (losses,
    state dict, evaluation logits, (batch_norm+relu, batch_norm+add+relu) counts)."""
    monkeypatch.setenv("MGPU_FUSE_LAYERS", "1" if fuse else "0")
    net = make_net()
    if sync:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = nn.DataParallel(net, device_ids=devices)
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss = nn.CrossEntropyLoss()
    Xt, yt = mgpu.array(X, device=devices[0]), mgpu.array(y, device=devices[0])
    losses = [model.train_step(Xt, yt, loss, trainer).item() for _ in range(steps)]
    counts = model._fused.model._model.fused_layers()
    logits = model._fused.model._model.forward(Xt._t, 0)
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    return losses, state, _np(logits), counts


def _fusion_on_equals_off(make_net, devices, X, y, monkeypatch, counts, sync=False, steps=2):
    on = _run(make_net, devices, X, y, True, monkeypatch, steps, sync)
    off = _run(make_net, devices, X, y, False, monkeypatch, steps, sync)
    assert on[3] == counts, f"fusion made {on[3]} layers, expected {counts}"
    assert off[3] == (0, 0)
    assert on[0] == off[0], f"losses {on[0]} != {off[0]}"
    assert on[1].keys() == off[1].keys()
    for k in on[1]:
        np.testing.assert_array_equal(on[1][k], off[1][k], err_msg=k)
    np.testing.assert_array_equal(on[2], off[2], err_msg="evaluation logits")


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("sync", [False, True], ids=["per_replica", "sync"])
def test_small_residual_net_fusion_on_equals_off_bitwise(k, sync, monkeypatch):
    X, y = batch(7)
    _fusion_on_equals_off(tiny_net, [mgpu.cpu(i) for i in range(k)], X, y, monkeypatch, (2, 1),
                          sync)


def _resnet():
    mgpu.random.seed(1)
    return resnet18(10, 1)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("sync", [False, True], ids=["per_replica", "sync"])
def test_resnet18_fusion_on_equals_off_bitwise(k, sync, monkeypatch):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(4, 1, 12, 12)).astype(np.float32)
    y = rng.integers(0, 10, size=4)
    _fusion_on_equals_off(_resnet, [mgpu.cpu(i) for i in range(k)], X, y, monkeypatch, (9, 8),
                          sync, steps=1)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("sync", [False, True], ids=["per_replica", "sync"])
def test_no_fusion_on_emulated_gpus(k, sync, monkeypatch):
    """A Model built for GPUs keeps batch norm, add and relu as given (the fused layers' kernels
    are CPU kernels), whatever MGPU_FUSE_LAYERS says."""
    if mgpu.num_gpus() < k:
        pytest.skip(f"needs {k} GPUs (emulated build), this build has {mgpu.num_gpus()}")
    X, y = batch(7)
    _fusion_on_equals_off(tiny_net, [mgpu.gpu(i) for i in range(k)], X, y, monkeypatch, (0, 0),
                          sync)


def test_fusion_keeps_bn_whose_output_has_another_reader(monkeypatch):
    """A batch norm whose output feeds a relu and something else is not fused (its output must
    exist as a tensor), and the step still equals the unfused one."""
    from mgpu.parallel import FusedModel

    C = 3
    spec = [("batch_norm", {}), ("relu", {}), ("add", {"in": [1, 2]}), ("relu", {}),
            ("global_avg_pool", {}), ("flatten", {}), ("linear", {"transpose": True})]
    out = []
    for fuse in (True, False):
        monkeypatch.setenv("MGPU_FUSE_LAYERS", "1" if fuse else "0")
        params = [mgpu.array(np.array([0.7, 1.2, 0.9], np.float32)),
                  mgpu.array(np.array([0.1, -0.2, 0.3], np.float32)),
                  mgpu.array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10),
                  mgpu.array(np.zeros(4, np.float32))]
        bufs = [mgpu.array(np.zeros(C, np.float32)), mgpu.array(np.ones(C, np.float32))]
        m = FusedModel(spec, [params], [bufs], [mgpu.cpu(0)])
        X = mgpu.array(np.random.default_rng(0).normal(size=(3, C, 4, 4)).astype(np.float32))
        Y = mgpu.array(np.array([0, 1, 3]))
        loss = m.train_step(X, Y, 0.5)
        out.append((m._model.fused_layers(), loss[0].item(),
                    [p.numpy().copy() for p in params], [b.numpy().copy() for b in bufs]))
    assert out[0][0] == (0, 0) and out[1][0] == (0, 0)
    assert out[0][1] == out[1][1]
    for a, b in zip(out[0][2] + out[0][3], out[1][2] + out[1][3]):
        np.testing.assert_array_equal(a, b)
