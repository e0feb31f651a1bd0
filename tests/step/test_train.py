"""The fused data-parallel step (sec. 12.5.6): k devices with global batch b take the step of one
device with batch b, and the chapter's op-by-op step (autograd, Python allreduce) takes it too.
"""
import numpy as np
import pytest

import mgpu
import reference as R
from conftest import assert_close, requires_fashion_mnist
from mgpu import chapter


def _problem(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    # A larger init than the chapter's 0.01, so every gradient is well away from zero and a
    # wrong reduction cannot hide below the tolerance.
    params = mgpu.lenet_params(scale=0.1, seed=seed)
    return X, y, params


def _replicas(params, k):
    devices = [mgpu.cpu(i) for i in range(k)]
    return devices, [mgpu.get_params(params, d) for d in devices]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [12, 13, 2])
def test_fused_step_matches_reference_on_every_replica(k, n):
    """n=13 does not divide by 2, 3 or 4; n=2 gives empty shards on 3 and 4 devices."""
    Xn, yn, params = _problem(n)
    expected = R.train_step_reference(Xn, yn, [p.numpy() for p in params], lr=0.2)
    devices, replicas = _replicas(params, k)
    losses = mgpu.train_batch(mgpu.array(Xn), mgpu.array(yn), replicas, devices, lr=0.2)
    for d, replica in zip(devices, replicas):
        for i, (p, e) in enumerate(zip(replica, expected)):
            assert p.device == d
            assert_close(p.numpy(), e, "sum", f"param {i} after the fused step", d)
    ref_loss = R.softmax_cross_entropy_forward(
        R.lenet_forward(Xn, [p.numpy() for p in params]), yn).sum()
    assert_close(sum(v.item() for v in losses), ref_loss, "sum", "summed loss")


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [12, 13, 3])
def test_fused_step_equals_chapter_op_by_op_step(k, n):
    Xn, yn, params = _problem(n, seed=1)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    devices, fused = _replicas(params, k)
    _, op_by_op = _replicas(params, k)
    mgpu.train_batch(X, y, fused, devices, lr=0.1)
    chapter.train_batch(X, y, op_by_op, devices, lr=0.1)
    for c in range(k):
        for i, (a, b) in enumerate(zip(fused[c], op_by_op[c])):
            # The same kernels in the same order: equal to float32 rounding, here exactly.
            assert_close(a.numpy(), b.numpy(), "elementwise", f"param {i} fused vs op-by-op",
                         devices[c])
            assert np.all(op_by_op[c][i].grad.numpy() == 0), "chapter sgd zeroes the grads"


def test_k_devices_equal_one_device_over_many_steps():
    """Ten steps of the same batches on 1 and on 3 devices stay together."""
    rng = np.random.default_rng(7)
    params = mgpu.lenet_params(scale=0.1, seed=7)
    batches = [(mgpu.array(rng.random((16, 1, 28, 28), dtype=np.float32)),
                mgpu.array(rng.integers(0, 10, 16))) for _ in range(10)]
    runs = []
    for k in (1, 3):
        devices, replicas = _replicas(params, k)
        for X, y in batches:
            mgpu.train_batch(X, y, replicas, devices, lr=0.1)
        runs.append(replicas)
    for i, (a, b) in enumerate(zip(runs[0][0], runs[1][2])):
        assert_close(b.numpy(), a.numpy(), "sum", f"param {i} after 10 steps, 3 vs 1 devices")


def test_replicas_stay_identical():
    Xn, yn, params = _problem(13, seed=3)
    devices, replicas = _replicas(params, 3)
    for _ in range(3):
        mgpu.train_batch(mgpu.array(Xn), mgpu.array(yn), replicas, devices, lr=0.2)
    for i in range(8):
        first = replicas[0][i].numpy()
        for c in (1, 2):
            # The all-reduce sums in one fixed order and every replica applies the same
            # update, so the copies are bitwise equal, not merely close.
            assert np.array_equal(replicas[c][i].numpy(), first), f"param {i} replica {c}"


