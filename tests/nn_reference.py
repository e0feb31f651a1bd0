"""Float64 NumPy references for sec. 12.6's networks: batch norm, and a small residual network
(conv-BN-ReLU stem, one d2l Residual block with a 1x1 shortcut, global average pooling, Linear)
with its hand-written backward, per shard (DataParallel's per-replica statistics) or on a whole
batch (SyncBatchNorm). Parameter names follow the mgpu module's state_dict.
"""
import numpy as np

import reference as ref


def bn_forward(x, gamma, beta, eps):
    """Training-mode batch norm: x (N, C, H, W) -> y, and what backward needs. Biased variance."""
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=(0, 2, 3))
    var = x.var(axis=(0, 2, 3))
    xhat = (x - mean[None, :, None, None]) / np.sqrt(var + eps)[None, :, None, None]
    y = gamma[None, :, None, None] * xhat + beta[None, :, None, None]
    return y, (xhat, var, np.asarray(gamma, np.float64), mean)


def bn_backward(dy, cache, eps):
    """-> (dx, dgamma, dbeta) of training-mode batch norm (the statistics depend on x)."""
    xhat, var, gamma, _ = cache
    m = dy.shape[0] * dy.shape[2] * dy.shape[3]
    dbeta = dy.sum(axis=(0, 2, 3))
    dgamma = (dy * xhat).sum(axis=(0, 2, 3))
    dx = (gamma / np.sqrt(var + eps))[None, :, None, None] * (
        dy - dbeta[None, :, None, None] / m - xhat * dgamma[None, :, None, None] / m)
    return dx, dgamma, dbeta


def bn_eval(x, gamma, beta, mean, var, eps):
    return (gamma[None, :, None, None] * (x - mean[None, :, None, None])
            / np.sqrt(var + eps)[None, :, None, None] + beta[None, :, None, None])


def running_update(running_mean, running_var, cache, count, momentum):
    """PyTorch's update: biased mean, unbiased variance, weight ``momentum``."""
    _, var, _, mean = cache
    return ((1 - momentum) * running_mean + momentum * mean,
            (1 - momentum) * running_var + momentum * var * count / (count - 1))


BN_NAMES = ("1", "3.bn1", "3.bn2")


def tiny_forward_backward(X, y, P, eps, dloss_scale):
    """The tiny residual net on X (n, C, H, W) with labels y: returns (sum of the losses times
    dloss_scale, gradients by parameter name, BN caches by module name, BN counts)."""
    X = np.asarray(X, np.float64)
    g = {}
    z0 = ref.conv2d_forward(X, P["0.weight"], P["0.bias"], 1, 1)
    a0, c0 = bn_forward(z0, P["1.weight"], P["1.bias"], eps)
    h0 = np.maximum(a0, 0)
    r1 = ref.conv2d_forward(h0, P["3.conv1.weight"], P["3.conv1.bias"], 2, 1)
    a1, c1 = bn_forward(r1, P["3.bn1.weight"], P["3.bn1.bias"], eps)
    h1 = np.maximum(a1, 0)
    r2 = ref.conv2d_forward(h1, P["3.conv2.weight"], P["3.conv2.bias"], 1, 1)
    a2, c2 = bn_forward(r2, P["3.bn2.weight"], P["3.bn2.bias"], eps)
    s = ref.conv2d_forward(h0, P["3.conv3.weight"], P["3.conv3.bias"], 2, 0)
    pre = a2 + s
    o = np.maximum(pre, 0)
    pooled = o.mean(axis=(2, 3))
    logits = pooled @ P["6.weight"].T + P["6.bias"]
    losses = ref.softmax_cross_entropy_forward(logits, y)
    dlogits = ref.softmax_cross_entropy_backward(logits, y, np.full(len(y), dloss_scale))
    g["6.weight"] = dlogits.T @ pooled
    g["6.bias"] = dlogits.sum(axis=0)
    dpooled = dlogits @ P["6.weight"]
    do = np.broadcast_to(dpooled[:, :, None, None] / (o.shape[2] * o.shape[3]), o.shape)
    dpre = do * (pre > 0)
    dh0_s, g["3.conv3.weight"], g["3.conv3.bias"] = ref.conv2d_backward(h0, P["3.conv3.weight"],
                                                                        dpre, 2, 0)
    dr2, g["3.bn2.weight"], g["3.bn2.bias"] = bn_backward(dpre, c2, eps)
    dh1, g["3.conv2.weight"], g["3.conv2.bias"] = ref.conv2d_backward(h1, P["3.conv2.weight"],
                                                                      dr2, 1, 1)
    dr1, g["3.bn1.weight"], g["3.bn1.bias"] = bn_backward(dh1 * (a1 > 0), c1, eps)
    dh0_r, g["3.conv1.weight"], g["3.conv1.bias"] = ref.conv2d_backward(h0, P["3.conv1.weight"],
                                                                        dr1, 2, 1)
    dz0, g["1.weight"], g["1.bias"] = bn_backward((dh0_r + dh0_s) * (a0 > 0), c0, eps)
    _, g["0.weight"], g["0.bias"] = ref.conv2d_backward(X, P["0.weight"], dz0, 1, 1)
    caches = {"1": c0, "3.bn1": c1, "3.bn2": c2}
    counts = {"1": z0.shape[0] * z0.shape[2] * z0.shape[3],
              "3.bn1": r1.shape[0] * r1.shape[2] * r1.shape[3],
              "3.bn2": r2.shape[0] * r2.shape[2] * r2.shape[3]}
    return losses.sum() * dloss_scale, g, caches, counts


def tiny_step(X, y, P, shards, lr, momentum=0.1, eps=1e-5):
    """One SGD step of the tiny net whose batch is cut into ``shards`` (row counts), each shard
    normalised with its own statistics (shards=[N] is one device, or SyncBatchNorm).
    Returns (mean loss, gradients, new parameters, new running stats from shard 0)."""
    n = len(y)
    loss, grads, first = 0.0, None, None
    begin = 0
    for rows in shards:
        part, g, caches, counts = tiny_forward_backward(X[begin:begin + rows],
                                                        y[begin:begin + rows], P, eps, 1.0 / n)
        loss += part
        grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
        if first is None:
            first = (caches, counts)
        begin += rows
    new = {k: P[k] - lr * grads[k] for k in grads}
    running = {}
    caches, counts = first
    for name in BN_NAMES:
        running[name] = running_update(P[name + ".running_mean"], P[name + ".running_var"],
                                       caches[name], counts[name], momentum)
    return loss, grads, new, running
