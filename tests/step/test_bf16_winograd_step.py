"""d2l's ResNet-18 (sec. 12.6) in bfloat16 with Winograd F(2x2, 3x3) for its 3x3 stride-1 layers
(MGPU_CONV_ALGO=winograd) against the bfloat16 im2col products (direct): one SGD step's weight
gradients on 4 random 28x28 images against float64, and the fused step against the book's loop.

The float64 reference (resnet18_reference.py) takes the ReLU masks of mgpu's own bf16 forward
under the same algorithm, so a ReLU input that bfloat16's rounding moved across 0 is no error
(see test_resnet_step_accuracy.py). Winograd's forward and dx are 1.5-1.8x direct's error per
pass (winograd_bf16_model.py); through the step the gradients stay within 3x direct's.
"""
import numpy as np

import mgpu
import resnet18_reference as rr
from mgpu import nn
from test_resnet_step_accuracy import checked_params, grads, init_weights, normwise, relu_masks

N = 4


def test_bf16_winograd_step_gradients_within_3x_of_direct(monkeypatch):
    """At d2l's initialisation (He's scales every weight alike, which changes no relative error
    of a conv and little of the step)."""
    mgpu.random.seed(5)
    net = mgpu.models.resnet18(10, 1)
    init_weights(net, "d2l")
    rng = np.random.default_rng(5)
    X = rng.normal(size=(N, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=N).astype(np.int32)
    P = {k: v.numpy().astype(np.float64) for k, v in net.state_dict().items()}
    names = checked_params(P)
    err, got = {}, {}
    for algo in ("winograd", "direct"):
        monkeypatch.setenv("MGPU_CONV_ALGO", algo)
        with mgpu.autocast("bf16"):
            masks = relu_masks(net, X)
            got[algo] = grads(net, X, y)
        _, want = rr.loss_and_grads(X, y, P, masks=masks)
        err[algo] = np.array([normwise(got[algo][k], want[k]) for k in names])
    a, d = err["winograd"], err["direct"]
    report = (f"winograd median {np.median(a):.2e} max {a.max():.2e} ({names[a.argmax()]}); "
              f"direct median {np.median(d):.2e} max {d.max():.2e}")
    assert np.median(a) <= 3 * np.median(d) and a.max() <= 3 * d.max(), report
    # ... and Winograd ran: the 3x3 layers' gradients are other bits than direct's.
    w = "resnet_block2.0.conv2.weight"
    assert not np.array_equal(got["winograd"][w], got["direct"][w])


def fused_update(monkeypatch, algo, precision, X, y):
    """One fused SGD step (lr 1, no momentum) of a d2l-initialised ResNet-18 on cpu(0) built under
    MGPU_CONV_ALGO=algo: each parameter's update and the Model's conv algorithms."""
    monkeypatch.setenv("MGPU_CONV_ALGO", algo)
    mgpu.random.seed(6)
    net = mgpu.models.resnet18(10, 1)
    init_weights(net, "d2l")
    before = {k: v.numpy().astype(np.float64) for k, v in net.state_dict().items()}
    dp = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    dp.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(),
                  mgpu.optim.SGD(net.parameters(), lr=1.0), precision=precision)
    after = net.state_dict()
    update = {k: before[k] - after[k].numpy() for k in checked_params(before)}
    return update, [a for _, a in dp._fused.model._model.conv_algorithms()]


def test_fused_resnet18_bf16_step_within_3x_of_direct_from_float32(monkeypatch):
    """The fused step's updates in bf16 against its float32 updates: Winograd's within 3x of the
    bf16 im2col products' distance (median and worst over the parameters)."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(N, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=N).astype(np.int32)
    f32, _ = fused_update(monkeypatch, "direct", "float32", X, y)
    wino, algos = fused_update(monkeypatch, "winograd", "bf16", X, y)
    direct, _ = fused_update(monkeypatch, "direct", "bf16", X, y)
    assert set(algos) == {"bf16 winograd"}, algos
    a = np.array([normwise(wino[k], f32[k]) for k in f32])
    d = np.array([normwise(direct[k], f32[k]) for k in f32])
    report = f"winograd median {np.median(a):.2e} max {a.max():.2e}; direct median " \
             f"{np.median(d):.2e} max {d.max():.2e}"
    assert np.median(a) <= 3 * np.median(d) and a.max() <= 3 * d.max(), report
    assert any(not np.array_equal(wino[k], direct[k]) for k in f32)
