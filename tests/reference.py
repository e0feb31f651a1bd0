"""Trusted NumPy references for every mgpu op and its backward, and for the chapter's LeNet step.

The C++ ops are tested against these (test_ops.py), and these are tested against finite differences
(test_reference.py). Everything computes in float64 and is written for clarity, not speed. Shapes:
N batch, C in-channels, K out-channels, H/W image, R/S kernel, P/Q output height/width (D2L 12.5).
"""

import numpy as np


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _pair(v):
    """An int or an (h, w) pair, as (h, w)."""
    return (v, v) if np.isscalar(v) else tuple(v)


def _out_size(size, kernel, stride):
    return (size - kernel) // stride + 1


def _window_slices(r, s, P, Q, sh, sw):
    """Index of the (N, C, P, Q) view whose [n, c, p, q] is the image at (p*sh + r, q*sw + s)."""
    return (slice(None), slice(None),
            slice(r, r + sh * (P - 1) + 1, sh), slice(s, s + sw * (Q - 1) + 1, sw))


def _pad_hw(x, ph, pw):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


# ---------------------------------------------------------------------------------------------
# conv2d: cross-correlation with zero padding, like PyTorch F.conv2d.
# y[n, k, p, q] = b[k] + sum_{c, r, s} w[k, c, r, s] * xpad[n, c, p*sh + r, q*sw + s]
# ---------------------------------------------------------------------------------------------

def conv2d_forward(x, w, b=None, stride=1, padding=0):
    """x (N, C, H, W), w (K, C, R, S), b (K,) or None -> y (N, K, P, Q),
    P = (H + 2*ph - R) // sh + 1, Q = (W + 2*pw - S) // sw + 1. stride, padding: int or (h, w)."""
    x, w = _f64(x), _f64(w)
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    N, C, H, W = x.shape
    K, C_w, R, S = w.shape
    if C != C_w:
        raise ValueError(f"conv2d_forward: x has {C} channels but w expects {C_w}")
    P, Q = _out_size(H + 2 * ph, R, sh), _out_size(W + 2 * pw, S, sw)
    xpad = _pad_hw(x, ph, pw)
    y = np.zeros((N, K, P, Q))
    for r in range(R):
        for s in range(S):
            y += np.einsum("ncpq,kc->nkpq", xpad[_window_slices(r, s, P, Q, sh, sw)], w[:, :, r, s])
    if b is not None:
        y += _f64(b)[None, :, None, None]
    return y


def conv2d_backward(x, w, dy, stride=1, padding=0, has_bias=True):
    """x (N, C, H, W), w (K, C, R, S), dy (N, K, P, Q) -> (dx (N, C, H, W), dw (K, C, R, S),
    db (K,) or None when has_bias is False). Input positions no window reaches get dx = 0."""
    x, w, dy = _f64(x), _f64(w), _f64(dy)
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    H, W = x.shape[2:]
    R, S = w.shape[2:]
    P, Q = dy.shape[2:]
    xpad = _pad_hw(x, ph, pw)
    dxpad = np.zeros_like(xpad)
    dw = np.zeros_like(w)
    for r in range(R):
        for s in range(S):
            window = _window_slices(r, s, P, Q, sh, sw)
            dw[:, :, r, s] = np.einsum("ncpq,nkpq->kc", xpad[window], dy)
            dxpad[window] += np.einsum("nkpq,kc->ncpq", dy, w[:, :, r, s])
    dx = dxpad[:, :, ph:ph + H, pw:pw + W]
    db = dy.sum(axis=(0, 2, 3)) if has_bias else None
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# avg_pool2d: no padding, floor output size, so trailing rows/columns no window covers are dropped.
# y[n, c, p, q] = mean_{i < kh, j < kw} x[n, c, p*sh + i, q*sw + j]
# ---------------------------------------------------------------------------------------------

def _pool_geometry(H, W, kernel_size, stride):
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(kernel_size if stride is None else stride)
    return kh, kw, sh, sw, _out_size(H, kh, sh), _out_size(W, kw, sw)


