"""The fused step of any list of layers (mgpu.parallel.FusedModel, _core.Model): a small residual
net's steps against a float64 NumPy reference, k devices against one, and bad specs.
"""
import numpy as np
import pytest

import mgpu
import reference as R
from conftest import assert_close
from mgpu.parallel import FusedModel

# conv 3x3 -> relu -> [conv 3x3 stride 2 -> relu -> conv 3x3] + conv 1x1 stride 2 (shortcut from
# slot 2, which therefore fans out) -> relu -> global average pool -> flatten -> linear (out, in).
RESIDUAL_SPEC = [
    ("conv2d", {"padding": 1}),                          # slot 1, params 0, 1
    ("relu",),                                           # slot 2
    ("conv2d", {"stride": 2, "padding": 1}),             # slot 3, params 2, 3
    ("relu",),                                           # slot 4
    ("conv2d", {"padding": 1, "bias": False}),           # slot 5, param 4
    ("conv2d", {"in": 2, "stride": 2, "bias": False}),   # slot 6, param 5
    ("add", {"in": [5, 6]}),                             # slot 7
    ("relu",),                                           # slot 8
    ("global_avg_pool",),                                # slot 9
    ("flatten",),                                        # slot 10
    ("linear", {"transpose": True}),                     # slot 11, params 6, 7
]


