"""One rank of test_comm_dtype_dist.py, and the problem the bucketed bfloat16 tests share.

    mpirun -np 2 python comm_dtype_worker.py OUTDIR [gpu]

Each rank takes one plain-SGD step of a zero linear layer on cpu(0) with comm_dtype "bf16" and
"float32" (and "bf16" once more under the "mpi" algorithm, and on cpu(0) and cpu(1)) and writes
the reduced gradient sums and the bytes the step's all-reduce counted to
OUTDIR/comm_dtype.rank<r>.npz; with "gpu", the "bf16" and "float32" steps on gpu(0), to
OUTDIR/gpu.rank<r>.npz.
"""
import os
import sys

import numpy as np

import mgpu
from mgpu.parallel import FusedModel

LAYERS = [("flatten",), ("linear", {"transpose": True})]
CLASSES = 8  # the uniform softmax of zero logits is 1/8: exact


def dyadic_problem(n=12, seed=5):
    """X in multiples of 1/16 within (-64, 64): the gradients' products (of 1/8 - onehot and X)
    and their sums over a few rows need at most 17 significant bits, so float32 computes them
    exactly on any device, in any order, and only the bfloat16 rounding changes them."""
    rng = np.random.default_rng(seed)
    X = (rng.integers(-1024, 1024, size=(n, 1, 4, 5)) / 16.0).astype(np.float32)
    y = rng.integers(0, CLASSES, size=n)
    return X, y


def exact_grads(X, y):
    """float64 gradients (dW (K, F), db (K,)) of the summed softmax cross-entropy of a zero
    linear layer: dz = 1/K - onehot(y)."""
    dz = np.full((len(y), CLASSES), 1.0 / CLASSES)
    dz[np.arange(len(y)), y] -= 1.0
    return [dz.T @ X.reshape(len(y), -1).astype(np.float64), dz.sum(axis=0)]


def step(devices, comm_dtype, deterministic=False):
    """One step on `devices` (this rank's, under mpirun); returns the reduced gradient sums
    (-p / (lr / N) with lr / N = 1/64: exact) and the bytes the all-reduce counted."""
    X, y = dyadic_problem()
    lr = len(y) / 64.0
    F = X[0].size
    replicas = [[mgpu.array(np.zeros((CLASSES, F), np.float32), device=d),
                 mgpu.array(np.zeros(CLASSES, np.float32), device=d)] for d in devices]
    model = FusedModel(LAYERS, replicas, [[] for _ in devices], devices)
    mgpu.waitall()
    c0 = mgpu._core._collective_counts()
    model.train_step(mgpu.array(X), mgpu.array(y), lr=lr, comm_dtype=comm_dtype,
                     deterministic=deterministic)
    mgpu.waitall()
    c1 = mgpu._core._collective_counts()
    return [-p.numpy() * np.float32(64.0) for p in replicas[-1]], c1[1] - c0[1]


def main(outdir, mode="cpu"):
    from mgpu import distributed as dist
    dist.init()
    if mode == "gpu":  # one GPU per rank: the NCCL transport, or MGPU_DIST_GPU=host's staging
        out = {}
        for name, comm_dtype in (("bf16", "bf16"), ("f32", "float32")):
            (w, b), nbytes = step([mgpu.gpu(0)], comm_dtype)
            out[f"{name}_w"], out[f"{name}_b"], out[f"{name}_bytes"] = w, b, np.int64(nbytes)
        np.savez(os.path.join(outdir, f"gpu.rank{dist.rank()}.npz"), **out)
        return
    out = {}
    for name, comm_dtype, algorithm in (("bf16", "bf16", "ordered"),
                                        ("f32", "float32", "ordered"),
                                        ("bf16_mpi", "bf16", "mpi")):
        dist.init(algorithm=algorithm)
        (w, b), nbytes = step([mgpu.cpu(0)], comm_dtype)
        out[f"{name}_w"], out[f"{name}_b"], out[f"{name}_bytes"] = w, b, np.int64(nbytes)
    (out["two_w"], out["two_b"]), _ = step([mgpu.cpu(0), mgpu.cpu(1)], "bf16")
    np.savez(os.path.join(outdir, f"comm_dtype.rank{dist.rank()}.npz"), **out)


if __name__ == "__main__":
    main(*sys.argv[1:])
