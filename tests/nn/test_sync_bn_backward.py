"""SyncBatchNorm's backward in the book's loop: the replicas' sum(dy) and sum(dy * xhat) are
added by the fused step's own combine (_core.batch_norm_combine_sums, in double, replicas in
order), so the input and weight gradients are batch norm's over the whole batch (against float64)
and bitwise those of the fused step.

The network is Linear(N, C, bias=False) -> SyncBatchNorm(C) fed the N x N identity: the linear
layer's output is W^T (batch norm's input) and its weight gradient is batch norm's input
gradient, transposed and exact (every other term of the product is a zero), so a test reads
batch norm's dx off W.grad."""
import numpy as np
import pytest

import mgpu
import reference as ref
from mgpu import nn

f32 = np.float32
N, C, EPS = 8, 5, 1e-5  # N a power of two: the fused step's grad / N is exact (see below)


def sync_net(seed=0):
    """Linear(N, C) with weights far from zero (batch norm's input means near 300) and
    non-trivial affine parameters, converted to SyncBatchNorm."""
    rng = np.random.default_rng(seed)
    net = nn.Sequential(nn.Linear(N, C, bias=False), nn.BatchNorm1d(C, eps=EPS))
    net[0].weight[:] = (300.0 + 3.0 * rng.normal(size=(C, N))).astype(f32)
    net[1].weight[:] = rng.uniform(0.5, 1.5, size=C).astype(f32)
    net[1].bias[:] = rng.normal(scale=0.3, size=C).astype(f32)
    return nn.SyncBatchNorm.convert_sync_batchnorm(net)


def labels(seed=0):
    return np.random.default_rng(seed + 1).integers(0, C, size=N)


def float64_grads(net, y):
    """(dW, dgamma, dbeta) of the mean cross-entropy of batch norm over all N rows, in float64."""
    h = net[0].weight.numpy().astype(np.float64).T  # identity input: h = W^T
    gamma, beta = (t.numpy().astype(np.float64) for t in (net[1].weight, net[1].bias))
    z, _, _ = ref.batch_norm_train_forward(h, gamma, beta, EPS)
    dz = ref.softmax_cross_entropy_backward(z, y, np.full(N, 1.0 / N))
    dh, dgamma, dbeta = ref.batch_norm_train_backward(h, gamma, dz, EPS)
    return dh.T, dgamma, dbeta


def books_grads(k, y):
    """The book's loop on k CPU devices: forward, mean cross-entropy, backward."""
    net = sync_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
    model.train()
    out = nn.CrossEntropyLoss()(model(mgpu.array(np.eye(N, dtype=f32))), mgpu.array(y))
    out.backward()
    return net, [p.grad.numpy() for p in net.parameters()]


@pytest.mark.parametrize("k", [2, 3])
def test_books_sync_batch_norm_gradients_are_the_whole_batchs(k):
    y = labels()
    net, (dW, dgamma, dbeta) = books_grads(k, y)
    ref_dW, ref_dgamma, ref_dbeta = float64_grads(net, y)
    # Gradients of size ~0.1; float32's forward rounds inputs near 300 to 3e-5, 1e-5 of their
    # spread, and every gradient inherits that through xhat and the softmax.
    for name, got, want in (("dx", dW, ref_dW), ("dgamma", dgamma, ref_dgamma),
                            ("dbeta", dbeta, ref_dbeta)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-6, err_msg=f"{name}, k={k}")


@pytest.mark.parametrize("k", [2, 3])
def test_books_sync_batch_norm_gradients_are_the_fused_steps_bitwise(k):
    """The fused step's gradients are read from SGD's momentum buffer after its first step
    (buf = g exactly, g = the summed-loss gradient / N); with N a power of two that division,
    and the book's mean loss's 1/N, scale every intermediate exactly, so the bits must agree.
    Three devices show a float32 sum of the replicas' sums (it rounds twice) where two would
    not."""
    y = labels()
    _, book = books_grads(k, y)
    net = sync_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train_step(mgpu.array(np.eye(N, dtype=f32)), mgpu.array(y), nn.CrossEntropyLoss(),
                     trainer)
    state = trainer.state_dict()["state"]
    fused = [state[i]["momentum_buffer"].numpy() for i in range(len(book))]
    for name, a, b in zip(("dW (batch norm's dx)", "dgamma", "dbeta"), book, fused):
        np.testing.assert_array_equal(a, b, err_msg=f"book vs fused {name}, k={k}")


def test_combine_sums_is_float64s_sum_in_replica_order_rounded_once():
    """On any devices, in replica order, each of the 2C columns the float64 sum of the K rows
    rounded to float32 once: values of mixed sizes and signs, where float32 additions round
    differently."""
    rng = np.random.default_rng(3)
    K, C2 = 4, 6
    parts = (rng.normal(size=(K, 2, C2)) * 10.0 ** rng.integers(-4, 5, size=(K, 2, C2)))
    parts = parts.astype(f32)
    devices = [mgpu.cpu(i % 2) for i in range(K)]
    dys = [mgpu.array(parts[k, 0], device=d)._t for k, d in enumerate(devices)]
    dyxs = [mgpu.array(parts[k, 1], device=d)._t for k, d in enumerate(devices)]
    got = [mgpu.Tensor(t).numpy() for t in mgpu._core.batch_norm_combine_sums(dys, dyxs,
                                                                               mgpu.cpu(1))]
    want = parts[0].astype(np.float64)
    for k in range(1, K):
        want = want + parts[k]
    np.testing.assert_array_equal(got[0], want[0].astype(f32))
    np.testing.assert_array_equal(got[1], want[1].astype(f32))
    in_float32 = parts[0]
    for k in range(1, K):
        in_float32 = in_float32 + parts[k]
    assert (in_float32 != want.astype(f32)).any(), "the data should tell float32 sums apart"


def test_combine_sums_checks_its_arguments():
    a = mgpu.array(np.ones(3, f32))._t
    with pytest.raises(ValueError, match="one sum_dy and one sum_dy_xhat per replica"):
        mgpu._core.batch_norm_combine_sums([a, a], [a], mgpu.cpu(0))
    with pytest.raises(ValueError, match="replica 1 has 4 and 3 sums, replica 0 has 3"):
        mgpu._core.batch_norm_combine_sums([a, mgpu.array(np.ones(4, f32))._t], [a, a],
                                           mgpu.cpu(0))
    with pytest.raises(TypeError):
        mgpu._core.batch_norm_combine_sums([mgpu.array(np.ones(3, np.int32))._t], [a],
                                           mgpu.cpu(0))