def avg_pool2d_forward(x, kernel_size, stride=None):
    """x (N, C, H, W) -> y (N, C, P, Q), P = (H - kh) // sh + 1, Q = (W - kw) // sw + 1.
    kernel_size, stride: int or (h, w); stride defaults to kernel_size."""
    x = _f64(x)
    N, C, H, W = x.shape
    kh, kw, sh, sw, P, Q = _pool_geometry(H, W, kernel_size, stride)
    y = np.zeros((N, C, P, Q))
    for i in range(kh):
        for j in range(kw):
            y += x[_window_slices(i, j, P, Q, sh, sw)]
    return y / (kh * kw)


def avg_pool2d_backward(x_shape, dy, kernel_size, stride=None):
    """x_shape (N, C, H, W), dy (N, C, P, Q) -> dx (N, C, H, W); each output spreads dy / (kh*kw)
    over its window, and positions no window covers get 0."""
    dy = _f64(dy)
    H, W = x_shape[2:]
    kh, kw, sh, sw, P, Q = _pool_geometry(H, W, kernel_size, stride)
    dx = np.zeros(x_shape)
    for i in range(kh):
        for j in range(kw):
            dx[_window_slices(i, j, P, Q, sh, sw)] += dy / (kh * kw)
    return dx


# ---------------------------------------------------------------------------------------------
# max_pool2d: implicit -inf padding, floor output size (PyTorch's F.max_pool2d, dilation 1).
# y[n, c, p, q] = max over the window's image elements x[n, c, p*sh - ph + i, q*sw - pw + j].
# The winner is PyTorch's CPU kernel's: read the window in row-major order, starting from -inf
# at its first image element, and take a value greater than the best so far, or NaN.
# ---------------------------------------------------------------------------------------------

def max_pool2d_forward(x, kernel_size, stride=None, padding=0):
    """x (N, C, H, W) -> (y (N, C, P, Q), index (N, C, P, Q) int64: the winner's h * W + w),
    P = (H + 2*ph - kh) // sh + 1, Q likewise. stride defaults to kernel_size."""
    x = _f64(x)
    N, C, H, W = x.shape
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(kernel_size if stride is None else stride)
    ph, pw = _pair(padding)
    P, Q = _out_size(H + 2 * ph, kh, sh), _out_size(W + 2 * pw, kw, sw)
    y = np.empty((N, C, P, Q))
    index = np.empty((N, C, P, Q), dtype=np.int64)
    for n in range(N):
        for c in range(C):
            for p in range(P):
                for q in range(Q):
                    rows = range(max(p * sh - ph, 0), min(p * sh - ph + kh, H))
                    cols = range(max(q * sw - pw, 0), min(q * sw - pw + kw, W))
                    best, at = -np.inf, rows[0] * W + cols[0]
                    for h in rows:
                        for w in cols:
                            if x[n, c, h, w] > best or np.isnan(x[n, c, h, w]):
                                best, at = x[n, c, h, w], h * W + w
                    y[n, c, p, q], index[n, c, p, q] = best, at
    return y, index


def max_pool2d_backward(x, dy, kernel_size, stride=None, padding=0):
    """x (N, C, H, W), dy (N, C, P, Q) -> dx (N, C, H, W): each dy added at its window's winner."""
    x, dy = _f64(x), _f64(dy)
    N, C, H, W = x.shape
    _, index = max_pool2d_forward(x, kernel_size, stride, padding)
    dx = np.zeros((N, C, H * W))
    for n in range(N):
        for c in range(C):
            np.add.at(dx[n, c], index[n, c].ravel(), dy[n, c].ravel())
    return dx.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Elementwise, matrix product, linear layer.
# ---------------------------------------------------------------------------------------------

def relu_forward(x):
    """x (any shape) -> y = max(x, 0), same shape."""
    x = _f64(x)
    return np.where(x > 0, x, 0.0)


def relu_backward(x, dy):
    """x, dy (same shape) -> dx = dy where x > 0 else 0 (so the gradient at exactly 0 is 0)."""
    x, dy = _f64(x), _f64(dy)
    return np.where(x > 0, dy, 0.0)


def mm_forward(a, b):
    """a (M, J), b (J, L) -> a @ b (M, L)."""
    return np.einsum("mj,jl->ml", _f64(a), _f64(b))


def mm_backward(a, b, dy):
    """a (M, J), b (J, L), dy (M, L) -> (da = dy @ b.T (M, J), db = a.T @ dy (J, L))."""
    a, b, dy = _f64(a), _f64(b), _f64(dy)
    return np.einsum("ml,jl->mj", dy, b), np.einsum("mj,ml->jl", a, dy)


