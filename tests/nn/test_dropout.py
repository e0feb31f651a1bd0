"""nn.Dropout and ops.dropout: PyTorch's semantics (train mode zeroes with probability p and
scales the rest by 1 / (1 - p), eval mode is the identity), masks drawn from mgpu.random (seeded,
reproducible), the same mask forward and backward, a book-loop step against NumPy float64, and
the fused step running it as a layer."""
import numpy as np
import pytest

import mgpu
from mgpu import nn


def test_train_mode_zeroes_about_p_and_scales_the_rest(device):
    p, n = 0.3, 200_000
    x = np.random.default_rng(0).uniform(0.5, 1.5, size=(n // 100, 100)).astype(np.float32)
    mgpu.random.seed(1)
    y = mgpu.dropout(mgpu.array(x, device=device), p).numpy()
    dropped = y == 0
    # Binomial(n, p): 5 standard deviations is about 0.005 here.
    assert abs(dropped.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
    scale = np.float32(1) / np.float32(1 - p)
    np.testing.assert_array_equal(y[~dropped], x[~dropped] * scale)


def test_backward_uses_the_forward_mask(device, rng):
    x = rng.uniform(0.5, 1.5, size=(7, 5, 3)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    xt = mgpu.array(x, device=device).requires_grad_()
    y = mgpu.dropout(xt, 0.5)
    y.backward(mgpu.array(dy, device=device))
    kept = y.numpy() != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_array_equal(xt.grad.numpy(), np.where(kept, dy * np.float32(2), 0))


def test_seeded_masks_repeat_and_differ_between_seeds(device):
    x = mgpu.ones((40, 30), device=device)
    draws = []
    for s in (5, 5, 6):
        mgpu.random.seed(s)
        draws.append(nn.Dropout(0.5)(x).numpy())
    np.testing.assert_array_equal(draws[0], draws[1])
    assert (draws[0] != draws[2]).any()


def test_eval_mode_and_p_zero_are_the_identity_and_p_one_zeroes():
    x = mgpu.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    drop = nn.Dropout(0.4)
    drop.eval()
    np.testing.assert_array_equal(drop(x).numpy(), x.numpy())
    np.testing.assert_array_equal(nn.Dropout(0.0)(x).numpy(), x.numpy())
    np.testing.assert_array_equal(nn.Dropout(1.0)(x).numpy(), np.zeros((3, 4)))
    assert repr(nn.Dropout(0.25)) == "Dropout(p=0.25)"


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", True])
def test_bad_p_raises_value_error(p):
    with pytest.raises(ValueError, match="p must be a probability"):
        nn.Dropout(p)
    with pytest.raises(ValueError, match="p must be a probability"):
        mgpu.dropout(mgpu.ones((2, 2)), p)


def test_books_loop_step_with_dropout_matches_numpy():
    """Linear -> ReLU -> Dropout -> Linear, one SGD step through autograd, against float64
    with the mask drawn again from the same seed."""
    mgpu.random.seed(3)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
    W1, b1, W2, b2 = (p.numpy().astype(np.float64) for p in net.parameters())
    rng = np.random.default_rng(4)
    X = rng.normal(size=(5, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=5)
    lr = 0.1
    trainer = mgpu.optim.SGD(net.parameters(), lr=lr)
    state = mgpu.random.get_state()
    loss = nn.CrossEntropyLoss()(net(mgpu.array(X)), mgpu.array(y))
    loss.backward()
    trainer.step()

    mgpu.random.set_state(state)
    mask = mgpu.random.dropout_mask((5, 8), 0.5).numpy().astype(np.float64)
    assert set(np.unique(mask)) == {0.0, 2.0}
    h = np.maximum(X @ W1.T + b1, 0)
    z = (h * mask) @ W2.T + b2
    e = np.exp(z - z.max(axis=1, keepdims=True))
    prob = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(loss.item(), -np.log(prob[np.arange(5), y]).mean(), rtol=1e-5)
    dz = (prob - np.eye(3)[y]) / 5
    dW2, db2 = dz.T @ (h * mask), dz.sum(axis=0)
    dh = (dz @ W2) * mask * (h > 0)
    dW1, db1 = dh.T @ X, dh.sum(axis=0)
    for p, start, g in zip(net.parameters(), (W1, b1, W2, b2), (dW1, db1, dW2, db2)):
        np.testing.assert_allclose(p.numpy(), start - lr * g, rtol=1e-4, atol=1e-6)


def test_fused_step_runs_dropout_as_a_layer():
    """The fused step's dropout layer (its numerics: tests/step/test_fused_dropout.py)."""
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 6), nn.ReLU(), nn.Dropout(0.2),
                        nn.Linear(6, 3))
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    X, y = mgpu.ones((4, 1, 2, 2)), mgpu.array(np.array([0, 1, 2, 0]))
    loss = model.train_step(X, y, nn.CrossEntropyLoss(), mgpu.optim.SGD(net.parameters(), lr=0.1))
    assert np.isfinite(loss.item())
    assert ("dropout", {"in": 3, "params": [], "p": 0.2}) in model._fused.spec
    # Dropout(p=0) is the identity: no layer.
    net0 = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Dropout(0.0))
    model0 = nn.DataParallel(net0, device_ids=[mgpu.cpu(0)])
    model0.train_step(X, y, nn.CrossEntropyLoss(), mgpu.optim.SGD(net0.parameters(), lr=0.1))
    assert [kind for kind, _ in model0._fused.spec] == ["flatten", "linear"]
