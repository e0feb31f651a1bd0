"""One process of the GPU configuration matrix (tests/gpu/test_gpu_matrix.py), alone or as one rank:

    [mpirun -np W] python gpu_matrix_worker.py OUTDIR LOCAL_GPUS CASE[,CASE...]

Runs each CASE on this process's LOCAL_GPUS emulated GPUs gpu(0..LOCAL_GPUS-1) (each process
emulates its own, MGPU_EMULATED_GPUS of them), every rank on the same global batches, and writes
what it computed to OUTDIR/<case>.rank<r>.npz, so the test can compare W ranks x L GPUs with one
process of W * L GPUs. The `train` case calls mgpu.train itself, which takes this rank's GPUs
after the other local ranks' (MGPU_EMULATED_GPUS = W * L there).
"""
import os
import sys

import numpy as np

import mgpu
from mgpu import distributed as dist
from mgpu.data import array_loader

# tests/ (the script runs from tests/gpu): dist_worker's data and training loop.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dist_worker  # noqa: E402


def save(out, name, arrays):
    np.savez(os.path.join(out, f"{name}.rank{dist.rank()}.npz"), *arrays)


def lenet(devices, graphs, deterministic=False, steps=3, n=12):
    """The chapter's fused LeNet step (mgpu.train_batch; its gradients fill 2 buckets: the dense
    layers', then the convolutions'), `steps` global batches of n. Returns the start, replica 0's
    and the last replica's parameters, and this rank's summed loss per step."""
    os.environ["MGPU_CUDA_GRAPH"] = "1" if graphs else "0"
    start = mgpu.lenet_params(seed=3)
    replicas = [mgpu.get_params(start, d) for d in devices]
    rng = np.random.default_rng(21)
    losses = []
    for _ in range(steps):
        X = mgpu.array(rng.random((n, 1, 28, 28), dtype=np.float32))
        y = mgpu.array(rng.integers(0, 10, n).astype(np.int32))
        ls = mgpu.train_batch(X, y, replicas, devices, lr=0.2, deterministic=deterministic)
        losses.append(sum(v.item() for v in ls))
    return ([p.numpy() for p in start] + [p.numpy() for p in replicas[0]] +
            [p.numpy() for p in replicas[-1]] + [np.array(losses)])


def book(devices, steps=3, n=12):
    """lenet's steps with the chapter's op-by-op train_batch (autograd on every device, the
    gradients summed through devices[0]); the same outputs as lenet."""
    from mgpu import chapter
    start = mgpu.lenet_params(seed=3)
    replicas = [mgpu.get_params(start, d) for d in devices]
    rng = np.random.default_rng(21)
    for _ in range(steps):
        X = mgpu.array(rng.random((n, 1, 28, 28), dtype=np.float32))
        y = mgpu.array(rng.integers(0, 10, n).astype(np.int32))
        chapter.train_batch(X, y, replicas, devices, 0.2)
    return ([p.numpy() for p in start] + [p.numpy() for p in replicas[0]] +
            [p.numpy() for p in replicas[-1]] + [np.zeros(steps)])


def bucketed_bn_net():
    """A residual network with batch norm whose gradients fill 2 buckets: the dense head's 83,410
    floats close the first (64 Ki floats), the convolutions and batch norms make the second."""
    from mgpu import nn
    from mgpu.models import Residual
    mgpu.random.seed(11)
    return nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         Residual(4, 8, use_1x1conv=True, strides=2), nn.Flatten(),
                         nn.Linear(128, 600), nn.ReLU(), nn.Linear(600, 10))


def bn(devices, deterministic=False, sync=False, steps=3, n=16):
    """nn.DataParallel.train_step (the fused step of a module tree) on bucketed_bn_net, SGD with
    momentum and weight decay; sync converts every batch norm to SyncBatchNorm. Returns the start
    and the master's parameters, its buffers, the last replica's parameters, the losses and the
    counts of gradient buckets, parameters and buffers."""
    from mgpu import nn
    net = bucketed_bn_net()
    if sync:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    start = [p.numpy() for p in net.parameters()]
    dp, losses = dist_worker.sgd_steps(net, devices, 5, [n] * steps, deterministic=deterministic)
    fused = dp._fused
    buffers = [b.numpy() for b in net.buffers()]
    counts = np.array([len(fused.model._model.buckets), len(start), len(buffers)])
    return (start + [p.numpy() for p in net.parameters()] + buffers +
            [p.numpy() for p in fused.replica_params[-1]] + [np.array(losses), counts])


def train(num_gpus):
    """mgpu.train(num_gpus, ...) for one epoch of 3 batches of 32, from lenet_params(seed=0);
    returns the training loss (over every rank) and the test accuracy."""
    images, labels = dist_worker.synthetic(96, 1)
    test_images, test_labels = dist_worker.synthetic(64, 2)
    data = (array_loader(images, labels, 32, shuffle=True, seed=5),
            array_loader(test_images, test_labels, 32))
    result = mgpu.train(num_gpus, 32, 0.2, num_epochs=1, params=mgpu.lenet_params(seed=0),
                        data=data, progress=False)
    return [np.array(result.train_loss), np.array(result.test_acc),
            np.array([str(d) for d in result.devices])]


CASES = {
    "lenet": lambda ds: lenet(ds, graphs=True),
    "lenet_plain": lambda ds: lenet(ds, graphs=False),
    "lenet_det": lambda ds: lenet(ds, graphs=True, deterministic=True),
    "bn": lambda ds: bn(ds),
    "bn_plain": lambda ds: bn(ds),  # run with MGPU_CUDA_GRAPH=0 (set below)
    "bn_det": lambda ds: bn(ds, deterministic=True),
    "sync_bn": lambda ds: bn(ds, sync=True, steps=2),
    "book": book,
    "train": lambda ds: train(len(ds)),
}

if __name__ == "__main__":
    out, local, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    dist.init("auto")
    devices = [mgpu.gpu(i) for i in range(local)]
    for case in cases:
        os.environ["MGPU_CUDA_GRAPH"] = "0" if case == "bn_plain" else "1"
        save(out, case, CASES[case](devices))
        mgpu.waitall()
    print(f"rank {dist.rank()} of {dist.world_size()}: {', '.join(cases)} done on {devices}",
          flush=True)
