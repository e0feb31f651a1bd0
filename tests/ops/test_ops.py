"""Every op of the chapter (D2L 12.5) and its backward, on every device, against the float64
references in reference.py: conv2d, avg_pool2d, relu, mm and the bias broadcast, softmax
cross-entropy, argmax, tensor arithmetic, sum, reshape, .to(device), the whole LeNet and sgd.

Inputs are drawn in float64, rounded to float32 once, and the reference sees those same float32
values, so the comparison measures only the op's own rounding (the tolerances of conftest.TOL)."""

import numpy as np
import pytest

import mgpu
import reference as ref
from conftest import assert_close, f32, on, other_device


def off_kink(rng, shape, low=0.05, high=2.0):
    """Random values with low <= |x| <= high and random signs: never at ReLU's kink."""
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(low, high, size=shape)




# ---------------------------------------------------------------------------------------------
# conv2d
# ---------------------------------------------------------------------------------------------

# (N, C, H, W), (K, R, S), stride, padding, bias
CONV_CASES = [
    pytest.param((1, 1, 5, 5), (1, 3, 3), 1, 0, True, id="batch1-single-channel"),
    pytest.param((2, 3, 7, 5), (4, 3, 3), 1, 0, True, id="odd-nonsquare"),
    pytest.param((3, 2, 9, 8), (5, 3, 2), 2, 0, True, id="stride2-nonsquare-kernel"),
    pytest.param((2, 3, 6, 7), (2, 3, 3), 1, 1, False, id="pad1-nobias"),
    pytest.param((1, 2, 5, 6), (3, 5, 5), 1, 2, True, id="pad2-batch1"),
    pytest.param((2, 1, 8, 7), (3, 3, 3), 2, 1, True, id="stride2-pad1"),
    pytest.param((1, 1, 6, 6), (2, 3, 3), 2, 0, False, id="stride2-uncovered-edge"),
    pytest.param((2, 4, 4, 3), (3, 1, 1), 1, 0, True, id="1x1-kernel"),
]


def _conv_inputs(rng, xshape, kshape, bias):
    N, C, H, W = xshape
    K, R, S = kshape
    x = f32(rng.normal(size=(N, C, H, W)))
    w = f32(rng.normal(scale=0.5, size=(K, C, R, S)))
    b = f32(rng.normal(size=(K,))) if bias else None
    return x, w, b


@pytest.mark.parametrize("xshape, kshape, stride, padding, bias", CONV_CASES)
def test_conv2d_forward(device, rng, xshape, kshape, stride, padding, bias):
    x, w, b = _conv_inputs(rng, xshape, kshape, bias)
    out = mgpu.conv2d(on(x, device), on(w, device), on(b, device) if bias else None,
                      stride=stride, padding=padding)
    assert out.device == device
    assert out.dtype == np.float32
    assert_close(out.numpy(), ref.conv2d_forward(x, w, b, stride, padding), "sum",
                 "conv2d forward", device)


@pytest.mark.parametrize("xshape, kshape, stride, padding, bias", CONV_CASES)
def test_conv2d_backward(device, rng, xshape, kshape, stride, padding, bias):
    x, w, b = _conv_inputs(rng, xshape, kshape, bias)
    xt, wt = on(x, device, grad=True), on(w, device, grad=True)
    bt = on(b, device, grad=True) if bias else None
    out = mgpu.conv2d(xt, wt, bt, stride=stride, padding=padding)
    dy = f32(rng.normal(size=out.shape))
    (out * on(dy, device)).sum().backward()

    dx, dw, db = ref.conv2d_backward(x, w, dy, stride, padding, has_bias=bias)
    for name, t, expected in [("dx", xt, dx), ("dw", wt, dw)] + ([("db", bt, db)] if bias else []):
        assert t.grad is not None, f"conv2d backward left {name} None"
        assert t.grad.device == device
        assert_close(t.grad.numpy(), expected, "sum", f"conv2d backward {name}", device)


def test_conv2d_backward_with_explicit_dy_and_pair_arguments(device, rng):
    """out.backward(dy) is the same as (out * dy).sum().backward(); (2, 2) means stride 2."""
    x, w, b = _conv_inputs(rng, (2, 2, 7, 6), (3, 3, 3), True)
    xt, wt, bt = on(x, device, True), on(w, device, True), on(b, device, True)
    out = mgpu.conv2d(xt, wt, bt, stride=(2, 2), padding=(1, 1))
    dy = f32(rng.normal(size=out.shape))
    out.backward(on(dy, device))
    dx, dw, db = ref.conv2d_backward(x, w, dy, 2, 1)
    assert_close(out.numpy(), ref.conv2d_forward(x, w, b, 2, 1), "sum", "conv2d forward", device)
    assert_close(xt.grad.numpy(), dx, "sum", "conv2d dx", device)
    assert_close(wt.grad.numpy(), dw, "sum", "conv2d dw", device)
    assert_close(bt.grad.numpy(), db, "sum", "conv2d db", device)


def test_conv2d_only_weights_require_grad(device, rng):
    """A data batch x that does not require grad gets no .grad, and w still gets the right one."""
    x, w, b = _conv_inputs(rng, (2, 1, 6, 5), (2, 3, 3), True)
    xt, wt, bt = on(x, device), on(w, device, True), on(b, device, True)
    out = mgpu.conv2d(xt, wt, bt)
    dy = f32(rng.normal(size=out.shape))
    out.backward(on(dy, device))
    _, dw, db = ref.conv2d_backward(x, w, dy)
    assert xt.grad is None
    assert_close(wt.grad.numpy(), dw, "sum", "conv2d dw", device)
    assert_close(bt.grad.numpy(), db, "sum", "conv2d db", device)


