"""The fused step's conv algorithm (MGPU_CONV_ALGO, cpp/ops/conv2d.h) is chosen once, as its
model is built: recorded per conv layer (Model.conv_algorithms) and kept by every later step
whatever the variable says then.
"""
import numpy as np
import pytest

import mgpu
from mgpu import nn


def _steps(monkeypatch, built_with, run_with):
    """Two SGD steps of a small 3x3 conv net on cpu(0): the model is built (first step) under
    MGPU_CONV_ALGO=built_with, the second step runs under run_with -> (conv_algorithms, state)."""
    monkeypatch.setenv("MGPU_CONV_ALGO", built_with)
    mgpu.random.seed(3)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.CrossEntropyLoss()
    rng = np.random.default_rng(5)
    X = mgpu.array(rng.standard_normal((4, 3, 8, 8)).astype(np.float32))
    y = mgpu.array(rng.integers(0, 5, 4).astype(np.int64))
    model.train_step(X, y, loss, trainer)
    monkeypatch.setenv("MGPU_CONV_ALGO", run_with)
    model.train_step(X, y, loss, trainer)
    algos = model._fused.model._model.conv_algorithms()
    return algos, {k: v.numpy() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("algo", ["auto", "direct", "winograd"])
def test_each_conv_layer_records_the_algorithm_of_the_build(monkeypatch, algo):
    algos, _ = _steps(monkeypatch, algo, "im2col")
    assert algos == [("layer 0 (conv2d)", algo), ("layer 2 (conv2d)", algo)]


def test_a_later_change_of_the_variable_leaves_the_built_model_alone(monkeypatch):
    kept = _steps(monkeypatch, "direct", "winograd")[1]
    direct = _steps(monkeypatch, "direct", "direct")[1]
    winograd = _steps(monkeypatch, "winograd", "winograd")[1]
    for k in direct:
        np.testing.assert_array_equal(kept[k], direct[k], err_msg=k)
    # The two algorithms round differently, so the comparison above could tell them apart.
    assert any(not np.array_equal(direct[k], winograd[k]) for k in direct)


def test_a_bad_value_is_refused_as_the_model_is_built(monkeypatch):
    with pytest.raises(ValueError, match="MGPU_CONV_ALGO=fft is not understood"):
        _steps(monkeypatch, "fft", "auto")