def residual_params(rng, C=2, K=4, classes=3):
    shapes = [(K, C, 3, 3), (K,), (K, K, 3, 3), (K,), (K, K, 3, 3), (K, K, 1, 1), (classes, K),
              (classes,)]
    return [(0.4 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def residual_loss_and_grads(X, y, p):
    """float64 forward and backward of RESIDUAL_SPEC's summed softmax cross-entropy."""
    s1 = R.conv2d_forward(X, p[0], p[1], 1, 1)
    s2 = R.relu_forward(s1)
    s3 = R.conv2d_forward(s2, p[2], p[3], 2, 1)
    s4 = R.relu_forward(s3)
    s5 = R.conv2d_forward(s4, p[4], None, 1, 1)
    s6 = R.conv2d_forward(s2, p[5], None, 2, 0)
    s7 = s5 + s6
    s8 = R.relu_forward(s7)
    s9 = s8.mean(axis=(2, 3))
    logits = s9 @ np.float64(p[6]).T + p[7]
    loss = R.softmax_cross_entropy_forward(logits, y).sum()
    dz = R.softmax_cross_entropy_backward(logits, y, np.ones(len(y)))
    g = [None] * 8
    g[6], g[7] = dz.T @ s9, dz.sum(axis=0)
    d9 = dz @ np.float64(p[6])
    d8 = np.broadcast_to(d9[:, :, None, None] / (s8.shape[2] * s8.shape[3]), s8.shape)
    d7 = R.relu_backward(s7, d8)
    d4, g[4], _ = R.conv2d_backward(s4, p[4], d7, 1, 1, has_bias=False)
    d2_short, g[5], _ = R.conv2d_backward(s2, p[5], d7, 2, 0, has_bias=False)
    d3 = R.relu_backward(s3, d4)
    d2_main, g[2], g[3] = R.conv2d_backward(s2, p[2], d3, 2, 1)
    d1 = R.relu_backward(s1, d2_main + d2_short)
    _, g[0], g[1] = R.conv2d_backward(X, p[0], d1, 1, 1)
    return loss, g


def sgd_reference(X, y, params, steps, lr, momentum, wd):
    """PyTorch's SGD on the mean loss, float64."""
    p = [np.float64(a) for a in params]
    bufs = None
    for _ in range(steps):
        _, g = residual_loss_and_grads(X, y, p)
        d = [gi / len(y) + wd * pi for gi, pi in zip(g, p)]
        bufs = d if bufs is None else [momentum * b + di for b, di in zip(bufs, d)]
        p = [pi - lr * b for pi, b in zip(p, bufs)]
    return p, bufs


def make(params, devices, spec=RESIDUAL_SPEC):
    replicas = [[mgpu.array(a, device=d) for a in params] for d in devices]
    return FusedModel(spec, replicas, [[] for _ in devices], devices), replicas


def problem(n=6, seed=0, H=7):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 2, H, H)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    return X, y, residual_params(rng)


def wide_linear_problem():
    """Four linear layers with relus, 1.4 M parameters, on 5 examples of 2x2x2: (spec, params, X,
    y)."""
    spec = [("flatten",), ("linear",), ("relu",), ("linear",), ("relu",), ("linear",), ("relu",),
            ("linear",)]
    rng = np.random.default_rng(7)
    shapes = [(8, 1100), (1100,), (1100, 1000), (1000,), (1000, 300), (300,), (300, 3), (3,)]
    params = [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes]
    X = rng.standard_normal((5, 2, 2, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=5)
    return spec, params, X, y


def test_residual_net_two_steps_match_float64_sgd_with_momentum_and_weight_decay():
    X, y, params = problem()
    model, replicas = make(params, [mgpu.cpu(0)])
    for _ in range(2):
        losses = model.train_step(mgpu.array(X), mgpu.array(y), lr=0.3, momentum=0.9,
                                  weight_decay=0.05)
    expected, bufs = sgd_reference(X, y, params, 2, 0.3, 0.9, 0.05)
    for i, (p, e) in enumerate(zip(replicas[0], expected)):
        assert_close(p.numpy(), e, "sum", f"param {i}")
    for i, (b, e) in enumerate(zip(model.momentum_buffers(0), bufs)):
        assert_close(b.numpy(), e, "sum", f"momentum buffer {i}")
    # The loss returned is the second step's, before its update.
    p1, _ = sgd_reference(X, y, params, 1, 0.3, 0.9, 0.05)
    loss1, _ = residual_loss_and_grads(X, y, p1)
    assert_close(losses[0].numpy(), loss1, "sum", "summed loss")


def test_first_step_gradient_sums_both_paths_of_the_fanned_out_slot():
    """Plain SGD, one step: p - lr * g / N shows every parameter's gradient directly."""
    X, y, params = problem(seed=3)
    model, replicas = make(params, [mgpu.cpu(0)])
    model.train_step(mgpu.array(X), mgpu.array(y), lr=1.0)
    _, g = residual_loss_and_grads(X, y, [np.float64(a) for a in params])
    for i, (p, p0, gi) in enumerate(zip(replicas[0], params, g)):
        assert_close((p0 - p.numpy()) * len(y), gi, "sum", f"gradient of param {i}")
    assert model.momentum_buffers(0) == [None] * len(params)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("n", [6, 7, 2])
def test_k_cpu_devices_equal_one_device_on_the_whole_batch(k, n):
    """n = 7 splits unevenly; n = 2 leaves the third device an empty shard."""
    X, y, params = problem(n=n, seed=1)
    one, reps1 = make(params, [mgpu.cpu(0)])
    many, repsk = make(params, [mgpu.cpu(i) for i in range(k)])
    for _ in range(2):
        l1 = one.train_step(mgpu.array(X), mgpu.array(y), lr=0.2, momentum=0.5, weight_decay=0.01)
        lk = many.train_step(mgpu.array(X), mgpu.array(y), lr=0.2, momentum=0.5,
                             weight_decay=0.01)
    assert_close(sum(float(t.numpy()) for t in lk), float(l1[0].numpy()), "sum", "loss")
    for d in range(k):
        for i, (p, e) in enumerate(zip(repsk[d], reps1[0])):
            assert p.device == mgpu.cpu(d)
            assert_close(p.numpy(), e.numpy(), "sum", f"param {i} of replica {d}")


def test_lenet_spec_equals_train_batch_bitwise_on_sum_rule():
    """The LeNet model through the generic Model with momentum 0 and the mean rule equals
    train_batch's sum rule up to float rounding of lr / N."""
    params = [p.numpy() for p in mgpu.lenet_params(scale=0.1, seed=2)]
    rng = np.random.default_rng(2)
    X = rng.random((8, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=8)
    spec = [("conv2d_relu_pool", {"pool": 2}), ("conv2d_relu_pool", {"pool": 2}), ("flatten",),
            ("linear",), ("relu",), ("linear",)]
    model, reps = make(params, [mgpu.cpu(0), mgpu.cpu(1)], spec)
    model.train_step(mgpu.array(X), mgpu.array(y), lr=0.5)
    lenet = [[mgpu.array(a, device=d) for a in params] for d in (mgpu.cpu(0), mgpu.cpu(1))]
    mgpu.train_batch(mgpu.array(X), mgpu.array(y), lenet, [mgpu.cpu(0), mgpu.cpu(1)], lr=0.5)
    for i, (a, b) in enumerate(zip(reps[1], lenet[1])):
        assert_close(a.numpy(), b.numpy(), "elementwise", f"param {i}")
    counts = model.evaluate_counts(mgpu.array(X), mgpu.array(y))
    logits = R.lenet_forward(X, [p.numpy() for p in reps[0]])
    assert sum(float(c.numpy()) for c in counts) == float((logits.argmax(1) == y).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2])
def test_emulated_gpus_match_one_cpu_device(k):
    if mgpu.num_gpus() < k:
        pytest.skip(f"needs {k} GPUs (emulated), this build has {mgpu.num_gpus()}")
    X, y, params = problem(n=4, seed=4, H=5)
    one, reps1 = make(params, [mgpu.cpu(0)])
    gpus, repsg = make(params, [mgpu.gpu(i) for i in range(k)])
    for _ in range(2):
        one.train_step(mgpu.array(X), mgpu.array(y), lr=0.2, momentum=0.9)
        gpus.train_step(mgpu.array(X), mgpu.array(y), lr=0.2, momentum=0.9)
    for d in range(k):
        for i, (p, e) in enumerate(zip(repsg[d], reps1[0])):
            assert p.device == mgpu.gpu(d)
            assert_close(p.numpy(), e.numpy(), "sum", f"param {i} of gpu({d})")


def test_bad_label_raises_and_leaves_parameters_unchanged():
    X, y, params = problem()
    model, reps = make(params, [mgpu.cpu(0), mgpu.cpu(1)])
    y[3] = 3
    with pytest.raises(IndexError, match="label 3 in row 3 is out of range for 3 classes"):
        model.train_step(mgpu.array(X), mgpu.array(y), lr=0.1, momentum=0.9)
    for d in range(2):
        for p, p0 in zip(reps[d], params):
            np.testing.assert_array_equal(p.numpy(), p0)


def _build(spec, shapes=None, devices=None, buffers=None):
    rng = np.random.default_rng(0)
    devices = devices or [mgpu.cpu(0)]
    params = [rng.standard_normal(s).astype(np.float32) for s in
              (shapes or [(4, 2, 3, 3), (4,), (3, 4), (3,)])]
    replicas = [[mgpu.array(a, device=d) for a in params] for d in devices]
    return FusedModel(spec, replicas, buffers or [[] for _ in devices], devices)


SMALL = [("conv2d", {"padding": 1}), ("global_avg_pool",), ("flatten",),
         ("linear", {"transpose": True})]


@pytest.mark.parametrize("spec, shapes, error, match", [
    ([("maxpool",)] + SMALL, None, ValueError, r"layer 0 \(maxpool\) is not a known layer"),
    ([("conv2d", {"padding": 1}), ("add", {"in": [1, 4]})] + SMALL[1:], None, ValueError,
     r"layer 1 \(add\): input slot 4 is out of range"),
    (SMALL, [(4, 2, 3, 3), (5,), (3, 4), (3,)], ValueError,
     r"layer 0 \(conv2d\): the bias must have shape \(4,\)"),
    (SMALL, [(4, 2, 3, 3), (4,), (3, 4)], ValueError, r"layer 3 \(linear\).*parameters index 3 "
     "is out of range"),
    ([("conv2d", {"padding": 1, "dilation": 2})] + SMALL[1:], None, ValueError,
     r"layer 0 \(conv2d\): unknown option 'dilation'"),
    ([("conv2d", {"stride": 0})] + SMALL[1:], None, ValueError,
     r"layer 0 \(conv2d\): option stride must be an integer >= 1"),
    ([("conv2d", "padding")] + SMALL[1:], None, TypeError, r"spec entry 0 \(conv2d\): options "
     "must be a dict"),
    ([("conv2d", {"in": "x"})] + SMALL[1:], None, TypeError, r"option 'in' must be an int"),
    ([("conv2d", {"padding": 1})] + SMALL[1:] + [("relu",)], [(4, 2, 3, 3), (4,), (3, 4), (3,),
                                                              (2,)], ValueError,
     r"parameter 4 \(shape \(2,\)\) is used by no layer"),
])
def test_bad_spec_raises_naming_the_layer(spec, shapes, error, match):
    with pytest.raises(error, match=match):
        _build(spec, shapes)


def test_bad_replicas_raise():
    with pytest.raises(ValueError, match="two replicas are on cpu\\(0\\)"):
        _build(SMALL, devices=[mgpu.cpu(0), mgpu.cpu(0)])
    rng = np.random.default_rng(0)
    shapes = [(4, 2, 3, 3), (4,), (3, 4), (3,)]
    good = [mgpu.array(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    moved = good[:2] + [good[2].copyto(mgpu.cpu(1)), good[3]]
    with pytest.raises(ValueError, match="parameter 2 lives on cpu\\(1\\) but its replica's "
                                         "device is cpu\\(0\\)"):
        FusedModel(SMALL, [moved], [[]], [mgpu.cpu(0)])
    other = [good[0], good[1], mgpu.array(np.zeros((3, 5), np.float32)), good[3]]
    with pytest.raises(ValueError, match="parameter 2 has shape \\(3, 5\\) but the model was "
                                         "built for \\(3, 4\\)"):
        FusedModel(SMALL, [good, [g.copyto(mgpu.cpu(1)) for g in other]], [[], []],
                   [mgpu.cpu(0), mgpu.cpu(1)])
    with pytest.raises(TypeError, match="device_params\\[0\\]\\[1\\] is ndarray"):
        FusedModel(SMALL, [[good[0], np.zeros(4)]], [[]], [mgpu.cpu(0)])
    model = FusedModel(SMALL, [good], [[]], [mgpu.cpu(0)])
    with pytest.raises(ValueError, match="layer 0 \\(conv2d\\): conv2d_forward: x has 3 channels"):
        model.train_step(mgpu.array(np.zeros((2, 3, 5, 5), np.float32)),
                         mgpu.array(np.zeros(2, np.int64)), lr=0.1)
    wide = FusedModel(SMALL, [good[:2] + [mgpu.array(np.zeros((3, 5), np.float32)), good[3]]],
                      [[]], [mgpu.cpu(0)])
    with pytest.raises(ValueError, match="layer 3 \\(linear\\): the input has 4 features but "
                                         "the weight \\(3, 5\\) expects 5"):
        wide.train_step(mgpu.array(np.zeros((2, 2, 5, 5), np.float32)),
                        mgpu.array(np.zeros(2, np.int64)), lr=0.1)
    with pytest.raises(TypeError, match="X and y must be mgpu tensors"):
        model.train_step(np.zeros((2, 2, 5, 5), np.float32), mgpu.array(np.zeros(2)), lr=0.1)


BN_SPEC = [("conv2d", {"padding": 1, "bias": False}),  # params 0
           ("batch_norm", {"momentum": 0.2}),           # params 1, 2; buffers 0, 1
           ("relu",), ("global_avg_pool",), ("flatten",),
           ("linear", {"transpose": True})]             # params 3, 4


def bn_loss_and_grads(X, y, p, eps=1e-5):
    """float64 forward and backward of BN_SPEC on one shard: (loss, grads, batch mean, var)."""
    c = R.conv2d_forward(X, p[0], None, 1, 1)
    mean, var = c.mean(axis=(0, 2, 3)), c.var(axis=(0, 2, 3))
    inv = 1 / np.sqrt(var + eps)
    xhat = (c - mean[None, :, None, None]) * inv[None, :, None, None]
    z = xhat * p[1][None, :, None, None] + p[2][None, :, None, None]
    a = R.relu_forward(z)
    f = a.mean(axis=(2, 3))
    logits = f @ np.float64(p[3]).T + p[4]
    loss = R.softmax_cross_entropy_forward(logits, y).sum()
    dl = R.softmax_cross_entropy_backward(logits, y, np.ones(len(y)))
    g = [None] * 5
    g[3], g[4] = dl.T @ f, dl.sum(axis=0)
    da = np.broadcast_to((dl @ np.float64(p[3]))[:, :, None, None] / (a.shape[2] * a.shape[3]),
                         a.shape)
    dz = R.relu_backward(z, da)
    g[1], g[2] = (dz * xhat).sum(axis=(0, 2, 3)), dz.sum(axis=(0, 2, 3))
    m = c.shape[0] * c.shape[2] * c.shape[3]
    dxhat = dz * p[1][None, :, None, None]
    dc = inv[None, :, None, None] * (dxhat - dxhat.sum(axis=(0, 2, 3))[None, :, None, None] / m
                                     - xhat * (dxhat * xhat).sum(axis=(0, 2, 3))[None, :, None,
                                                                                 None] / m)
    _, g[0], _ = R.conv2d_backward(X, p[0], dc, 1, 1, has_bias=False)
    return loss, g, mean, var * m / (m - 1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batch_norm_per_replica_statistics_match_float64_shard_by_shard(k):
    """Each replica normalises with its shard's statistics; gradients are summed over shards;
    the running statistics are the first shard's, the same on every replica."""
    rng = np.random.default_rng(5)
    n = 7
    X = rng.standard_normal((n, 2, 5, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    params = [(0.5 * rng.standard_normal(s)).astype(np.float32)
              for s in [(4, 2, 3, 3), (4,), (4,), (3, 4), (3,)]]
    params[1] += 1.0
    devices = [mgpu.cpu(i) for i in range(k)]
    reps = [[mgpu.array(a, device=d) for a in params] for d in devices]
    bufs = [[mgpu.array(np.full(4, 0.5, np.float32), device=d),
             mgpu.array(np.full(4, 2.0, np.float32), device=d)] for d in devices]
    model = FusedModel(BN_SPEC, reps, bufs, devices)
    model.train_step(mgpu.array(X), mgpu.array(y), lr=0.4, momentum=0.9, weight_decay=0.01)

    shards = np.array_split(np.arange(n), k)
    p64 = [np.float64(a) for a in params]
    total = [np.zeros_like(a) for a in p64]
    for i, rows in enumerate(shards):
        _, g, mean, uvar = bn_loss_and_grads(X[rows], y[rows], p64)
        total = [t + gi for t, gi in zip(total, g)]
        if i == 0:
            rm, rv = 0.8 * 0.5 + 0.2 * mean, 0.8 * 2.0 + 0.2 * uvar
    expected = [p - 0.4 * (t / n + 0.01 * p) for p, t in zip(p64, total)]
    for d in range(k):
        for i, (p, e) in enumerate(zip(reps[d], expected)):
            assert_close(p.numpy(), e, "sum", f"param {i} of replica {d}")
        assert_close(bufs[d][0].numpy(), rm, "sum", f"running_mean of replica {d}")
        assert_close(bufs[d][1].numpy(), rv, "sum", f"running_var of replica {d}")
    # Evaluation uses the running statistics.
    logits = model.forward(mgpu.array(X), 0).numpy()
    c = R.conv2d_forward(X, reps[0][0].numpy(), None, 1, 1)
    z = ((c - rm[None, :, None, None]) / np.sqrt(rv + 1e-5)[None, :, None, None]
         * reps[0][1].numpy()[None, :, None, None] + reps[0][2].numpy()[None, :, None, None])
    pooled = R.relu_forward(z).mean(axis=(2, 3))
    ref = pooled @ np.float64(reps[0][3].numpy()).T + reps[0][4].numpy()
    assert_close(logits, ref, "sum", "evaluation logits")


def test_batch_norm_needs_more_than_one_value_per_channel():
    spec = [("batch_norm",), ("flatten",), ("linear", {"transpose": True})]
    model = FusedModel(spec, [[mgpu.array(np.ones(4, np.float32)),
                               mgpu.array(np.zeros(4, np.float32)),
                               mgpu.array(np.ones((3, 4), np.float32)),
                               mgpu.array(np.zeros(3, np.float32))]],
                       [[mgpu.array(np.zeros(4, np.float32)), mgpu.array(np.ones(4, np.float32))]],
                       [mgpu.cpu(0)])
    with pytest.raises(ValueError, match=r"layer 0 \(batch_norm\): expected more than 1 value "
                                         "per channel"):
        model.train_step(mgpu.array(np.ones((1, 4), np.float32)), mgpu.array(np.zeros(1, np.int64)),
                         lr=0.1)


@pytest.mark.gpu
def test_batch_norm_on_two_emulated_gpus_equals_two_cpu_devices():
    if mgpu.num_gpus() < 2:
        pytest.skip(f"needs 2 GPUs (emulated), this build has {mgpu.num_gpus()}")
    rng = np.random.default_rng(6)
    X = rng.standard_normal((4, 2, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=4)
    params = [(0.5 * rng.standard_normal(s)).astype(np.float32)
              for s in [(4, 2, 3, 3), (4,), (4,), (3, 4), (3,)]]
    out = []
    for devices in ([mgpu.cpu(0), mgpu.cpu(1)], [mgpu.gpu(0), mgpu.gpu(1)]):
        reps = [[mgpu.array(a, device=d) for a in params] for d in devices]
        bufs = [[mgpu.array(np.zeros(4, np.float32), device=d),
                 mgpu.array(np.ones(4, np.float32), device=d)] for d in devices]
        model = FusedModel(BN_SPEC, reps, bufs, devices)
        for _ in range(2):
            model.train_step(mgpu.array(X), mgpu.array(y), lr=0.3, momentum=0.9)
        out.append([t.numpy() for t in reps[1] + bufs[1]])
    for i, (c, g) in enumerate(zip(*out)):
        assert_close(g, c, "sum", f"state {i} of replica 1 on gpu(1)")


def test_three_buckets_reduce_in_order_on_two_cpu_devices():
    """Wide linear layers make three gradient buckets (256 KB first, then 4 MB caps)."""
    spec, params, X, y = wide_linear_problem()
    one, reps1 = make(params, [mgpu.cpu(0)], spec)
    two, reps2 = make(params, [mgpu.cpu(0), mgpu.cpu(1)], spec)
    assert two._model.buckets == [(0, 301203), (301203, 1402203), (1402203, 1412103)]
    for _ in range(2):
        one.train_step(mgpu.array(X), mgpu.array(y), lr=0.1, momentum=0.9)
        two.train_step(mgpu.array(X), mgpu.array(y), lr=0.1, momentum=0.9)
    for i, (p, e, p0) in enumerate(zip(reps2[1], reps1[0], params)):
        assert not np.array_equal(p.numpy(), p0), f"param {i} did not move"
        assert_close(p.numpy(), e.numpy(), "sum", f"param {i} of replica 1")


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_a_replica_failing_while_enqueued_does_not_hang_the_gpus_that_joined(graphs, monkeypatch):
    """Shards of 2 and 1 rows: batch norm on (N, C) fails on gpu(1) only (without graphs after
    gpu(0) has joined the all-reduce); gpu(0) is released and the next step works."""
    monkeypatch.setenv("MGPU_CUDA_GRAPH", graphs)
    if mgpu.num_gpus() < 2:
        pytest.skip(f"needs 2 GPUs (emulated), this build has {mgpu.num_gpus()}")
    spec = [("flatten",), ("batch_norm",), ("linear", {"transpose": True})]
    devices = [mgpu.gpu(0), mgpu.gpu(1)]
    reps = [[mgpu.array(a, device=d) for a in (np.ones(4, np.float32), np.zeros(4, np.float32),
                                                np.ones((3, 4), np.float32),
                                                np.zeros(3, np.float32))] for d in devices]
    bufs = [[mgpu.array(np.zeros(4, np.float32), device=d),
             mgpu.array(np.ones(4, np.float32), device=d)] for d in devices]
    model = FusedModel(spec, reps, bufs, devices)
    X = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="expected more than 1 value per channel"):
        model.train_step(mgpu.array(X), mgpu.array(np.zeros(3, np.int64)), lr=0.1)
    try:
        mgpu.waitall()
    except mgpu.DeviceError as e:  # gpu(0)'s released part reports why
        assert "another device's part" in str(e)
    model.train_step(mgpu.array(np.vstack([X, X])), mgpu.array(np.zeros(6, np.int64)), lr=0.1)
    assert np.isfinite(reps[1][2].numpy()).all()