def test_evaluate_accuracy_on_all_devices_matches_numpy():
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=50).astype(np.uint8)
    params = mgpu.lenet_params(scale=0.3, seed=5)
    X = images[:, None].astype(np.float64) / 255.0
    logits = R.lenet_forward(X, [p.numpy() for p in params])
    expected = float(np.mean(np.argmax(logits, axis=1) == labels))
    loader = mgpu.data.array_loader(images, labels, batch_size=16)
    for k in (1, 2, 3):
        devices, replicas = _replicas(params, k)
        got = mgpu.evaluate_accuracy(replicas, loader, devices)
        assert got == pytest.approx(expected, abs=1e-12)
    one = mgpu.evaluate_accuracy_gpu(lambda x: mgpu.lenet(x, params), loader)
    assert one == pytest.approx(expected, abs=1e-12)


@requires_fashion_mnist
def test_short_training_run_on_real_data_learns():
    """300 fused steps on two devices: the loss falls and the accuracy beats chance by far."""
    result = mgpu.train(num_gpus=2, batch_size=128, lr=0.5, num_epochs=2, limit_batches=150,
                        seed=0, params=mgpu.lenet_params(scale=0.1, seed=0), progress=False)
    assert len(result.test_acc) == 2 and len(result.epoch_times) == 2
    assert result.train_loss[-1] < 0.8 * np.log(10), result.train_loss
    assert result.train_loss[-1] < result.train_loss[0]
    assert result.test_acc[-1] > 0.5, result.test_acc


# NaN through the fused conv + relu + avg-pool layer (LeNet's blocks): relu keeps NaN, as IEEE,
# PyTorch and mgpu.relu do, so a NaN pixel reaches its image's logits and loss instead of
# vanishing in relu's mask. CPU devices run the fused kernels (both ISA paths: .ci/test.sh runs
# this file again with MGPU_ISA=avx2), GPUs the three ops.

def _nan_images(n, bad, seed=0):
    X = np.random.default_rng(seed).random((n, 1, 28, 28)).astype(np.float32)
    X[bad, 0, 3, 5] = np.nan
    return X


def test_fused_conv_relu_pool_propagates_nan(device):
    rng = np.random.default_rng(1)
    W = (0.3 * rng.standard_normal((4, 1, 5, 5))).astype(np.float32)
    b = np.full(4, -5.0, np.float32)  # every conv output negative: relu's mask is all zeros
    L = (0.1 * rng.standard_normal((3, 4 * 12 * 12))).astype(np.float32)
    spec = [("conv2d_relu_pool", {"pool": 2}), ("flatten",), ("linear", {"transpose": True})]
    params = [mgpu.array(a, device=device) for a in (W, b, L, np.zeros(3, np.float32))]
    model = mgpu.parallel.FusedModel(spec, [params], [[]], [device])
    X = _nan_images(3, bad=1)
    logits = model.forward(mgpu.array(X, device=device)).numpy()
    assert np.isnan(logits[1]).all(), "the NaN pixel vanished in relu"
    assert np.array_equal(logits[[0, 2]], np.zeros((2, 3), np.float32))
    # The op-by-op chain agrees where the NaN went.
    pooled = mgpu.avg_pool2d(mgpu.relu(mgpu.conv2d(mgpu.array(X, device=device),
                                                   params[0], params[1])), 2).numpy()
    assert np.isnan(pooled[1]).any() and not np.isnan(pooled[[0, 2]]).any()


@pytest.mark.parametrize("k", [1, 2])
def test_lenet_fused_step_on_a_nan_image_gives_a_non_finite_loss(k):
    X = _nan_images(8, bad=7)
    y = np.arange(8) % 10
    devices = [mgpu.try_gpu(i) for i in range(k)]
    reps = [mgpu.get_params(mgpu.lenet_params(scale=0.1, seed=0), d) for d in devices]
    losses = [t.item() for t in mgpu.train_batch(mgpu.array(X), mgpu.array(y), reps, devices, 0.1)]
    assert not np.isfinite(losses[-1]), f"the NaN image's loss is {losses}"
    if k == 2:
        assert np.isfinite(losses[0]), "the other device's shard has no NaN"
    data = ([(mgpu.array(X), mgpu.array(y))] * 2, [(mgpu.array(X), mgpu.array(y))])
    with pytest.raises(FloatingPointError, match=r"epoch 1, step 1"):
        mgpu.train(k, 8, 0.1, 1, data=data, params=mgpu.lenet_params(scale=0.1, seed=0),
                   progress=False)