def bias_add_rows_forward(x, b):
    """x (N, M), b (M,) -> x + b, b added to every row."""
    return _f64(x) + _f64(b)[None, :]


def bias_add_rows_backward(dy):
    """dy (N, M) -> (dx = dy (N, M), db = dy summed over rows (M,))."""
    dy = _f64(dy)
    return dy, dy.sum(axis=0)


def linear_forward(x, w, b):
    """x (N, in), w (in, out) as in the chapter (W3 is (800, 128)), b (out,)
    -> x @ w + b (N, out)."""
    return bias_add_rows_forward(mm_forward(x, w), b)


def linear_backward(x, w, dy):
    """x (N, in), w (in, out), dy (N, out) -> (dx (N, in), dw (in, out), db (out,))."""
    dx, dw = mm_backward(x, w, dy)
    _, db = bias_add_rows_backward(dy)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# batch norm (d2l 12.6's ResNet-18, PyTorch's F.batch_norm): statistics per channel over N, H, W
# (axis 0 only for (N, C) input). Training: xhat = (x - mean) / sqrt(var + eps) with the batch's
# mean and biased var, y = gamma * xhat + beta; evaluation uses the running statistics instead.
# ---------------------------------------------------------------------------------------------

def _bn_axes(x):
    return (0,) if x.ndim == 2 else (0, 2, 3)


def _per_channel(v, x):
    """A (C,) vector shaped to broadcast against x (N, C) or (N, C, H, W)."""
    v = _f64(v)
    return v[None, :] if x.ndim == 2 else v[None, :, None, None]


def batch_norm_stats(x):
    """x (N, C, H, W) or (N, C) -> (mean (C,), biased var (C,)), two-pass in float64."""
    x = _f64(x)
    mean = x.mean(axis=_bn_axes(x))
    var = ((x - _per_channel(mean, x)) ** 2).mean(axis=_bn_axes(x))
    return mean, var


def batch_norm_eval_forward(x, mean, var, gamma=None, beta=None, eps=1e-5):
    """Normalises x with the given (constant) statistics: (x - mean) / sqrt(var + eps) * gamma
    + beta; gamma, beta (C,) or None (1 and 0)."""
    x = _f64(x)
    C = x.shape[1]
    gamma = np.ones(C) if gamma is None else gamma
    beta = np.zeros(C) if beta is None else beta
    xhat = (x - _per_channel(mean, x)) / np.sqrt(_per_channel(var, x) + eps)
    return xhat * _per_channel(gamma, x) + _per_channel(beta, x)


def batch_norm_train_forward(x, gamma=None, beta=None, eps=1e-5):
    """Normalises x with its own batch statistics -> (y, mean, biased var)."""
    mean, var = batch_norm_stats(x)
    return batch_norm_eval_forward(x, mean, var, gamma, beta, eps), mean, var


def batch_norm_eval_backward(x, mean, var, gamma, dy, eps=1e-5):
    """Statistics constant: dx = gamma / sqrt(var + eps) * dy, dgamma = sum(dy * xhat),
    dbeta = sum(dy) -> (dx, dgamma, dbeta); gamma None means 1."""
    x, dy = _f64(x), _f64(dy)
    gamma = np.ones(x.shape[1]) if gamma is None else gamma
    invstd = 1.0 / np.sqrt(_per_channel(var, x) + eps)
    xhat = (x - _per_channel(mean, x)) * invstd
    axes = _bn_axes(x)
    return dy * _per_channel(gamma, x) * invstd, (dy * xhat).sum(axis=axes), dy.sum(axis=axes)


def batch_norm_train_backward(x, gamma, dy, eps=1e-5):
    """Batch statistics depend on x: the chain rule through mean and var, step by step (m = N*H*W
    elements per channel) -> (dx, dgamma, dbeta); gamma None means 1."""
    x, dy = _f64(x), _f64(dy)
    axes = _bn_axes(x)
    m = x.size // x.shape[1]
    gamma = np.ones(x.shape[1]) if gamma is None else gamma
    mean, var = batch_norm_stats(x)
    centered = x - _per_channel(mean, x)
    invstd = 1.0 / np.sqrt(_per_channel(var, x) + eps)
    dxhat = dy * _per_channel(gamma, x)
    dvar = (dxhat * centered).sum(axis=axes, keepdims=True) * -0.5 * invstd ** 3
    dmean = (-dxhat * invstd).sum(axis=axes, keepdims=True) \
        + dvar * (-2.0 * centered).sum(axis=axes, keepdims=True) / m
    dx = dxhat * invstd + dvar * 2.0 * centered / m + dmean / m
    return dx, (dy * centered * invstd).sum(axis=axes), dy.sum(axis=axes)


