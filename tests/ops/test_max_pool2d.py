"""max_pool2d end to end: the NumPy reference (against an independent formulation, hand examples
and finite differences), the op on every device against it (ties, NaN, -inf, padding, odd and
non-square shapes, batch 1), bad inputs, nn.MaxPool2d, and the fused step's max_pool2d layer
against the book's loop, with torchvision's ResNet-18 stem (conv 7x7 s2, bn, relu, max pool 3x3
s2 p1) built from mgpu.nn, on CPU devices and emulated GPUs."""
import numpy as np
import pytest

import mgpu
import reference as ref
from conftest import assert_close
from mgpu import nn

# x shape, kernel_size, stride, padding
CASES = [
    ((1, 1, 4, 4), 2, None, 0),            # batch 1, the default stride
    ((2, 3, 9, 9), 2, 2, 0),               # floor drops the last row and column
    ((2, 3, 11, 7), 3, 2, 1),              # ResNet's stem pool on an odd, non-square map
    ((1, 2, 5, 8), (3, 2), (1, 2), (1, 1)),  # non-square kernel and stride, overlapping rows
    ((3, 2, 7, 6), (2, 3), (3, 1), (1, 0)),  # gaps between windows along h
    ((2, 1, 3, 5), (3, 5), 1, 0),          # one window over the whole map
    ((1, 1, 1, 1), 1, 1, 0),               # a 1x1 image
    ((2, 4, 20, 19), 3, 2, 1),             # rows wider than one 16-float vector, with a tail
]