# ---------------------------------------------------------------------------------------------
# avg_pool2d
# ---------------------------------------------------------------------------------------------

POOL_CASES = [
    pytest.param((2, 3, 9, 9), 2, 2, (4, 4), id="k2s2-9x9-drops-edge"),
    pytest.param((1, 2, 7, 6), (3, 2), (2, 1), (3, 5), id="k3x2-s2x1"),
    pytest.param((2, 1, 6, 5), 3, 1, (4, 3), id="overlapping-k3s1"),
    pytest.param((3, 2, 8, 5), 2, None, (4, 2), id="default-stride"),
    pytest.param((1, 1, 5, 7), (2, 3), (1, 2), (4, 3), id="k2x3-s1x2-nonsquare"),
    pytest.param((2, 2, 8, 8), 2, 3, (3, 3), id="stride-larger-than-kernel-gaps"),
]


@pytest.mark.parametrize("xshape, kernel, stride, out_hw", POOL_CASES)
def test_avg_pool2d_forward_and_backward(device, rng, xshape, kernel, stride, out_hw):
    x = f32(rng.normal(size=xshape))
    xt = on(x, device, grad=True)
    out = mgpu.avg_pool2d(xt, kernel, stride) if stride is not None else mgpu.avg_pool2d(xt, kernel)
    assert out.device == device
    assert out.shape == xshape[:2] + out_hw
    assert_close(out.numpy(), ref.avg_pool2d_forward(x, kernel, stride), "sum",
                 "avg_pool2d forward", device)

    dy = f32(rng.normal(size=out.shape))
    out.backward(on(dy, device))
    assert_close(xt.grad.numpy(), ref.avg_pool2d_backward(xshape, dy, kernel, stride), "sum",
                 "avg_pool2d backward", device)


# ---------------------------------------------------------------------------------------------
# relu
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4, 5)])
def test_relu_forward_and_backward(device, rng, shape):
    x = f32(off_kink(rng, shape))
    dy = f32(rng.normal(size=shape))
    xt = on(x, device, grad=True)
    out = mgpu.relu(xt)
    assert out.device == device
    assert_close(out.numpy(), ref.relu_forward(x), "elementwise", "relu forward", device)
    out.backward(on(dy, device))
    assert_close(xt.grad.numpy(), ref.relu_backward(x, dy), "elementwise", "relu backward", device)


def test_relu_gradient_at_zero_is_zero(device):
    """At the kink the reference's convention holds: relu(0) = 0 with gradient 0 (also for -0)."""
    x = np.array([0.0, -0.0, 1e-30, -1e-30, 2.0], dtype=np.float32)
    xt = on(x, device, grad=True)
    out = mgpu.relu(xt)
    np.testing.assert_array_equal(out.numpy(), ref.relu_forward(x))
    out.backward(on(np.full(5, 3.0), device))
    np.testing.assert_array_equal(xt.grad.numpy(), ref.relu_backward(x, np.full(5, 3.0)))


# ---------------------------------------------------------------------------------------------
# mm, and the linear layer's bias broadcast
# ---------------------------------------------------------------------------------------------

MM_SHAPES = [(1, 1, 1), (3, 5, 7), (1, 9, 2), (17, 33, 4), (6, 1, 5)]


@pytest.mark.parametrize("m, j, n", MM_SHAPES)
def test_mm_forward_and_backward(device, rng, m, j, n):
    a, b = f32(rng.normal(size=(m, j))), f32(rng.normal(size=(j, n)))
    dy = f32(rng.normal(size=(m, n)))
    at, bt = on(a, device, True), on(b, device, True)
    out = mgpu.mm(at, bt)
    assert out.device == device
    assert out.shape == (m, n)
    assert_close(out.numpy(), ref.mm_forward(a, b), "sum", "mm forward", device)
    out.backward(on(dy, device))
    da, db = ref.mm_backward(a, b, dy)
    assert_close(at.grad.numpy(), da, "sum", "mm da", device)
    assert_close(bt.grad.numpy(), db, "sum", "mm db", device)


def test_matmul_operator_and_dot_are_mm(device, rng):
    a, b = f32(rng.normal(size=(4, 3))), f32(rng.normal(size=(3, 5)))
    expected = ref.mm_forward(a, b)
    assert_close((on(a, device) @ on(b, device)).numpy(), expected, "sum", "a @ b", device)
    assert_close(mgpu.dot(on(a, device), on(b, device)).numpy(), expected, "sum", "dot", device)


@pytest.mark.parametrize("n, j, m", [(1, 3, 2), (5, 7, 4), (8, 16, 10)])
def test_linear_bias_broadcast(device, rng, n, j, m):
    """mm(x, w) + b, the chapter's dense layer: b is added to every row, db sums dy's rows."""
    x, w, b = (f32(rng.normal(size=s)) for s in [(n, j), (j, m), (m,)])
    dy = f32(rng.normal(size=(n, m)))
    xt, wt, bt = on(x, device, True), on(w, device, True), on(b, device, True)
    out = mgpu.mm(xt, wt) + bt
    assert out.device == device
    assert_close(out.numpy(), ref.linear_forward(x, w, b), "sum", "linear forward", device)
    out.backward(on(dy, device))
    dx, dw, db = ref.linear_backward(x, w, dy)
    assert_close(xt.grad.numpy(), dx, "sum", "linear dx", device)
    assert_close(wt.grad.numpy(), dw, "sum", "linear dw", device)
    assert_close(bt.grad.numpy(), db, "sum", "linear db (column sums)", device)