def batch_norm_running_update(running_mean, running_var, x, momentum=0.1):
    """PyTorch's update after a training step: new = (1 - momentum) * old + momentum * batch
    statistic, the variance unbiased (times m / (m - 1)) -> (new mean, new var)."""
    x = _f64(x)
    m = x.size // x.shape[1]
    mean, var = batch_norm_stats(x)
    return ((1 - momentum) * _f64(running_mean) + momentum * mean,
            (1 - momentum) * _f64(running_var) + momentum * var * m / (m - 1))


# ---------------------------------------------------------------------------------------------
# Softmax + cross-entropy as one op (reduction none), argmax, SGD.
# ---------------------------------------------------------------------------------------------

def _log_softmax(logits):
    """Row-wise log-softmax; subtracting the row max first keeps exp from overflowing."""
    z = logits - logits.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _check_labels(labels, N, M):
    labels = np.asarray(labels)
    if labels.shape != (N,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"softmax_cross_entropy: labels must be ({N},) integers, "
                         f"got {labels.dtype} {labels.shape}")
    if labels.min() < 0 or labels.max() >= M:
        raise ValueError(f"softmax_cross_entropy: labels must lie in [0, {M}), "
                         f"got range [{labels.min()}, {labels.max()}]")
    return labels


def softmax_cross_entropy_forward(logits, labels):
    """logits (N, M), labels (N,) ints in [0, M) -> per-example losses (N,):
    loss[n] = logsumexp(logits[n]) - logits[n, labels[n]]."""
    logits = _f64(logits)
    N, M = logits.shape
    labels = _check_labels(labels, N, M)
    return -_log_softmax(logits)[np.arange(N), labels]


def softmax_cross_entropy_backward(logits, labels, dloss):
    """logits (N, M), labels (N,), dloss (N,)
    -> dlogits (N, M) = (softmax(logits) - onehot(labels)) * dloss[:, None]."""
    logits, dloss = _f64(logits), _f64(dloss)
    N, M = logits.shape
    labels = _check_labels(labels, N, M)
    onehot = np.zeros((N, M))
    onehot[np.arange(N), labels] = 1.0
    return (np.exp(_log_softmax(logits)) - onehot) * dloss[:, None]


def argmax(x, axis):
    """Index of the largest entry along axis (the first one on ties), as np.argmax."""
    return np.argmax(_f64(x), axis=axis)


def sgd_update(params, grads, lr, batch_size):
    """The chapter's d2l.sgd: p - lr * g / batch_size for each (p, g), as new arrays."""
    if len(params) != len(grads):
        raise ValueError(f"sgd_update: {len(params)} params but {len(grads)} grads")
    return [_f64(p) - lr * _f64(g) / batch_size for p, g in zip(params, grads)]


# ---------------------------------------------------------------------------------------------
# The chapter's LeNet, params [W1 (20, 1, 3, 3), b1 (20,), W2 (50, 20, 5, 5), b2 (50,),
# W3 (800, 128), b3 (128,), W4 (128, 10), b4 (10,)], X (N, 1, 28, 28):
# conv 3x3 -> relu -> avgpool 2/2 -> conv 5x5 -> relu -> avgpool 2/2 -> flatten 800
# -> linear -> relu -> linear -> logits (N, 10).
# ---------------------------------------------------------------------------------------------

_POOL = 2