def tie_free(rng, shape):
    """Distinct values at least 1e-3 apart, so finite-difference steps never change a winner."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 1e-3 + rng.uniform(0, 1e-4, n)).reshape(shape) - n * 5e-4


# --- the reference ------------------------------------------------------------------------------

def direct_max(x, kernel_size, stride, padding):
    """The maximum of every -inf-padded window, by slicing (no winner bookkeeping)."""
    kh, kw = np.broadcast_to(kernel_size, (2,))
    sh, sw = np.broadcast_to(kernel_size if stride is None else stride, (2,))
    ph, pw = np.broadcast_to(padding, (2,))
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf)
    P = (xp.shape[2] - kh) // sh + 1
    Q = (xp.shape[3] - kw) // sw + 1
    y = np.empty(x.shape[:2] + (P, Q))
    for p in range(P):
        for q in range(Q):
            y[:, :, p, q] = xp[:, :, p * sh:p * sh + kh, q * sw:q * sw + kw].max(axis=(2, 3))
    return y


@pytest.mark.parametrize("shape, kernel, stride, padding", CASES)
def test_reference_forward_matches_padded_slices(rng, shape, kernel, stride, padding):
    x = rng.normal(size=shape)
    y, index = ref.max_pool2d_forward(x, kernel, stride, padding)
    np.testing.assert_array_equal(y, direct_max(x, kernel, stride, padding))
    W = shape[3]
    flat = x.reshape(shape[0], shape[1], -1)
    np.testing.assert_array_equal(np.take_along_axis(flat, index.reshape(*shape[:2], -1), 2)
                                  .reshape(y.shape), y)
    assert (index // W < shape[2]).all()


def test_reference_hand_example():
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    y, index = ref.max_pool2d_forward(x, 2)
    np.testing.assert_array_equal(y, [[[[5.0, 7.0], [13.0, 15.0]]]])
    np.testing.assert_array_equal(index, [[[[5, 7], [13, 15]]]])


def test_reference_ties_go_to_the_first_maximum_in_row_major_order():
    # 9 at (0, 1) and (1, 0): row-major order reaches (0, 1) first; a column-first scan would
    # pick (1, 0).
    x = np.array([[0.0, 9.0], [9.0, 0.0]]).reshape(1, 1, 2, 2)
    assert ref.max_pool2d_forward(x, 2)[1].item() == 1
    dx = ref.max_pool2d_backward(x, np.ones((1, 1, 1, 1)), 2)
    np.testing.assert_array_equal(dx.ravel(), [0, 1, 0, 0])


def test_reference_nan_wins_and_the_last_nan_takes_the_gradient():
    x = np.array([[1.0, np.nan], [np.nan, 5.0]]).reshape(1, 1, 2, 2)
    y, index = ref.max_pool2d_forward(x, 2)
    assert np.isnan(y.item()) and index.item() == 2


@pytest.mark.parametrize("shape, kernel, stride, padding", CASES[:-1])
def test_reference_backward_matches_finite_differences(rng, shape, kernel, stride, padding):
    from test_reference import assert_grads_match_fd
    x = tie_free(rng, shape)

    def forward(x):
        return ref.max_pool2d_forward(x, kernel, stride, padding)[0]

    dy = rng.normal(size=forward(x).shape)
    assert_grads_match_fd(forward, (x,), dy,
                          (ref.max_pool2d_backward(x, dy, kernel, stride, padding),))


# --- the op on every device ---------------------------------------------------------------------

def run(device, x, kernel, stride, padding, dy):
    xt = mgpu.array(x.astype(np.float32), device=device).requires_grad_()
    out = mgpu.max_pool2d(xt, kernel, stride, padding)
    out.backward(mgpu.array(dy.astype(np.float32), device=device))
    return out.numpy(), xt.grad.numpy()


def check(device, x, kernel, stride, padding, rng, what):
    x = x.astype(np.float32)
    y_ref, _ = ref.max_pool2d_forward(x, kernel, stride, padding)
    dy = rng.normal(size=y_ref.shape).astype(np.float32)
    y, dx = run(device, x, kernel, stride, padding, dy)
    # The maximum is one of x's float32 values: exact.
    np.testing.assert_array_equal(y, y_ref.astype(np.float32), err_msg=f"{what} on {device}")
    assert_close(dx, ref.max_pool2d_backward(x, dy, kernel, stride, padding), "sum",
                 f"{what} backward", device)


@pytest.mark.parametrize("shape, kernel, stride, padding", CASES)
def test_max_pool2d_matches_reference(device, rng, shape, kernel, stride, padding):
    check(device, rng.normal(size=shape), kernel, stride, padding, rng, "max_pool2d")


@pytest.mark.parametrize("shape, kernel, stride, padding", CASES)
def test_max_pool2d_ties_route_like_the_reference(device, rng, shape, kernel, stride, padding):
    # Values from {0, 1, 2}: most windows hold their maximum more than once.
    check(device, rng.integers(0, 3, size=shape).astype(np.float64), kernel, stride, padding,
          rng, "max_pool2d with ties")


def test_max_pool2d_nan_and_infinities(device, rng):
    x = rng.normal(size=(2, 3, 7, 9))
    x[0, 0, 1, 1] = x[0, 0, 2, 0] = np.nan         # two NaNs in one window: the last wins
    x[0, 1] = -np.inf                              # whole windows of -inf
    x[1, 2, 3, :] = np.inf
    check(device, x, 3, 2, 1, rng, "max_pool2d with NaN and inf")
    y, _ = run(device, x, 3, 2, 1, np.ones((2, 3, 4, 5)))
    assert np.isnan(y[0, 0, 1, 0]) and (y[0, 1] == -np.inf).all()


def test_max_pool2d_without_grad_keeps_no_indices_and_gives_the_same_y(device, rng):
    x = mgpu.array(rng.normal(size=(2, 3, 9, 8)).astype(np.float32), device=device)
    y = mgpu.max_pool2d(x, 3, 2, 1)
    y_kept, indices = mgpu._core.max_pool2d_forward(x._t, 3, 3, 2, 2, 1, 1, True)
    np.testing.assert_array_equal(y.numpy(), mgpu.Tensor(y_kept).numpy())
    assert mgpu._core.max_pool2d_forward(x._t, 3, 3, 2, 2, 1, 1, False)[1] is None
    assert mgpu.Tensor(indices).dtype.name == "int32"


@pytest.mark.parametrize("call, match", [
    (lambda x: mgpu.max_pool2d(x, 2, padding=2), "at most half"),
    (lambda x: mgpu.max_pool2d(x, 0), "kernel_size must be >= 1"),
    (lambda x: mgpu.max_pool2d(x, 2, stride=0), "stride must be >= 1"),
    (lambda x: mgpu.max_pool2d(x, (8, 2)), "larger than the 5x6 input"),
    (lambda x: mgpu.max_pool2d(x.reshape(2, 5, 6), 2), "4 dims"),
    (lambda x: mgpu.max_pool2d(x, 2, dilation=2), "dilation"),
    (lambda x: mgpu.max_pool2d(x, 2, ceil_mode=True), "ceil_mode"),
    (lambda x: nn.MaxPool2d(3, padding=2), "at most half"),
    (lambda x: nn.MaxPool2d(3)(x.reshape(2, 5, 6)), r"expected \(N, C, H, W\)"),
    (lambda x: mgpu._core.max_pool2d_backward(
        mgpu._core.max_pool2d_forward(x._t, 2, 2, 2, 2, 0, 0)[1], x._t, 5, 6, 2, 2, 2, 2, 0, 0),
     "indices have shape"),
])
def test_bad_inputs_raise_value_error(call, match):
    x = mgpu.array(np.zeros((2, 1, 5, 6), np.float32))
    with pytest.raises(ValueError, match=match):
        call(x)


def test_non_integer_sizes_raise_type_error():
    x = mgpu.array(np.zeros((1, 1, 4, 4), np.float32))
    with pytest.raises(TypeError, match="kernel_size must be an int"):
        mgpu.max_pool2d(x, 2.5)
    with pytest.raises(TypeError, match="stride must be an int"):
        nn.MaxPool2d(2, stride=True)


def test_module_is_the_functional_op(device, rng):
    pool = nn.MaxPool2d((3, 2), stride=(2, 1), padding=1)
    assert "kernel_size=(3, 2), stride=(2, 1), padding=(1, 1)" in repr(pool)
    x = rng.normal(size=(2, 3, 7, 6)).astype(np.float32)
    y, _ = ref.max_pool2d_forward(x, (3, 2), (2, 1), 1)
    np.testing.assert_array_equal(pool(mgpu.array(x, device=device)).numpy(), y)


# --- the fused step's layer ---------------------------------------------------------------------

def stem_net(seed=0, classes=5):
    """torchvision's ResNet-18 stem at a small width, then a classifier head."""
    mgpu.random.seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False), nn.BatchNorm2d(8),
        nn.ReLU(), nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        nn.Conv2d(8, 6, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(6 * 2 * 2, classes))