def test_bias_broadcast_on_the_left(device, rng):
    """b + y (bias first) broadcasts the same way and its gradient is still dy's column sums."""
    y, b = f32(rng.normal(size=(4, 3))), f32(rng.normal(size=(3,)))
    dy = f32(rng.normal(size=(4, 3)))
    yt, bt = on(y, device, True), on(b, device, True)
    out = bt + yt
    assert_close(out.numpy(), ref.bias_add_rows_forward(y, b), "elementwise", "b + y", device)
    out.backward(on(dy, device))
    dyy, db = ref.bias_add_rows_backward(dy)
    assert_close(yt.grad.numpy(), dyy, "elementwise", "b + y: dy", device)
    assert_close(bt.grad.numpy(), db, "sum", "b + y: db", device)


@pytest.mark.parametrize("op", ["+", "-", "*", "/"])
@pytest.mark.parametrize("bias_first", [False, True], ids=["y-op-b", "b-op-y"])
def test_row_broadcast_arithmetic_gradients(device, rng, op, bias_first):
    """A (M,) operand broadcast over the rows of an (N, M) one: its gradient sums over rows."""
    y, b = f32(rng.normal(size=(5, 3))), f32(off_kink(rng, (3,), low=0.5))
    if op == "/" and bias_first:
        y = f32(off_kink(rng, (5, 3), low=0.5))
    dy = f32(rng.normal(size=(5, 3)))
    yt, bt = on(y, device, True), on(b, device, True)
    first, second = (bt, yt) if bias_first else (yt, bt)
    out = {"+": lambda: first + second, "-": lambda: first - second,
           "*": lambda: first * second, "/": lambda: first / second}[op]()
    assert out.shape == (5, 3) and out.device == device
    a64, b64 = (np.broadcast_to(b, y.shape), y) if bias_first else (y, np.broadcast_to(b, y.shape))
    value, grads = _binary_ref(op, a64, b64)
    assert_close(out.numpy(), value, "elementwise", f"broadcast {op}", device)
    out.backward(on(dy, device))
    g_first, g_second = grads(dy)
    g_y, g_b = (g_second, g_first) if bias_first else (g_first, g_second)
    assert yt.grad.shape == (5, 3) and bt.grad.shape == (3,)
    assert_close(yt.grad.numpy(), g_y, "elementwise", f"broadcast {op}: dy", device)
    assert_close(bt.grad.numpy(), g_b.sum(axis=0), "sum", f"broadcast {op}: db", device)


# ---------------------------------------------------------------------------------------------
# softmax cross-entropy, argmax
# ---------------------------------------------------------------------------------------------

CE_CASES = [
    pytest.param(1, 10, np.int64, 1.0, id="batch1-int64"),
    pytest.param(5, 3, np.int32, 1.0, id="int32"),
    pytest.param(6, 10, np.int64, 3.0, id="int64-wide-logits"),
]


@pytest.mark.parametrize("n, m, label_dtype, scale", CE_CASES)
def test_cross_entropy_forward_and_backward(device, rng, n, m, label_dtype, scale):
    logits = f32(rng.normal(scale=scale, size=(n, m)))
    labels = rng.integers(0, m, size=n).astype(label_dtype)
    dloss = f32(rng.normal(size=n))
    zt = on(logits, device, True)
    yt = mgpu.array(labels, device=device)
    assert yt.dtype == label_dtype
    losses = mgpu.cross_entropy(zt, yt)
    assert losses.device == device
    assert losses.shape == (n,)
    assert_close(losses.numpy(), ref.softmax_cross_entropy_forward(logits, labels), "sum",
                 "cross_entropy forward", device)
    losses.backward(on(dloss, device))
    assert_close(zt.grad.numpy(), ref.softmax_cross_entropy_backward(logits, labels, dloss), "sum",
                 "cross_entropy backward", device)


@pytest.mark.parametrize("center", [1000.0, -1000.0])
def test_cross_entropy_is_stable_for_huge_logits(device, rng, center):
    """Logits near +-1000 would overflow a naive exp; the losses must stay finite and exact."""
    n, m = 4, 6
    logits = f32(center + rng.normal(scale=2.0, size=(n, m)))
    labels = rng.integers(0, m, size=n)
    zt = on(logits, device, True)
    losses = mgpu.cross_entropy(zt, mgpu.array(labels, device=device))
    got = losses.numpy()
    assert np.all(np.isfinite(got)), f"non-finite losses {got} for logits near {center}"
    # Only the differences between logits matter; their float32 values are exact to ~1e-4 here.
    assert_close(got, ref.softmax_cross_entropy_forward(logits, labels), "sum",
                 "cross_entropy forward (huge logits)", device)
    losses.sum().backward()
    grad = zt.grad.numpy()
    assert np.all(np.isfinite(grad))
    assert_close(grad, ref.softmax_cross_entropy_backward(logits, labels, np.ones(n)), "sum",
                 "cross_entropy backward (huge logits)", device)


