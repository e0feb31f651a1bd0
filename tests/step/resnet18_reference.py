"""Float64 NumPy reference of d2l's ResNet-18 (sec. 12.6, mgpu.models.resnet18) in training mode:
the loss and every parameter's gradient, by hand-written backward through reference.py's conv
and nn_reference.py's batch norm. Parameter names follow the module's state_dict. With
``record``, each convolution's input x and incoming gradient dy are kept by weight name, so a
test can run a single conv pass on the inputs it sees inside a real step.
"""
import numpy as np

import nn_reference as nnr
import reference as ref

EPS = 1e-5
STAGES = (("resnet_block1", 64, True), ("resnet_block2", 128, False),
          ("resnet_block3", 256, False), ("resnet_block4", 512, False))


def conv2d_forward(x, w, b, stride, pad):
    """reference.conv2d_forward by one matrix product per kernel tap (BLAS), for speed."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    y = np.zeros((N, P, Q, K))
    for r in range(R):
        for s in range(S):
            win = xp[:, :, r:r + stride * (P - 1) + 1:stride, s:s + stride * (Q - 1) + 1:stride]
            y += np.tensordot(win.transpose(0, 2, 3, 1), w[:, :, r, s], axes=([3], [1]))
    return y.transpose(0, 3, 1, 2) + b[None, :, None, None]


def conv2d_backward(x, w, dy, stride, pad):
    """reference.conv2d_backward likewise -> (dx, dw, db)."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    P, Q = dy.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    dxp = np.zeros((N, H + 2 * pad, W + 2 * pad, C))
    dw = np.zeros_like(w)
    dyt = dy.transpose(0, 2, 3, 1).reshape(-1, K)  # (N P Q, K)
    for r in range(R):
        for s in range(S):
            rows = slice(r, r + stride * (P - 1) + 1, stride)
            cols = slice(s, s + stride * (Q - 1) + 1, stride)
            win = xp[:, :, rows, cols].transpose(0, 2, 3, 1).reshape(-1, C)
            dw[:, :, r, s] = dyt.T @ win
            dxp[:, rows, cols, :] += (dyt @ w[:, :, r, s]).reshape(N, P, Q, C)
    dx = dxp[:, pad:pad + H, pad:pad + W, :].transpose(0, 3, 1, 2)
    return dx, dw, dy.sum(axis=(0, 2, 3))


def conv_layers():
    """(weight name, stride, padding) of every convolution, stem first."""
    out = [("0", 1, 1)]
    for stage, _, first in STAGES:
        for i in range(2):
            pre = f"{stage}.{i}"
            stride = 2 if i == 0 and not first else 1
            out += [(f"{pre}.conv1", stride, 1), (f"{pre}.conv2", 1, 1)]
            if i == 0 and not first:
                out.append((f"{pre}.conv3", stride, 0))
    return out


def loss_and_grads(X, y, P, record=None, masks=None):
    """Mean cross-entropy of the net on X (N, 1, H, W) with labels y, and the gradient of every
    parameter in P (name -> float64 array). ``record``, a dict, receives name -> (x, dy) for
    every convolution. ``masks`` (name -> bool array) gives the ReLUs' masks instead of their own
(x > 0), and receives their own where it has no entry: "1" the stem's, "<block>.bn1" the one
    after a block's first batch norm, "<block>.out" the block's last (blocks named as in the
    state_dict, "resnet_block1.0")."""
    used = {} if masks is None else masks
    g, convs, bns = {}, {}, {}

    def relu(name, v):
        used.setdefault(name, v > 0)
        return v * used[name]

    def conv(name, x, stride, pad):
        convs[name] = (x, stride, pad)
        return conv2d_forward(x, P[name + ".weight"], P[name + ".bias"], stride, pad)

    def bn(name, x):
        out, bns[name] = nnr.bn_forward(x, P[name + ".weight"], P[name + ".bias"], EPS)
        return out

    h = relu("1", bn("1", conv("0", np.asarray(X, np.float64), 1, 1)))
    blocks = []
    for stage, _, first in STAGES:
        for i in range(2):
            pre, projected = f"{stage}.{i}", i == 0 and not first
            stride = 2 if projected else 1
            h1 = relu(f"{pre}.bn1", bn(f"{pre}.bn1", conv(f"{pre}.conv1", h, stride, 1)))
            a2 = bn(f"{pre}.bn2", conv(f"{pre}.conv2", h1, 1, 1))
            short = conv(f"{pre}.conv3", h, stride, 0) if projected else h
            h = relu(f"{pre}.out", a2 + short)
            blocks.append((pre, projected))
    pooled = h.mean(axis=(2, 3))
    logits = pooled @ P["fc.1.weight"].T + P["fc.1.bias"]
    n = len(y)
    loss = ref.softmax_cross_entropy_forward(logits, y).mean()
    dlogits = ref.softmax_cross_entropy_backward(logits, y, np.full(n, 1.0 / n))
    g["fc.1.weight"] = dlogits.T @ pooled
    g["fc.1.bias"] = dlogits.sum(axis=0)
    dh = np.broadcast_to((dlogits @ P["fc.1.weight"])[:, :, None, None] / (h.shape[2] * h.shape[3]),
                         h.shape)

    def conv_back(name, dy):
        x, stride, pad = convs[name]
        if record is not None:
            record[name] = (x, dy)
        dx, g[name + ".weight"], g[name + ".bias"] = conv2d_backward(
            x, P[name + ".weight"], dy, stride, pad)
        return dx

    def bn_back(name, dy):
        dx, g[name + ".weight"], g[name + ".bias"] = nnr.bn_backward(dy, bns[name], EPS)
        return dx

    for pre, projected in reversed(blocks):
        dpre = dh * used[f"{pre}.out"]
        dx_short = conv_back(f"{pre}.conv3", dpre) if projected else dpre
        dh1 = conv_back(f"{pre}.conv2", bn_back(f"{pre}.bn2", dpre))
        dh = conv_back(f"{pre}.conv1", bn_back(f"{pre}.bn1", dh1 * used[f"{pre}.bn1"])) + dx_short
    conv_back("0", bn_back("1", dh * used["1"]))
    return loss, g
