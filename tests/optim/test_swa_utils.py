"""mgpu.optim.swa_utils.update_bn against PyTorch's semantics, with NumPy float64 references:
every tracking batch-norm layer ends with the plain average of its batches' means and unbiased
variances (under the layers below it in training mode), its count the number of batches; the
momenta and the model's mode come back; what it must leave alone, it does."""
import numpy as np
import pytest

import mgpu
from mgpu import nn
from mgpu.optim.swa_utils import update_bn

SIZES = (5, 3, 8)  # images per batch: unequal, so a size-weighted mean would differ


def batches(seed=0, channels=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, channels, 4, 4)) * (1 + c) + c).astype(np.float32)
            for c, n in enumerate(SIZES)]


def stats64(xs):
    """The plain average over batches of each batch's channel means and unbiased variances."""
    means = [x.astype(np.float64).mean(axis=(0, 2, 3)) for x in xs]
    vars_ = [x.astype(np.float64).var(axis=(0, 2, 3), ddof=1) for x in xs]
    return np.mean(means, axis=0), np.mean(vars_, axis=0)


def warmed(model, seed=9):
    """model after a few training steps' forwards on other data: running statistics far from
    (0, 1), count 3."""
    model.train()
    for x in batches(seed):
        model(mgpu.array(x * 3 + 2))
    return model


def test_one_layer_plain_average_of_the_batches():
    bn = nn.BatchNorm2d(3)
    model = warmed(nn.Sequential(bn)).eval()
    xs = batches()
    update_bn([(mgpu.array(x), mgpu.array(np.zeros(len(x), np.int64))) for x in xs], model)
    mean, var = stats64(xs)
    np.testing.assert_allclose(bn.running_mean.numpy(), mean, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(bn.running_var.numpy(), var, rtol=2e-6)
    assert int(bn.num_batches_tracked.item()) == len(xs)
    assert bn.momentum == 0.1 and not model.training and not bn.training


def test_a_deeper_layer_sees_the_layers_below_in_training_mode():
    first, conv, second = nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2, momentum=0.3)
    model = warmed(nn.Sequential(first, nn.ReLU(), conv, second))
    xs = batches(1)
    update_bn((mgpu.array(x) for x in xs), model)  # bare inputs, a generator
    w = conv.weight.numpy().astype(np.float64)[:, :, 0, 0]
    b = conv.bias.numpy().astype(np.float64)
    hidden = []
    for x in xs:
        x = x.astype(np.float64)
        mu, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
        h = np.maximum((x - mu) / np.sqrt(var + 1e-5), 0.0)  # batch statistics, gamma 1, beta 0
        hidden.append(np.einsum("kc,nchw->nkhw", w, h) + b[None, :, None, None])
    mean, var = stats64(hidden)
    np.testing.assert_allclose(second.running_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second.running_var.numpy(), var, rtol=1e-5, atol=1e-7)
    assert second.momentum == 0.3 and first.momentum == 0.1 and model.training


def test_device_moves_each_input():
    bn = nn.BatchNorm2d(3).to(mgpu.cpu(1))
    xs = batches(2)
    update_bn([(mgpu.array(x),) for x in xs], bn, device=mgpu.cpu(1))
    np.testing.assert_allclose(bn.running_mean.numpy(), stats64(xs)[0], rtol=2e-6, atol=1e-6)


def test_without_tracking_layers_the_loader_is_not_read():
    def loader():
        raise AssertionError("read")
        yield  # pragma: no cover

    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2, track_running_stats=False))
    update_bn(loader(), model)


def test_an_empty_loader_leaves_reset_statistics_and_a_failure_restores_the_momenta():
    bn = nn.BatchNorm2d(3, momentum=0.2)
    model = warmed(nn.Sequential(bn)).eval()
    update_bn([], model)
    np.testing.assert_array_equal(bn.running_mean.numpy(), np.zeros(3, np.float32))
    np.testing.assert_array_equal(bn.running_var.numpy(), np.ones(3, np.float32))

    def bad():
        yield mgpu.array(batches()[0])
        yield mgpu.array(np.zeros((2, 5, 4, 4), np.float32))  # 5 channels: the layer refuses

    with pytest.raises(ValueError, match="3 channels"):
        update_bn(bad(), model)
    assert bn.momentum == 0.2 and not model.training


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="update_bn: model must be an mgpu.nn.Module, got list"):
        update_bn([], [nn.BatchNorm2d(3)])