def test_cross_entropy_loss_object_reductions(device, rng):
    n, m = 5, 4
    logits = f32(rng.normal(size=(n, m)))
    labels = rng.integers(0, m, size=n)
    expected = ref.softmax_cross_entropy_forward(logits, labels)
    zt, yt = on(logits, device), mgpu.array(labels, device=device)
    # PyTorch's default reduction is the mean (sec. 12.6); sec. 12.5 asks for 'none' explicitly.
    assert_close(mgpu.CrossEntropyLoss()(zt, yt).item(), expected.mean(), "sum",
                 "CrossEntropyLoss()", device)
    assert_close(mgpu.CrossEntropyLoss(reduction="none")(zt, yt).numpy(), expected, "sum",
                 "CrossEntropyLoss(none)", device)
    assert_close(mgpu.CrossEntropyLoss(reduction="sum")(zt, yt).item(), expected.sum(), "sum",
                 "CrossEntropyLoss(sum)", device)
    assert_close(mgpu.CrossEntropyLoss(reduction="mean")(zt, yt).item(), expected.mean(), "sum",
                 "CrossEntropyLoss(mean)", device)
    assert_close(mgpu.SoftmaxCrossEntropyLoss()(zt, yt).numpy(), expected, "sum",
                 "SoftmaxCrossEntropyLoss()", device)


@pytest.mark.parametrize("shape", [(1, 10), (7, 3), (32, 10)])
def test_argmax_rows(device, rng, shape):
    x = rng.normal(size=shape).astype(np.float32)
    got = mgpu.argmax(on(x, device), axis=1)
    assert got.device == device
    assert got.shape == (shape[0],)
    np.testing.assert_array_equal(got.numpy(), np.argmax(x, axis=1))
    np.testing.assert_array_equal(on(x, device).argmax(axis=-1).numpy(), ref.argmax(x, axis=1))


def test_argmax_ties_pick_the_first_and_1d(device):
    x = np.array([[1.0, 1.0, 0.0], [2.0, 3.0, 3.0], [-1.0, -1.0, -1.0]], dtype=np.float32)
    np.testing.assert_array_equal(mgpu.argmax(on(x, device), axis=1).numpy(), np.argmax(x, axis=1))
    v = np.array([0.5, 4.0, -2.0, 4.0], dtype=np.float32)
    assert mgpu.argmax(on(v, device)).item() == np.argmax(v)


# ---------------------------------------------------------------------------------------------
# arithmetic, sum, reshape, .to(device)
# ---------------------------------------------------------------------------------------------

def _binary_ref(op, a, b):
    """op's value and its gradients d/da, d/db of sum(dy * op(a, b)) given dy, in float64."""
    if op == "+":
        return a + b, lambda dy: (dy, dy)
    if op == "-":
        return a - b, lambda dy: (dy, -dy)
    if op == "*":
        return a * b, lambda dy: (dy * b, dy * a)
    return a / b, lambda dy: (dy / b, -dy * a / b ** 2)


@pytest.mark.parametrize("op", ["+", "-", "*", "/"])
def test_tensor_tensor_arithmetic_with_autograd(device, rng, op):
    shape = (3, 4)
    a, b = f32(rng.normal(size=shape)), f32(off_kink(rng, shape, low=0.5))
    dy = f32(rng.normal(size=shape))
    at, bt = on(a, device, True), on(b, device, True)
    out = {"+": lambda: at + bt, "-": lambda: at - bt, "*": lambda: at * bt,
           "/": lambda: at / bt}[op]()
    assert out.device == device
    value, grads = _binary_ref(op, a, b)
    assert_close(out.numpy(), value, "elementwise", f"a {op} b", device)
    out.backward(on(dy, device))
    da, db = grads(dy)
    assert_close(at.grad.numpy(), da, "elementwise", f"a {op} b: da", device)
    assert_close(bt.grad.numpy(), db, "elementwise", f"a {op} b: db", device)


SCALAR_OPS = [
    ("t + s", lambda t, s: t + s, lambda x, s: x + s, lambda x, s: np.ones_like(x)),
    ("s + t", lambda t, s: s + t, lambda x, s: s + x, lambda x, s: np.ones_like(x)),
    ("t - s", lambda t, s: t - s, lambda x, s: x - s, lambda x, s: np.ones_like(x)),
    ("s - t", lambda t, s: s - t, lambda x, s: s - x, lambda x, s: -np.ones_like(x)),
    ("t * s", lambda t, s: t * s, lambda x, s: x * s, lambda x, s: np.full_like(x, s)),
    ("s * t", lambda t, s: s * t, lambda x, s: s * x, lambda x, s: np.full_like(x, s)),
    ("t / s", lambda t, s: t / s, lambda x, s: x / s, lambda x, s: np.full_like(x, 1 / s)),
    ("s / t", lambda t, s: s / t, lambda x, s: s / x, lambda x, s: -s / x ** 2),
    ("-t", lambda t, s: -t, lambda x, s: -x, lambda x, s: -np.ones_like(x)),
]