def lenet_forward_cache(X, params):
    """X (N, 1, 28, 28), params (8 arrays) -> (logits (N, 10), cache), where cache holds every
    intermediate backward re-reads, including the three ReLU inputs "z1", "z2", "z3"."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    X = _f64(X)
    z1 = conv2d_forward(X, W1, b1)
    h1 = relu_forward(z1)
    p1 = avg_pool2d_forward(h1, _POOL)
    z2 = conv2d_forward(p1, W2, b2)
    h2 = relu_forward(z2)
    p2 = avg_pool2d_forward(h2, _POOL)
    f2 = p2.reshape(p2.shape[0], -1)
    z3 = linear_forward(f2, W3, b3)
    h3 = relu_forward(z3)
    logits = linear_forward(h3, W4, b4)
    cache = dict(X=X, z1=z1, h1=h1, p1=p1, z2=z2, h2=h2, p2=p2, f2=f2, z3=z3, h3=h3)
    return logits, cache


def lenet_forward(X, params):
    """X (N, 1, 28, 28), params (8 arrays) -> logits (N, 10)."""
    return lenet_forward_cache(X, params)[0]


def lenet_loss_and_grads(X, y, params):
    """X (N, 1, 28, 28), y (N,) labels, params (8 arrays) -> (sum of the N per-example losses,
    [dW1, db1, dW2, db2, dW3, db3, dW4, db4]), the gradient of that sum (not of the mean)."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    logits, c = lenet_forward_cache(X, params)
    losses = softmax_cross_entropy_forward(logits, y)
    dlogits = softmax_cross_entropy_backward(logits, y, np.ones_like(losses))
    dh3, dW4, db4 = linear_backward(c["h3"], W4, dlogits)
    dz3 = relu_backward(c["z3"], dh3)
    df2, dW3, db3 = linear_backward(c["f2"], W3, dz3)
    dp2 = df2.reshape(c["p2"].shape)
    dh2 = avg_pool2d_backward(c["h2"].shape, dp2, _POOL)
    dz2 = relu_backward(c["z2"], dh2)
    dp1, dW2, db2 = conv2d_backward(c["p1"], W2, dz2)
    dh1 = avg_pool2d_backward(c["h1"].shape, dp1, _POOL)
    dz1 = relu_backward(c["z1"], dh1)
    _, dW1, db1 = conv2d_backward(c["X"], W1, dz1)
    return losses.sum(), [dW1, db1, dW2, db2, dW3, db3, dW4, db4]


def train_step_reference(X, y, params, lr):
    """One SGD step of the chapter's train_batch on one device: params - lr * grads / N."""
    _, grads = lenet_loss_and_grads(X, y, params)
    return sgd_update(params, grads, lr, np.shape(X)[0])


# ---------------------------------------------------------------------------------------------
# dropout's counter-based masks (the fused step's): Philox-4x32-10 of (e // 4, row, stream, 0)
# keyed by the seed; element e of row `row` is kept iff its 32-bit output / 2^32 >= p.
# ---------------------------------------------------------------------------------------------

_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key):
    """Philox-4x32-10 (Salmon et al., SC 2011) on arrays: counter a tuple of four uint32-valued
    arrays, key a pair of ints; returns the four output words (uint64 arrays holding 32 bits)."""
    c = [np.asarray(v, dtype=np.uint64) & _M32 for v in counter]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for rnd in range(10):
        if rnd:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        a = np.uint64(0xD2511F53) * c[0]  # 32 x 32 bits: exact in uint64
        b = np.uint64(0xCD9E8D57) * c[2]
        c = [(b >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), b & _M32,
             (a >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), a & _M32]
    return c


def dropout_mask(shape, p, seed, stream, first_row=0):
    """The float32 mask (1 / (1 - p) in float32 where kept, else 0) of a tensor of `shape`
    (N, ...) whose rows are rows first_row .. first_row + N - 1 of a batch."""
    n = shape[0]
    d = int(np.prod(shape[1:], dtype=np.int64))
    e = np.arange(d, dtype=np.uint64)[None, :]
    rows = np.arange(first_row, first_row + n, dtype=np.uint64)[:, None]
    words = philox4x32_10((e // np.uint64(4) + 0 * rows, rows + 0 * e,
                           np.full((n, d), stream, np.uint64), np.zeros((n, d), np.uint64)),
                          (seed & 0xFFFFFFFF, seed >> 32))
    lane = (e % np.uint64(4)).astype(np.int64) + 0 * rows.astype(np.int64)
    u = np.choose(lane, words).astype(np.float64) / 2.0**32
    scale = np.float32(0.0) if p >= 1 else np.float32(1.0) / np.float32(1.0 - p)
    return np.where(u >= p, scale, np.float32(0.0)).astype(np.float32).reshape(shape)