def close(got, expected, what, rtol=2e-4, atol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=atol, err_msg=what)


def fused_equals_books_loop(devices, steps=3):
    """DataParallel.train_step and the book's loop (forward, backward, SGD with momentum and
    weight decay) give the same losses, parameters and running statistics."""
    nets = [stem_net(), stem_net()]
    models = [nn.DataParallel(n, device_ids=devices) for n in nets]
    trainers = [mgpu.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
                for m in models]
    loss = nn.CrossEntropyLoss()
    rng = np.random.default_rng(3)
    for step in range(steps):
        # 17x15 images: the stem makes 9x8, its pool 5x4, the second pool 2x2.
        X = mgpu.array(rng.normal(size=(6, 3, 17, 15)).astype(np.float32), device=devices[0])
        y = mgpu.array(rng.integers(0, 5, size=6), device=devices[0])
        trainers[0].zero_grad()
        book = loss(models[0](X), y)
        book.backward()
        trainers[0].step()
        fused = models[1].train_step(X, y, loss, trainers[1])
        close(fused.item(), book.item(), f"loss, step {step}")
    assert [kind for kind, _ in models[1]._fused.spec].count("max_pool2d") == 2
    book, fused = nets[0].state_dict(), nets[1].state_dict()
    for name in book:
        if not name.endswith("num_batches_tracked"):
            close(fused[name].numpy(), book[name].numpy(), f"fused vs book: {name}")
    return nets


@pytest.mark.parametrize("k", [1, 2])
def test_fused_step_with_max_pool_equals_the_books_loop(k):
    nets = fused_equals_books_loop([mgpu.cpu(i) for i in range(k)])
    # Not vacuous: training moved the weights.
    assert not np.allclose(nets[0][0].weight.numpy(), stem_net()[0].weight.numpy())


@pytest.mark.gpu
def test_fused_step_with_max_pool_on_emulated_gpus():
    if mgpu.num_gpus() < 2:
        pytest.skip(f"needs 2 GPUs (emulated build), this build has {mgpu.num_gpus()}")
    fused_equals_books_loop([mgpu.gpu(0), mgpu.gpu(1)], steps=2)


def test_fused_step_rejects_a_non_square_max_pool():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d((2, 3)), nn.Flatten(), nn.Linear(8, 3))
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    X = mgpu.array(np.zeros((2, 1, 6, 8), np.float32))
    with pytest.raises(NotImplementedError, match="MaxPool2d"):
        model.train_step(X, mgpu.array(np.zeros(2, np.int64)), nn.CrossEntropyLoss(),
                         mgpu.optim.SGD(net.parameters(), lr=0.1))


def test_fused_deterministic_step_with_max_pool_gives_the_same_bits_on_1_and_2_devices():
    states = []
    for k in (1, 2):
        net = stem_net()
        model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
        trainer = mgpu.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        rng = np.random.default_rng(5)
        for _ in range(2):
            X = mgpu.array(rng.normal(size=(6, 3, 17, 15)).astype(np.float32))
            y = mgpu.array(rng.integers(0, 5, size=6))
            model.train_step(X, y, nn.CrossEntropyLoss(), trainer, deterministic=True)
        states.append({name: t.numpy() for name, t in net.state_dict().items()})
    for name in states[0]:
        np.testing.assert_array_equal(states[1][name], states[0][name], err_msg=name)