@pytest.mark.parametrize("name, op, value, deriv", SCALAR_OPS, ids=[c[0] for c in SCALAR_OPS])
@pytest.mark.parametrize("s", [2.0, -0.75])
def test_scalar_arithmetic_with_autograd(device, rng, name, op, value, deriv, s):
    x = f32(off_kink(rng, (2, 5), low=0.5))
    dy = f32(rng.normal(size=x.shape))
    xt = on(x, device, True)
    out = op(xt, s)
    assert out.device == device
    assert_close(out.numpy(), value(x, s), "elementwise", name, device)
    out.backward(on(dy, device))
    assert_close(xt.grad.numpy(), dy * deriv(x, s), "elementwise", f"d({name})", device)


def test_integer_scalars_and_numpy_operands(device, rng):
    """Python ints act as floats, and a NumPy array operand is copied to the tensor's device."""
    x = f32(rng.normal(size=(3,)))
    other = rng.normal(size=(3,)).astype(np.float32)
    xt = on(x, device)
    assert_close((xt * 3).numpy(), x * 3, "elementwise", "t * 3", device)
    assert_close((1 - xt).numpy(), 1 - x, "elementwise", "1 - t", device)
    out = xt + other
    assert out.device == device
    assert_close(out.numpy(), x + f32(other), "elementwise", "t + ndarray", device)


def test_chained_expression_gradient(device, rng):
    """A shared input used twice accumulates both paths: d/dx sum(x*x*w - x/2) = 2xw - 1/2."""
    x, w = f32(rng.normal(size=(4, 3))), f32(rng.normal(size=(4, 3)))
    xt, wt = on(x, device, True), on(w, device, True)
    loss = (xt * xt * wt - xt / 2.0).sum()
    assert_close(loss.item(), np.sum(x * x * w - x / 2), "sum", "chained loss", device)
    loss.backward()
    assert_close(xt.grad.numpy(), 2 * x * w - 0.5, "sum", "chained dx", device)
    assert_close(wt.grad.numpy(), x * x, "sum", "chained dw", device)


@pytest.mark.parametrize("shape", [(1,), (13,), (3, 7), (2, 3, 4, 5)])
def test_sum_forward_and_backward(device, rng, shape):
    x = f32(rng.normal(size=shape))
    xt = on(x, device, True)
    s = xt.sum()
    assert s.shape == ()
    assert s.device == device
    assert_close(s.item(), x.sum(), "sum", "sum forward", device)
    g = 1.5
    (s * g).backward()
    assert_close(xt.grad.numpy(), np.full(shape, g), "elementwise", "sum backward", device)


def test_sum_of_a_large_tensor(device, rng):
    """A million terms: float32 accumulation must still meet the "sum" tolerance."""
    x = f32(rng.uniform(0, 1, size=1_000_000))
    assert_close(on(x, device).sum().item(), x.sum(), "sum", "sum of 1e6 terms", device)


def test_mean(device, rng):
    x = f32(rng.normal(size=(4, 6)))
    xt = on(x, device, True)
    m = xt.mean()
    assert_close(m.item(), x.mean(), "sum", "mean", device)
    m.backward()
    assert_close(xt.grad.numpy(), np.full(x.shape, 1 / x.size), "elementwise", "mean grad", device)


def test_reshape_backward(device, rng):
    x = f32(rng.normal(size=(2, 3, 4)))
    w = f32(rng.normal(size=(4, 5)))
    xt, wt = on(x, device, True), on(w, device, True)
    flat = xt.reshape(6, 4)
    assert flat.shape == (6, 4)
    assert xt.reshape((-1, 4)).shape == (6, 4)
    out = mgpu.mm(flat, wt)
    dy = f32(rng.normal(size=(6, 5)))
    out.backward(on(dy, device))
    da, dw = ref.mm_backward(x.reshape(6, 4), w, dy)
    assert xt.grad.shape == (2, 3, 4)
    assert_close(xt.grad.numpy(), da.reshape(2, 3, 4), "sum", "reshape backward", device)
    assert_close(wt.grad.numpy(), dw, "sum", "mm after reshape: dw", device)


def test_to_other_device_backward(device, rng):
    """y = x.to(other) lives on other; backward brings the gradient home to x's device."""
    other = other_device(device)
    x = f32(rng.normal(size=(3, 4)))
    dy = f32(rng.normal(size=(3, 4)))
    xt = on(x, device, True)
    y = xt.to(other)
    assert y.device == other
    np.testing.assert_array_equal(y.numpy(), x.astype(np.float32))
    (y * on(dy, other)).sum().backward()
    assert xt.grad is not None
    assert xt.grad.device == device
    assert_close(xt.grad.numpy(), dy, "elementwise", ".to() backward", device)


def test_ops_on_a_device_leave_results_there(device, rng):
    """Every op enqueued on a device returns a tensor on that device (nothing silently moves)."""
    x = on(rng.normal(size=(2, 1, 6, 6)), device)
    w = on(rng.normal(size=(2, 1, 3, 3)), device)
    a = on(rng.normal(size=(3, 4)), device)
    outs = {
        "conv2d": mgpu.conv2d(x, w),
        "avg_pool2d": mgpu.avg_pool2d(x, 2),
        "relu": mgpu.relu(a),
        "mm": mgpu.mm(a, on(rng.normal(size=(4, 2)), device)),
        "cross_entropy": mgpu.cross_entropy(a, mgpu.array([0, 1, 3], device=device)),
        "argmax": mgpu.argmax(a, axis=1),
        "add": a + a, "scalar": a * 2.0, "sum": a.sum(), "reshape": a.reshape(-1),
        "zeros": mgpu.zeros((2,), device=device), "arange": mgpu.arange(3, device=device),
    }
    for name, t in outs.items():
        assert t.device == device, f"{name} on {device} returned a tensor on {t.device}"
        t.numpy()


