"""Checks that the NumPy references in reference.py can be trusted: every backward against central
finite differences (float64, rtol 1e-6), every forward against an independent formulation or a
hand-computed example, and the chapter's LeNet gradients and SGD step (D2L 12.5)."""

import numpy as np
import pytest

import reference as ref

EPS = 1e-6
RTOL = 1e-6
# Each output a step reaches carries rounding of about ulp(|y|) ~ 1e-15, which central differences
# divide by 2 * EPS; summed over the tens of outputs one input feeds this gives up to a few 1e-9
# absolute, so gradient entries near zero are compared with this floor instead of relatively.
ATOL = 1e-8


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def numerical_grad(f, x, dy, coords=None):
    """Central differences of sum(dy * f(x)) at every index of x (returned with x's shape), or at
    the given list of indices (returned as a flat array in that order). The two evaluations are
    subtracted before the sum, so outputs a step does not reach cancel exactly instead of adding
    their rounding noise."""
    x = np.array(x, dtype=np.float64)
    indices = list(np.ndindex(x.shape)) if coords is None else coords
    grad = np.empty(len(indices))
    for i, idx in enumerate(indices):
        orig = x[idx]
        x[idx] = orig + EPS
        f_plus = f(x)
        x[idx] = orig - EPS
        f_minus = f(x)
        x[idx] = orig
        grad[i] = np.sum(dy * (f_plus - f_minus)) / (2 * EPS)
    return grad.reshape(x.shape) if coords is None else grad


def assert_grads_match_fd(forward, inputs, dy, grads):
    """grads[i] must be the gradient of sum(dy * forward(*inputs)) with respect to inputs[i]."""
    assert len(inputs) == len(grads)
    for i, (x, g) in enumerate(zip(inputs, grads)):
        def forward_i(xi):
            return forward(*inputs[:i], xi, *inputs[i + 1:])
        np.testing.assert_allclose(g, numerical_grad(forward_i, x, dy), rtol=RTOL, atol=ATOL,
                                   err_msg=f"gradient of input {i}")


def off_kink(rng, shape, low=1e-3, high=2.0):
    """Random values with low <= |x| <= high and random signs, so EPS steps never cross 0."""
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(low, high, size=shape)


def _hw(v):
    """An int or an (h, w) pair, as (h, w)."""
    return tuple(int(n) for n in np.broadcast_to(v, (2,)))


# ---------------------------------------------------------------------------------------------
# conv2d
# ---------------------------------------------------------------------------------------------

# (N, C, H, W), (K, R, S), stride, padding
CONV_CASES = [
    pytest.param((1, 1, 5, 5), (1, 3, 3), 1, 0, id="batch1"),
    pytest.param((2, 3, 7, 5), (4, 3, 3), 1, 1, id="odd-nonsquare-pad1"),
    pytest.param((3, 2, 8, 7), (3, 3, 2), 2, 0, id="stride2-nonsquare-kernel"),
    pytest.param((2, 2, 6, 9), (3, 5, 5), 2, 2, id="stride2-pad2"),
    pytest.param((1, 2, 5, 4), (2, 3, 3), (2, 1), (0, 1), id="pairs"),
    pytest.param((2, 3, 4, 3), (2, 1, 1), 1, 0, id="1x1"),
]


def conv2d_direct(x, w, b, stride, padding):
    """One dot product per output position, visiting every window that fits in the padded image."""
    (sh, sw), (ph, pw) = _hw(stride), _hw(padding)
    xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    K, _, R, S = w.shape
    rows = range(0, xpad.shape[2] - R + 1, sh)
    cols = range(0, xpad.shape[3] - S + 1, sw)
    y = np.empty((x.shape[0], K, len(rows), len(cols)))
    for n in range(x.shape[0]):
        for k in range(K):
            for p, i in enumerate(rows):
                for q, j in enumerate(cols):
                    y[n, k, p, q] = np.sum(xpad[n, :, i:i + R, j:j + S] * w[k]) + b[k]
    return y