# ---------------------------------------------------------------------------------------------
# The chapter's LeNet and sgd
# ---------------------------------------------------------------------------------------------

def _lenet_setup(rng, n=3, scale=0.1):
    X = f32(rng.uniform(0, 1, size=(n, 1, 28, 28)))
    y = rng.integers(0, 10, size=n)
    params = []
    for shape in [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10),
                  (10,)]:
        params.append(f32(rng.normal(scale=scale, size=shape)))
    return X, y, params


def test_lenet_forward(device, rng):
    X, _, params = _lenet_setup(rng)
    logits = mgpu.lenet(on(X, device), [on(p, device) for p in params])
    assert logits.device == device
    assert logits.shape == (3, 10)
    assert_close(logits.numpy(), ref.lenet_forward(X, params), "sum", "lenet forward", device)


def test_lenet_loss_gradients(device, rng):
    X, y, params = _lenet_setup(rng)
    pts = [on(p, device, True) for p in params]
    loss = mgpu.cross_entropy(mgpu.lenet(on(X, device), pts), mgpu.array(y, device=device)).sum()
    loss.backward()
    ref_loss, ref_grads = ref.lenet_loss_and_grads(X, y, params)
    assert_close(loss.item(), ref_loss, "sum", "lenet loss", device)
    names = ["dW1", "db1", "dW2", "db2", "dW3", "db3", "dW4", "db4"]
    for name, p, g in zip(names, pts, ref_grads):
        assert p.grad is not None and p.grad.device == device
        # The gradients must not be trivially small, or the comparison would prove nothing.
        assert np.abs(g).max() > 1e-3, f"{name} is too small to test ({np.abs(g).max():.2g})"
        assert_close(p.grad.numpy(), g, "sum", f"lenet {name}", device)


def test_sgd_matches_reference(device, rng):
    shapes = [(3, 4), (5,), (2, 1, 3, 3)]
    ps = [f32(rng.normal(size=s)) for s in shapes]
    gs = [f32(rng.normal(size=s)) for s in shapes]
    lr, batch_size = 0.1, 4
    params = [on(p, device, True) for p in ps]
    for p, g in zip(params, gs):
        p.grad = on(g, device)
    with mgpu.no_grad():
        mgpu.sgd(params, lr, batch_size)
    for i, (p, expected) in enumerate(zip(params, ref.sgd_update(ps, gs, lr, batch_size))):
        assert p.device == device
        assert_close(p.numpy(), expected, "elementwise", f"sgd param {i}", device)
        np.testing.assert_array_equal(p.grad.numpy(), np.zeros(shapes[i], dtype=np.float32),
                                      err_msg=f"sgd must zero grad {i} on {device}")


def test_sgd_after_backward_on_attached_grads(device, rng):
    """The chapter's loop: attach_grad, backward, sgd; a second sgd with zeroed grads is a no-op."""
    w0 = f32(rng.normal(size=(4, 2)))
    x = f32(rng.normal(size=(5, 4)))
    w = on(w0, device).attach_grad()
    mgpu.mm(on(x, device), w).sum().backward()
    grad = ref.mm_backward(x, w0, np.ones((5, 2)))[1]
    mgpu.sgd([w], 0.5, 5)
    expected = ref.sgd_update([w0], [grad], 0.5, 5)[0]
    assert_close(w.numpy(), expected, "sum", "sgd after backward", device)
    mgpu.sgd([w], 0.5, 5)
    assert_close(w.numpy(), expected, "sum", "sgd with zero grads", device)


# ---------------------------------------------------------------------------------------------
# The other ops of ResNet-18 at its shapes: 3x3 convs (padding 1, stride 1 and 2), the 1x1 stride-2
# shortcut conv, global average pooling, the residual add, the final linear layer with bias.
# GPU shapes stay tiny (the emulator runs each CUDA thread as a fiber); 64-512 channels run on CPU.
# ---------------------------------------------------------------------------------------------

# (N, C, H, W), (K, R, S), stride, padding, cpu_only
RESNET_CONV_CASES = [
    pytest.param((2, 8, 8, 8), (8, 3, 3), 1, 1, False, id="3x3s1-c8"),
    pytest.param((2, 8, 8, 8), (16, 3, 3), 2, 1, False, id="3x3s2-c8-k16"),
    pytest.param((2, 8, 8, 8), (16, 1, 1), 2, 0, False, id="1x1s2-c8-k16"),
    pytest.param((2, 16, 7, 7), (16, 3, 3), 2, 1, False, id="3x3s2-odd7"),
    pytest.param((1, 12, 9, 9), (16, 1, 1), 2, 0, False, id="1x1s2-odd9"),
    pytest.param((2, 1, 12, 12), (8, 3, 3), 1, 1, False, id="stem-1-channel"),
    pytest.param((2, 64, 8, 8), (64, 3, 3), 1, 1, True, id="3x3s1-c64"),
    pytest.param((2, 64, 8, 8), (128, 3, 3), 2, 1, True, id="3x3s2-c64-k128"),
    pytest.param((2, 64, 8, 8), (128, 1, 1), 2, 0, True, id="1x1s2-c64-k128"),
    pytest.param((1, 128, 7, 7), (256, 3, 3), 2, 1, True, id="3x3s2-c128-k256-odd"),
    pytest.param((2, 256, 4, 4), (512, 1, 1), 2, 0, True, id="1x1s2-c256-k512"),
    pytest.param((1, 512, 3, 3), (512, 3, 3), 1, 1, True, id="3x3s1-c512"),
    # ResNet-18's real layers on 28x28 Fashion-MNIST (d2l 12.6: no max-pool), batch 10 = one
    # full and one partial block of the CPU conv's 8-image batch sums.
    pytest.param((10, 1, 28, 28), (64, 3, 3), 1, 1, True, id="real-stem-1-64-28x28-n10"),
    pytest.param((2, 64, 28, 28), (64, 3, 3), 1, 1, True, id="real-b1-64-28x28"),
    pytest.param((2, 64, 28, 28), (128, 3, 3), 2, 1, True, id="real-b2-64-128-s2"),
    pytest.param((2, 64, 28, 28), (128, 1, 1), 2, 0, True, id="real-b2-shortcut-1x1s2"),
    pytest.param((2, 128, 14, 14), (256, 3, 3), 2, 1, True, id="real-b3-128-256-s2"),
    pytest.param((2, 256, 7, 7), (512, 3, 3), 2, 1, True, id="real-b4-256-512-s2-7to4"),
    pytest.param((2, 512, 4, 4), (512, 3, 3), 1, 1, True, id="real-b4-512-4x4"),
]


@pytest.mark.parametrize("xshape, kshape, stride, padding, cpu_only", RESNET_CONV_CASES)
def test_conv2d_at_resnet_shapes(device, rng, xshape, kshape, stride, padding, cpu_only):
    if cpu_only and device.kind != mgpu._core.DeviceKind.CPU:
        pytest.skip("64-512 channels run on CPU devices only (the emulator is slow)")
    bias = kshape[1] == 3  # ResNet's convs have biases in d2l's Residual; 1x1 both ways covered
    x, w, b = _conv_inputs(rng, xshape, kshape, bias)
    w = w / np.sqrt(xshape[1])  # keep sums near 1 so the tolerance is relative to the values
    xt, wt = on(x, device, True), on(w, device, True)
    bt = on(b, device, True) if bias else None
    out = mgpu.conv2d(xt, wt, bt, stride=stride, padding=padding)
    y = ref.conv2d_forward(x, w, b, stride, padding)
    dy = f32(rng.normal(size=out.shape))
    out.backward(on(dy, device))
    dx, dw, db = ref.conv2d_backward(x, w, dy, stride, padding, has_bias=bias)
    if device.kind == mgpu._core.DeviceKind.CPU and kshape[1:] == (3, 3) and stride == 1:
        # MGPU_CONV_ALGO=auto may run these on Winograd F(4x4, 3x3), whose error is normwise
        # (<= 3e-5 of the largest value, tests/test_conv_winograd.py), not per element.
        for got, want, what in ((out, y, "forward"), (xt.grad, dx, "dx")):
            np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=3e-5 * np.abs(want).max(),
                                       err_msg=f"conv2d {what} on {device}")
    else:
        assert_close(out.numpy(), y, "sum", "conv2d forward", device)
        assert_close(xt.grad.numpy(), dx, "sum", "conv2d dx", device)
    # dw and db add N*P*Q unit-size terms (1568 at 28x28): float32 rounding of such a sum is
    # ~sqrt(N*P*Q) * 6e-8 * its scale, so entries that cancel to near 0 are compared against
    # the gradient's largest entry instead of the fixed atol (a dropped tap or image is O(max)).
    scaled = dict(rtol=1e-4, atol=2e-6 * np.abs(dw).max())
    if device.kind == mgpu._core.DeviceKind.CPU and kshape[1:] == (3, 3) and stride == 1:
        scaled = dict(rtol=0, atol=3e-5 * np.abs(dw).max())  # Winograd's bound, as above
    np.testing.assert_allclose(wt.grad.numpy(), dw, **scaled, err_msg=f"conv2d dw on {device}")
    if bias:
        np.testing.assert_allclose(bt.grad.numpy(), db, rtol=1e-4, atol=2e-6 * np.abs(db).max(),
                                   err_msg=f"conv2d db on {device}")


@pytest.mark.parametrize("shape", [(2, 16, 4, 4), (3, 8, 7, 7), (1, 512, 1, 1), (2, 5, 3, 5)])
def test_global_avg_pool_is_avg_pool2d_over_the_whole_map(device, rng, shape):
    N, C, H, W = shape
    x = f32(rng.normal(size=shape))
    xt = on(x, device, True)
    out = mgpu.avg_pool2d(xt, kernel_size=(H, W))
    assert out.shape == (N, C, 1, 1)
    assert_close(out.numpy(), x.mean(axis=(2, 3), keepdims=True), "sum", "global avg pool",
                 device)
    dy = f32(rng.normal(size=(N, C, 1, 1)))
    out.backward(on(dy, device))
    assert_close(xt.grad.numpy(), np.broadcast_to(dy / (H * W), shape), "sum",
                 "global avg pool backward", device)