def conv_inputs(rng, x_shape, kernel):
    K, R, S = kernel
    x = rng.normal(size=x_shape)
    w = rng.normal(size=(K, x_shape[1], R, S))
    b = rng.normal(size=K)
    return x, w, b


@pytest.mark.parametrize("x_shape, kernel, stride, padding", CONV_CASES)
def test_conv2d_forward_matches_direct_loop(rng, x_shape, kernel, stride, padding):
    x, w, b = conv_inputs(rng, x_shape, kernel)
    expected = conv2d_direct(x, w, b, stride, padding)
    np.testing.assert_allclose(ref.conv2d_forward(x, w, b, stride, padding), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_shape, kernel, stride, padding", CONV_CASES)
def test_conv2d_backward_matches_finite_differences(rng, x_shape, kernel, stride, padding):
    x, w, b = conv_inputs(rng, x_shape, kernel)

    def forward(x, w, b):
        return ref.conv2d_forward(x, w, b, stride, padding)

    dy = rng.normal(size=forward(x, w, b).shape)
    assert_grads_match_fd(forward, (x, w, b), dy, ref.conv2d_backward(x, w, dy, stride, padding))


def test_conv2d_without_bias(rng):
    x, w, b = conv_inputs(rng, (2, 3, 6, 5), (4, 3, 3))
    y = ref.conv2d_forward(x, w, stride=2, padding=1)
    np.testing.assert_allclose(y + b[None, :, None, None],
                               ref.conv2d_forward(x, w, b, stride=2, padding=1), rtol=1e-14)
    dy = rng.normal(size=y.shape)
    dx, dw, db = ref.conv2d_backward(x, w, dy, stride=2, padding=1, has_bias=False)
    assert db is None
    with_bias = ref.conv2d_backward(x, w, dy, stride=2, padding=1)
    np.testing.assert_array_equal(dx, with_bias[0])
    np.testing.assert_array_equal(dw, with_bias[1])


def test_conv2d_rejects_channel_mismatch(rng):
    with pytest.raises(ValueError, match="channels"):
        ref.conv2d_forward(rng.normal(size=(1, 2, 5, 5)), rng.normal(size=(3, 1, 3, 3)))


# ---------------------------------------------------------------------------------------------
# avg_pool2d
# ---------------------------------------------------------------------------------------------

# x shape, kernel_size, stride
POOL_CASES = [
    pytest.param((1, 1, 4, 4), 2, None, id="batch1-default-stride"),
    pytest.param((2, 3, 9, 9), 2, 2, id="floor-9x9"),
    pytest.param((2, 2, 7, 5), (3, 2), (2, 1), id="kernel3x2-stride2x1"),
    pytest.param((1, 2, 5, 6), 3, 1, id="overlapping"),
    pytest.param((3, 1, 6, 5), (2, 2), (2, 2), id="nonsquare-image"),
]


def avg_pool2d_direct(x, kernel_size, stride):
    """One mean per output position, visiting every window that fits in the image."""
    (kh, kw), (sh, sw) = _hw(kernel_size), _hw(kernel_size if stride is None else stride)
    rows = range(0, x.shape[2] - kh + 1, sh)
    cols = range(0, x.shape[3] - kw + 1, sw)
    y = np.empty(x.shape[:2] + (len(rows), len(cols)))
    for p, i in enumerate(rows):
        for q, j in enumerate(cols):
            y[:, :, p, q] = x[:, :, i:i + kh, j:j + kw].mean(axis=(2, 3))
    return y


def test_avg_pool2d_forward_hand_example():
    x = np.arange(25.0).reshape(1, 1, 5, 5)
    # Windows {0,1,5,6}, {2,3,7,8}, {10,11,15,16}, {12,13,17,18}; row 4 and column 4 are dropped.
    np.testing.assert_array_equal(ref.avg_pool2d_forward(x, 2), [[[[3.0, 5.0], [13.0, 15.0]]]])


def test_avg_pool2d_forward_hand_example_kernel3x2_stride2x1():
    x = np.arange(20.0).reshape(1, 1, 5, 4)
    # x[i, j] = 4i + j, so a window at rows 2p..2p+2, columns q..q+1 averages to 4(2p+1) + q + 0.5.
    expected = [[[[4.5, 5.5, 6.5], [12.5, 13.5, 14.5]]]]
    np.testing.assert_array_equal(ref.avg_pool2d_forward(x, (3, 2), (2, 1)), expected)


def test_avg_pool2d_9x9_drops_last_row_and_column(rng):
    x = rng.normal(size=(2, 3, 9, 9))
    assert ref.avg_pool2d_forward(x, 2, 2).shape == (2, 3, 4, 4)
    dy = rng.normal(size=(2, 3, 4, 4))
    dx = ref.avg_pool2d_backward(x.shape, dy, 2, 2)
    assert dx.shape == x.shape
    np.testing.assert_array_equal(dx[:, :, 8, :], 0.0)
    np.testing.assert_array_equal(dx[:, :, :, 8], 0.0)
    upsampled = np.repeat(np.repeat(dy, 2, axis=2), 2, axis=3)
    np.testing.assert_array_equal(dx[:, :, :8, :8], upsampled / 4)


@pytest.mark.parametrize("x_shape, kernel_size, stride", POOL_CASES)
def test_avg_pool2d_forward_matches_direct_loop(rng, x_shape, kernel_size, stride):
    x = rng.normal(size=x_shape)
    np.testing.assert_allclose(ref.avg_pool2d_forward(x, kernel_size, stride),
                               avg_pool2d_direct(x, kernel_size, stride), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("x_shape, kernel_size, stride", POOL_CASES)
def test_avg_pool2d_backward_matches_finite_differences(rng, x_shape, kernel_size, stride):
    x = rng.normal(size=x_shape)

    def forward(x):
        return ref.avg_pool2d_forward(x, kernel_size, stride)

    dy = rng.normal(size=forward(x).shape)
    assert_grads_match_fd(forward, (x,), dy,
                          (ref.avg_pool2d_backward(x.shape, dy, kernel_size, stride),))


# ---------------------------------------------------------------------------------------------
# relu, mm, bias_add_rows, linear
# ---------------------------------------------------------------------------------------------

SHAPES = [(1,), (3, 5), (2, 3, 4, 5)]


def test_relu_hand_example():
    x = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    np.testing.assert_array_equal(ref.relu_forward(x), [0.0, 0.0, 0.0, 0.5, 3.0])
    # The gradient at exactly 0 is taken as 0 (dx = dy only where x > 0).
    np.testing.assert_array_equal(ref.relu_backward(x, np.full(5, 7.0)), [0.0, 0.0, 0.0, 7.0, 7.0])


@pytest.mark.parametrize("shape", SHAPES)
def test_relu_backward_matches_finite_differences(rng, shape):
    x = off_kink(rng, shape)
    dy = rng.normal(size=shape)
    assert_grads_match_fd(ref.relu_forward, (x,), dy, (ref.relu_backward(x, dy),))


# (M, J, L): a is (M, J), b is (J, L)
MM_CASES = [(1, 1, 1), (1, 6, 3), (4, 7, 3), (5, 2, 9)]


@pytest.mark.parametrize("M, J, L", MM_CASES)
def test_mm_forward_matches_explicit_sum(rng, M, J, L):
    a, b = rng.normal(size=(M, J)), rng.normal(size=(J, L))
    expected = np.array([[sum(a[row, j] * b[j, col] for j in range(J)) for col in range(L)]
                         for row in range(M)])
    np.testing.assert_allclose(ref.mm_forward(a, b), expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("M, J, L", MM_CASES)
def test_mm_backward_matches_finite_differences(rng, M, J, L):
    a, b = rng.normal(size=(M, J)), rng.normal(size=(J, L))
    dy = rng.normal(size=(M, L))
    assert_grads_match_fd(ref.mm_forward, (a, b), dy, ref.mm_backward(a, b, dy))


def test_bias_add_rows_hand_example():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    np.testing.assert_array_equal(ref.bias_add_rows_forward(x, [10.0, 20.0, 30.0]),
                                  [[11.0, 22.0, 33.0], [14.0, 25.0, 36.0]])


@pytest.mark.parametrize("N, M", [(1, 1), (1, 4), (5, 3)])
def test_bias_add_rows_backward_matches_finite_differences(rng, N, M):
    x, b = rng.normal(size=(N, M)), rng.normal(size=M)
    dy = rng.normal(size=(N, M))
    assert_grads_match_fd(ref.bias_add_rows_forward, (x, b), dy, ref.bias_add_rows_backward(dy))


@pytest.mark.parametrize("N, n_in, n_out", [(1, 3, 2), (4, 7, 5), (3, 1, 1)])
def test_linear_forward_and_backward(rng, N, n_in, n_out):
    x, w, b = rng.normal(size=(N, n_in)), rng.normal(size=(n_in, n_out)), rng.normal(size=n_out)
    np.testing.assert_allclose(ref.linear_forward(x, w, b), x @ w + b, rtol=1e-13, atol=1e-14)
    dy = rng.normal(size=(N, n_out))
    assert_grads_match_fd(ref.linear_forward, (x, w, b), dy, ref.linear_backward(x, w, dy))


# ---------------------------------------------------------------------------------------------
# batch norm (d2l 12.6)
# ---------------------------------------------------------------------------------------------

BN_SHAPES = [(2, 3, 3, 4), (1, 2, 3, 3), (3, 1, 2, 5), (5, 4), (4, 1)]


def bn_direct_stats(x):
    """Per-channel mean and biased variance by explicit loops over the (n, h, w) of each channel."""
    x4 = x if x.ndim == 4 else x[:, :, None, None]
    N, C, H, W = x4.shape
    mean, var = np.zeros(C), np.zeros(C)
    for c in range(C):
        values = [x4[n, c, h, w] for n in range(N) for h in range(H) for w in range(W)]
        mean[c] = sum(values) / len(values)
        var[c] = sum((v - mean[c]) ** 2 for v in values) / len(values)
    return mean, var


@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_stats_match_direct_loops(rng, shape):
    x = rng.normal(loc=3.0, size=shape)
    for got, want in zip(ref.batch_norm_stats(x), bn_direct_stats(x)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_batch_norm_hand_example():
    # One channel holding 1, 2, 3, 4 (N=2, H=1, W=2): mean 2.5, biased var 1.25.
    x = np.array([[[[1.0, 2.0]]], [[[3.0, 4.0]]]])
    y, mean, var = ref.batch_norm_train_forward(x, np.array([2.0]), np.array([0.5]), eps=0.0)
    np.testing.assert_allclose(mean, [2.5])
    np.testing.assert_allclose(var, [1.25])
    xhat = (np.array([1.0, 2.0, 3.0, 4.0]) - 2.5) / np.sqrt(1.25)
    np.testing.assert_allclose(y.ravel(), 2.0 * xhat + 0.5, rtol=1e-15)
    rm, rv = ref.batch_norm_running_update(np.array([1.0]), np.array([2.0]), x, momentum=0.1)
    np.testing.assert_allclose(rm, [0.9 * 1.0 + 0.1 * 2.5])
    np.testing.assert_allclose(rv, [0.9 * 2.0 + 0.1 * 1.25 * 4 / 3])


@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_train_backward_matches_finite_differences(rng, shape, affine):
    x = rng.normal(loc=1.0, scale=2.0, size=shape)
    C = shape[1]
    gamma, beta = (rng.normal(size=C), rng.normal(size=C)) if affine else (None, None)
    dy = rng.normal(size=shape)
    dx, dgamma, dbeta = ref.batch_norm_train_backward(x, gamma, dy, eps=1e-3)
    if affine:
        forward = lambda x, g, b: ref.batch_norm_train_forward(x, g, b, eps=1e-3)[0]  # noqa: E731
        assert_grads_match_fd(forward, (x, gamma, beta), dy, (dx, dgamma, dbeta))
    else:
        forward = lambda x: ref.batch_norm_train_forward(x, eps=1e-3)[0]  # noqa: E731
        assert_grads_match_fd(forward, (x,), dy, (dx,))
        # Without gamma and beta their gradients are still dgamma, dbeta of gamma = 1, beta = 0.
        forward = lambda g, b: ref.batch_norm_train_forward(x, g, b, eps=1e-3)[0]  # noqa: E731
        assert_grads_match_fd(forward, (np.ones(C), np.zeros(C)), dy, (dgamma, dbeta))


@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_eval_backward_matches_finite_differences(rng, shape):
    x = rng.normal(size=shape)
    C = shape[1]
    mean, var = rng.normal(size=C), rng.uniform(0.5, 2.0, size=C)
    gamma, beta = rng.normal(size=C), rng.normal(size=C)
    dy = rng.normal(size=shape)
    forward = lambda x, g, b: ref.batch_norm_eval_forward(x, mean, var, g, b, eps=1e-3)  # noqa: E731
    assert_grads_match_fd(forward, (x, gamma, beta), dy,
                          ref.batch_norm_eval_backward(x, mean, var, gamma, dy, eps=1e-3))


def test_batch_norm_train_output_is_normalised(rng):
    x = rng.normal(loc=5.0, scale=3.0, size=(4, 3, 5, 5))
    y, _, _ = ref.batch_norm_train_forward(x, eps=1e-12)
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), 1.0, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# softmax cross-entropy, argmax, sgd
# ---------------------------------------------------------------------------------------------

CE_CASES = [(1, 1), (1, 10), (5, 3), (4, 10)]


@pytest.mark.parametrize("N, M", CE_CASES)
def test_softmax_cross_entropy_forward_matches_naive(rng, N, M):
    logits = rng.normal(scale=3.0, size=(N, M))
    labels = rng.integers(0, M, size=N)
    softmax = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected = -np.log(softmax[np.arange(N), labels])
    np.testing.assert_allclose(ref.softmax_cross_entropy_forward(logits, labels), expected,
                               rtol=1e-12, atol=1e-14)


def test_softmax_cross_entropy_is_stable_for_large_logits():
    logits = np.array([[1000.0, 1000.0, -1000.0], [1000.0, 0.0, 0.0], [-1000.0, -1000.0, -1000.0]])
    labels = np.array([0, 1, 2])
    losses = ref.softmax_cross_entropy_forward(logits, labels)
    np.testing.assert_allclose(losses, [np.log(2.0), 1000.0, np.log(3.0)], rtol=1e-14)
    dlogits = ref.softmax_cross_entropy_backward(logits, labels, np.ones(3))
    np.testing.assert_allclose(dlogits, [[-0.5, 0.5, 0.0], [1.0, -1.0, 0.0],
                                         [1 / 3, 1 / 3, -2 / 3]], rtol=1e-14)


@pytest.mark.parametrize("N, M", CE_CASES)
def test_softmax_cross_entropy_backward_matches_finite_differences(rng, N, M):
    logits = rng.normal(scale=3.0, size=(N, M))
    labels = rng.integers(0, M, size=N)
    dloss = rng.normal(size=N)

    def forward(logits):
        return ref.softmax_cross_entropy_forward(logits, labels)

    assert_grads_match_fd(forward, (logits,), dloss,
                          (ref.softmax_cross_entropy_backward(logits, labels, dloss),))


@pytest.mark.parametrize("labels", [[0, 3], [0.0, 1.0], [0]],
                         ids=["out-of-range", "float", "short"])
def test_softmax_cross_entropy_rejects_bad_labels(labels):
    with pytest.raises(ValueError, match="labels"):
        ref.softmax_cross_entropy_forward(np.zeros((2, 3)), labels)


def test_argmax_hand_example():
    x = np.array([[1.0, 5.0, 5.0], [7.0, -1.0, 2.0]])
    np.testing.assert_array_equal(ref.argmax(x, axis=1), [1, 0])  # ties go to the first index
    np.testing.assert_array_equal(ref.argmax(x, axis=0), [1, 0, 0])


def test_sgd_update_hand_example():
    new = ref.sgd_update([np.array([1.0, -2.0]), np.array(3.0)],
                         [np.array([4.0, 2.0]), np.array(-8.0)], lr=0.1, batch_size=4)
    np.testing.assert_allclose(new[0], [0.9, -2.05], rtol=1e-15)
    np.testing.assert_allclose(new[1], 3.2, rtol=1e-15)
    with pytest.raises(ValueError, match="2 params but 1 grads"):
        ref.sgd_update(new, new[:1], lr=0.1, batch_size=4)


# ---------------------------------------------------------------------------------------------
# LeNet (D2L 12.5)
# ---------------------------------------------------------------------------------------------

PARAM_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]
RELU_INPUTS = ("z1", "z2", "z3")


def lenet_params(rng):
    """He-scaled weights and small nonzero biases, so every layer's activations are O(1) and
    gradients reach all parameters (the chapter's scale 0.01 would make them vanish)."""
    params = []
    for shape in PARAM_SHAPES:
        if len(shape) == 1:
            scale = 0.1
        else:  # fan-in of a conv weight (K, C, R, S) is C*R*S, of a linear weight (in, out) is in
            fan_in = np.prod(shape[1:]) if len(shape) == 4 else shape[0]
            scale = np.sqrt(2.0 / fan_in)
        params.append(rng.normal(scale=scale, size=shape))
    return params


def lenet_batch(rng, N):
    return rng.uniform(size=(N, 1, 28, 28)), rng.integers(0, 10, size=N)


def test_lenet_shapes_and_loss(rng):
    params = lenet_params(rng)
    X, y = lenet_batch(rng, 3)
    logits = ref.lenet_forward(X, params)
    assert logits.shape == (3, 10)
    loss, grads = ref.lenet_loss_and_grads(X, y, params)
    np.testing.assert_allclose(loss, ref.softmax_cross_entropy_forward(logits, y).sum(), rtol=1e-14)
    assert [g.shape for g in grads] == PARAM_SHAPES
    # Every ReLU sees both signs, so the FD test below exercises the masks.
    _, cache = ref.lenet_forward_cache(X, params)
    for name in RELU_INPUTS:
        assert (cache[name] > 0).any() and (cache[name] < 0).any(), name


def test_lenet_grads_match_finite_differences(rng):
    params = lenet_params(rng)
    X, y = lenet_batch(rng, 2)
    _, grads = ref.lenet_loss_and_grads(X, y, params)
    _, base_cache = ref.lenet_forward_cache(X, params)
    for i, (p, g) in enumerate(zip(params, grads)):
        coords = [tuple(int(rng.integers(0, n)) for n in p.shape) for _ in range(5)]

        def losses(p_i):
            logits, cache = ref.lenet_forward_cache(X, params[:i] + [p_i] + params[i + 1:])
            # Central differences are only valid if no ReLU input crosses its kink between the
            # two evaluation points.
            for name in RELU_INPUTS:
                assert np.array_equal(cache[name] > 0, base_cache[name] > 0), (i, name)
            return ref.softmax_cross_entropy_forward(logits, y)

        # The gradient of the summed loss: numerical_grad sums the per-example differences.
        np.testing.assert_allclose([g[c] for c in coords], numerical_grad(losses, p, 1.0, coords),
                                   rtol=RTOL, atol=ATOL, err_msg=f"param {i} at {coords}")


def test_lenet_batch_gradient_is_sum_of_shard_gradients(rng):
    # train_batch relies on this: the gradient of a batch's summed loss is the allreduce (sum) of
    # the gradients of its shards, whatever the shard sizes.
    params = lenet_params(rng)
    X, y = lenet_batch(rng, 4)
    loss, grads = ref.lenet_loss_and_grads(X, y, params)
    loss_a, grads_a = ref.lenet_loss_and_grads(X[:1], y[:1], params)
    loss_b, grads_b = ref.lenet_loss_and_grads(X[1:], y[1:], params)
    np.testing.assert_allclose(loss, loss_a + loss_b, rtol=1e-13)
    for g, ga, gb in zip(grads, grads_a, grads_b):
        np.testing.assert_allclose(g, ga + gb, rtol=1e-10, atol=1e-13)


def test_train_step_reference(rng):
    params = lenet_params(rng)
    X, y = lenet_batch(rng, 3)
    lr = 1e-4
    loss, grads = ref.lenet_loss_and_grads(X, y, params)
    new = ref.train_step_reference(X, y, params, lr)
    # A small step p - lr * g / N changes the loss by about -lr / N * |g|^2 (first order).
    predicted = -lr / 3 * sum(np.sum(g**2) for g in grads)
    assert 0.95 < (ref.lenet_loss_and_grads(X, y, new)[0] - loss) / predicted < 1.05
    # Gradients are summed over the batch and divided by its size, so repeating every example
    # doubles both and leaves the step unchanged.
    X2, y2 = np.concatenate([X, X]), np.concatenate([y, y])
    for p, p2 in zip(new, ref.train_step_reference(X2, y2, params, lr)):
        np.testing.assert_allclose(p2, p, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# Optional cross-check against PyTorch, when it is installed.
# ---------------------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed; the references are "
                                               "checked against finite differences only")


def _torch_grads(torch, f, inputs, dy):
    """Forward f on float64 tensors of inputs, backward with dy; returns (y, [d input])."""
    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in inputs]
    y = f(*ts)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("x_shape, kernel, stride, padding", CONV_CASES)
def test_conv2d_matches_torch(rng, x_shape, kernel, stride, padding):
    torch = _torch()
    x, w, b = conv_inputs(rng, x_shape, kernel)
    y = ref.conv2d_forward(x, w, b, stride, padding)
    dy = rng.normal(size=y.shape)
    y_t, grads_t = _torch_grads(
        torch, lambda x, w, b: torch.nn.functional.conv2d(x, w, b, stride, padding), (x, w, b), dy)
    np.testing.assert_allclose(y, y_t, rtol=1e-12, atol=1e-12)
    for g, g_t in zip(ref.conv2d_backward(x, w, dy, stride, padding), grads_t):
        np.testing.assert_allclose(g, g_t, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("x_shape, kernel_size, stride", POOL_CASES)
def test_avg_pool2d_matches_torch(rng, x_shape, kernel_size, stride):
    torch = _torch()
    x = rng.normal(size=x_shape)
    y = ref.avg_pool2d_forward(x, kernel_size, stride)
    dy = rng.normal(size=y.shape)
    y_t, (dx_t,) = _torch_grads(
        torch, lambda x: torch.nn.functional.avg_pool2d(x, kernel_size, stride), (x,), dy)
    np.testing.assert_allclose(y, y_t, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ref.avg_pool2d_backward(x.shape, dy, kernel_size, stride), dx_t,
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("N, M", CE_CASES)
def test_softmax_cross_entropy_matches_torch(rng, N, M):
    torch = _torch()
    logits = rng.normal(scale=3.0, size=(N, M))
    labels = rng.integers(0, M, size=N)
    dloss = rng.normal(size=N)

    def forward(z):
        return torch.nn.functional.cross_entropy(z, torch.tensor(labels), reduction="none")

    loss_t, (dlogits_t,) = _torch_grads(torch, forward, (logits,), dloss)
    np.testing.assert_allclose(ref.softmax_cross_entropy_forward(logits, labels), loss_t,
                               rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ref.softmax_cross_entropy_backward(logits, labels, dloss),
                               dlogits_t, rtol=1e-12, atol=1e-14)