def test_linear_with_bias_at_resnet_head(device, rng):
    """ResNet-18's head: (N, 512) features @ (512, 10) + bias, forward and every gradient."""
    x, w, b = f32(rng.normal(size=(3, 512))), f32(rng.normal(size=(512, 10)) / 20), \
        f32(rng.normal(size=10))
    xt, wt, bt = on(x, device, True), on(w, device, True), on(b, device, True)
    out = mgpu.mm(xt, wt) + bt
    assert_close(out.numpy(), ref.linear_forward(x, w, b), "sum", "linear forward", device)
    dy = f32(rng.normal(size=(3, 10)))
    out.backward(on(dy, device))
    for t, g, name in zip((xt, wt, bt), ref.linear_backward(x, w, dy), ("dx", "dw", "db")):
        assert_close(t.grad.numpy(), g, "sum", f"linear {name}", device)


def test_residual_add_sums_both_paths_of_a_shared_intermediate(device, rng):
    """h = relu(x * w) feeds both branches of out = relu(h * v) + h (a non-leaf with two
    consumers): dh must be the sum of both paths' gradients, and so dx and dw."""
    x, w, v = (f32(off_kink(rng, (3, 4), low=0.1)) for _ in range(3))
    dy = f32(rng.normal(size=(3, 4)))
    xt, wt, vt = on(x, device, True), on(w, device, True), on(v, device, True)
    h = mgpu.relu(xt * wt)
    out = mgpu.relu(h * vt) + h
    out.backward(on(dy, device))
    h_ref = np.maximum(x * w, 0)
    dh = dy * (h_ref * v > 0) * v + dy
    assert_close(vt.grad.numpy(), dy * (h_ref * v > 0) * h_ref, "elementwise", "dv", device)
    assert_close(xt.grad.numpy(), dh * (x * w > 0) * w, "elementwise", "dx via both paths", device)
    assert_close(wt.grad.numpy(), dh * (x * w > 0) * x, "elementwise", "dw via both paths", device)


def _residual_block_reference(x, p, dy, eps):
    """float64 forward and backward of out = conv2(relu(bn1(conv1(h)))) + h with
    h = relu(bn0(conv0(x))), every BN in training mode; returns (out, grads by name)."""
    def conv_bn_relu(inp, w, b, g, be, stride, pad):
        z = ref.conv2d_forward(inp, w, b, stride, pad)
        y, _, _ = ref.batch_norm_train_forward(z, g, be, eps)
        return z, y, ref.relu_forward(y)

    z0, y0, h = conv_bn_relu(x, p["w0"], p["b0"], p["g0"], p["be0"], 1, 1)
    z1, y1, a1 = conv_bn_relu(h, p["w1"], p["b1"], p["g1"], p["be1"], 1, 1)
    out = ref.conv2d_forward(a1, p["w2"], p["b2"], 1, 1) + h
    grads = {}
    da1, grads["w2"], grads["b2"] = ref.conv2d_backward(a1, p["w2"], dy, 1, 1)
    dz1, grads["g1"], grads["be1"] = ref.batch_norm_train_backward(
        z1, p["g1"], ref.relu_backward(y1, da1), eps)
    dh_branch, grads["w1"], grads["b1"] = ref.conv2d_backward(h, p["w1"], dz1, 1, 1)
    dh = dh_branch + dy  # the shortcut's path
    dz0, grads["g0"], grads["be0"] = ref.batch_norm_train_backward(
        z0, p["g0"], ref.relu_backward(y0, dh), eps)
    _, grads["w0"], grads["b0"] = ref.conv2d_backward(x, p["w0"], dz0, 1, 1)
    return out, grads


def test_conv_bn_relu_residual_block_gradients(device, rng):
    """A residual block in which h feeds both the conv branch and the shortcut add: every
    parameter's gradient against the float64 reference backward (which sums both paths)."""
    N, C, H, W = 2, 3, 5, 6
    K = 4
    eps = 1e-5
    x = f32(rng.normal(size=(N, C, H, W)))
    p = {"w0": f32(rng.normal(size=(K, C, 3, 3)) / 3), "b0": f32(rng.normal(size=K)),
         "g0": f32(rng.uniform(0.5, 1.5, size=K)), "be0": f32(rng.normal(size=K)),
         "w1": f32(rng.normal(size=(K, K, 3, 3)) / 3), "b1": f32(rng.normal(size=K)),
         "g1": f32(rng.uniform(0.5, 1.5, size=K)), "be1": f32(rng.normal(size=K)),
         "w2": f32(rng.normal(size=(K, K, 3, 3)) / 3), "b2": f32(rng.normal(size=K))}
    dy = f32(rng.normal(size=(N, K, H, W)))
    t = {k: on(v, device, True) for k, v in p.items()}

    def bn(z, g, be):
        return mgpu.batch_norm(z, None, None, g, be, training=True, eps=eps)

    h = mgpu.relu(bn(mgpu.conv2d(on(x, device), t["w0"], t["b0"], padding=1), t["g0"], t["be0"]))
    a1 = mgpu.relu(bn(mgpu.conv2d(h, t["w1"], t["b1"], padding=1), t["g1"], t["be1"]))
    out = mgpu.conv2d(a1, t["w2"], t["b2"], padding=1) + h
    out.backward(on(dy, device))
    out_ref, grads = _residual_block_reference(x, p, dy, eps)
    assert_close(out.numpy(), out_ref, "sum", "residual block output", device)
    for name, g in grads.items():
        assert t[name].grad is not None, f"{name} got no gradient"
        assert_close(t[name].grad.numpy(), g, "sum", f"residual block d{name}", device)
