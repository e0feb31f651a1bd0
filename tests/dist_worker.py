"""One rank of the multi-process tests (tests/test_distributed.py starts it under mpirun).

    mpirun -np N python dist_worker.py MODE OUTDIR [ARGS...]

Each mode writes what it computed to OUTDIR/<mode>.rank<r>.npz (or prints), so the test can
compare every rank with the others and with an in-process run of the same step.
"""
import json
import os
import sys
import time

import numpy as np

import mgpu
from mgpu import distributed as dist
from mgpu.data import array_loader


def problem(n, seed=0):
    """The same global batch and initial parameters as test_train._problem (and the test)."""
    rng = np.random.default_rng(seed)
    X = rng.random((n, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    return X, y, mgpu.lenet_params(scale=0.1, seed=seed)


def synthetic(n, seed=1):
    """Images whose label shows in them, so a few hundred steps really learn something."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    images = rng.integers(0, 96, size=(n, 28, 28)).astype(np.uint8)
    for i, c in enumerate(labels):
        images[i, 2 * c:2 * c + 6, 4:24] += 150
    return images, labels


def save(out, name, arrays):
    np.savez(os.path.join(out, f"{name}.rank{dist.rank()}.npz"), *arrays)


def basics(out, *steps):
    """allreduce of known values and random data, lists, broadcast from every root, barrier;
    then the fused steps given as "L:n" (L devices per rank, global batch n)."""
    r, w = dist.rank(), dist.world_size()
    results = {}
    for n in (1, 7, 1009):  # 1009 is prime: chunks of uneven size on every rank count
        x = mgpu.array(np.full(n, r + 1, dtype=np.float32))
        dist.allreduce(x)
        results[f"known{n}"] = x.numpy()
    rngs = [np.random.default_rng(100 + q) for q in range(w)]
    data = [g.standard_normal(333).astype(np.float32) for g in rngs]
    t = mgpu.array(data[r])
    dist.allreduce(t)
    results["random"] = t.numpy()
    results["random_expected"] = np.sum(np.stack(data), axis=0)
    pair = [mgpu.array(np.full((2, 3), r, np.float32)),
            mgpu.array(np.full(5, 10.0 * r, np.float32))]
    dist.allreduce(pair)
    results["list0"], results["list1"] = pair[0].numpy(), pair[1].numpy()
    for root in range(w):
        b = [mgpu.array(np.arange(6, dtype=np.float32) * (r + 1)),
             mgpu.array(np.array([r, 2 * r], dtype=np.int64))]
        dist.broadcast(b, root=root)
        results[f"bcast{root}_f"], results[f"bcast{root}_i"] = b[0].numpy(), b[1].numpy()
    dist.barrier()
    np.savez(os.path.join(out, f"basics.rank{r}.npz"), **results)
    for spec in steps:
        local_devices, n = (int(v) for v in spec.split(":"))
        step(out, local_devices, n)


def step(out, local_devices, n):
    """One fused step on this rank's slice of a global batch of n, with `local_devices` each."""
    X, y, params = problem(n)
    # MGPU_TEST_ON_GPUS=1: the same steps on gpu(0..L-1) (test_gpu.py, emulated GPUs).
    on_gpus = os.environ.get("MGPU_TEST_ON_GPUS") == "1"
    devices = [mgpu.gpu(i) if on_gpus else mgpu.cpu(i) for i in range(local_devices)]
    replicas = [mgpu.get_params(params, d) for d in devices]
    losses = mgpu.train_batch(mgpu.array(X), mgpu.array(y), replicas, devices, lr=0.2)
    loss = np.array([sum(v.item() for v in losses)], np.float32)
    lt = mgpu.array(loss)
    dist.allreduce(lt)
    save(out, f"step_L{local_devices}_n{n}",
         [p.numpy() for replica in replicas for p in replica] + [lt.numpy()])


def fused_steps(steps, batch_size, local_devices):
    """`steps` fused steps over a shuffled loader, the same order on every rank (and in the
    single-process reference of test_distributed.py). Returns the replicas and the loop's time."""
    images, labels = synthetic(steps * batch_size // 2)
    it = array_loader(images, labels, batch_size, shuffle=True, seed=3)
    params = mgpu.lenet_params(seed=0)
    # MGPU_TEST_ON_GPUS=1: the same steps on gpu(0..L-1) (test_gpu.py, emulated GPUs).
    on_gpus = os.environ.get("MGPU_TEST_ON_GPUS") == "1"
    devices = [mgpu.gpu(i) if on_gpus else mgpu.cpu(i) for i in range(local_devices)]
    replicas = [mgpu.get_params(params, d) for d in devices]
    done = 0
    t0 = time.perf_counter()
    while done < steps:
        for X, y in it:
            mgpu.train_batch(X, y, replicas, devices, lr=0.1)
            done += 1
            if done == steps:
                break
    mgpu.waitall()
    return replicas, time.perf_counter() - t0


def train_steps(out, steps, batch_size, local_devices):
    replicas, elapsed = fused_steps(steps, batch_size, local_devices)
    if os.environ.get("MGPU_TEST_ON_GPUS") == "1":  # how the gradients crossed processes
        print(f"rank {dist.rank()}: GPU transport {mgpu._core.dist_gpu_transport()}, backend "
              f"{dist.backend()}", flush=True)
    save(out, f"train_L{local_devices}", [p.numpy() for p in replicas[0]] + [np.array([elapsed])])


def train_api(out, epochs, batch_size):
    """mgpu.train itself: parameters from rank 0, sharded batches, summed accuracy, one print."""
    images, labels = synthetic(640)
    test_images, test_labels = synthetic(300, seed=2)
    data = (array_loader(images, labels, batch_size, shuffle=True, seed=5),
            array_loader(test_images, test_labels, 64))
    params = mgpu.lenet_params(seed=dist.rank() + 7)  # differs per rank: rank 0's must win
    result = mgpu.train(1, batch_size, 0.3, num_epochs=epochs, params=params, data=data,
                        progress=False)
    with open(os.path.join(out, f"train_api.rank{dist.rank()}.json"), "w") as f:
        json.dump({"test_acc": result.test_acc, "train_loss": result.train_loss,
                   "world_size": result.world_size}, f)


def mismatch(out, kind):
    """Ranks that call different collectives: they must fail loudly, never hang."""
    r = dist.rank()
    if kind in ("dtype", "bcast_size"):  # a broadcast whose dtype or length differs on rank 1
        dtype = np.int32 if kind == "dtype" and r == 1 else np.float32
        x = mgpu.array(np.ones(4 + (r if kind == "bcast_size" else 0), dtype))
        dist.broadcast(x, root=0)
        x.numpy()
        print(f"rank {r}: the mismatched collective returned", flush=True)
        return
    x = mgpu.array(np.ones(4 + (r if kind == "size" else 0), np.float32))
    if kind == "op" and r == 1:
        dist.broadcast(x, root=0)
    else:
        dist.allreduce(x)
    x.numpy()
    print(f"rank {r}: the mismatched collective returned", flush=True)


def die(out, how):
    """Rank 1 dies (or hangs) after a first collective; the others wait in the second."""
    x = mgpu.array(np.ones(4, np.float32))
    dist.allreduce(x)
    x.numpy()
    if dist.rank() == 1:
        if how == "exit":
            os._exit(3)
        time.sleep(600)
    dist.allreduce(x)
    x.numpy()


def nccl_stall(out):
    """GPU tensors across processes on NCCL (test_nccl_emu.py): a first all-reduce works, then
    rank 1's collectives never arrive (the emulator's MGPU_EMU_NCCL_STALL=1). Rank 0 gives up
    after 3 s and aborts the communicator, which must end rank 1's wait too (its own limit is
    60 s); then neither rank can all-reduce again. Each rank prints what happened."""
    r = dist.rank()
    mgpu._core.dist_set_timeout(3.0 if r == 0 else 60.0)
    x = mgpu.array(np.full(1000, r + 1, np.float32), device=mgpu.gpu(0))
    dist.allreduce(x)
    print(f"rank {r}: first all-reduce gave {x.numpy()[0]}", flush=True)
    os.environ["MGPU_EMU_NCCL_STALL"] = "1"
    # Also one line per attempt in a file of this rank's: mpirun's stdout can join two ranks'
    # lines into one when they print at once, as both do when the abort ends their waits.
    with open(os.path.join(out, f"nccl_stall.rank{r}.txt"), "w") as log:
        for attempt in ("stalled", "next"):
            start = time.monotonic()
            try:
                dist.allreduce(x)
                x.numpy()
                line = f"rank {r}: the {attempt} all-reduce returned"
            except RuntimeError as e:
                line = (f"rank {r}: the {attempt} all-reduce failed after "
                        f"{time.monotonic() - start:.0f} s: {e}")
            log.write(line.replace("\n", " ") + "\n")
            log.flush()
            print(line, flush=True)


def bench(out, kind, *args):
    """Step time or all-reduce bandwidth; rank 0 prints one JSON line."""
    if kind == "step":
        batch, steps, local = int(args[0]), int(args[1]), int(args[2])
        X, y, params = problem(batch)
        devices = [mgpu.cpu(i) for i in range(local)]
        replicas = [mgpu.get_params(params, d) for d in devices]
        Xt, yt = mgpu.array(X), mgpu.array(y)
        for _ in range(5):
            mgpu.train_batch(Xt, yt, replicas, devices, lr=0.01)
        mgpu.waitall()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            mgpu.train_batch(Xt, yt, replicas, devices, lr=0.01)
        mgpu.waitall()
        dist.barrier()
        res = {"step_ms": 1e3 * (time.perf_counter() - t0) / steps}
    else:
        res = {}
        w = dist.world_size()
        for nbytes in [int(a) for a in args]:
            x = mgpu.array(np.ones(nbytes // 4, np.float32))
            reps = max(5, min(200, (1 << 26) // nbytes))
            for _ in range(3):
                dist.allreduce(x)
            x.numpy()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.allreduce(x)
            x.numpy()
            t = (time.perf_counter() - t0) / reps
            res[nbytes] = {"us": 1e6 * t, "algbw_GBps": nbytes / t / 1e9,
                           "busbw_GBps": 2 * (w - 1) / w * nbytes / t / 1e9}
    res["world_size"] = dist.world_size()
    res["threads"] = mgpu.num_threads()
    res["algorithm"] = mgpu._core.dist_algorithm()
    res["check"] = mgpu._core.dist_check()
    if dist.rank() == 0:
        print(json.dumps(res), flush=True)


# conv -> batch norm -> relu, a residual add, global pooling and a linear head (out, in).
FUSED_SPEC = [("conv2d", {"padding": 1, "bias": False}), ("batch_norm", {}), ("relu",),
              ("conv2d", {"padding": 1}), ("add", {"in": [3, 4]}), ("global_avg_pool",),
              ("flatten",), ("linear", {"transpose": True})]


def fused_problem(n, seed=0):
    """FUSED_SPEC's parameters, batch-norm buffers and a batch of n."""
    rng = np.random.default_rng(seed)
    shapes = [(4, 2, 3, 3), (4,), (4,), (4, 4, 3, 3), (4,), (3, 4), (3,)]
    params = [(0.5 * rng.standard_normal(s)).astype(np.float32) for s in shapes]
    buffers = [np.zeros(4, np.float32), np.ones(4, np.float32)]
    X = rng.standard_normal((n, 2, 5, 5)).astype(np.float32)
    return params, buffers, X, rng.integers(0, 3, size=n)


def fused_model_steps(devices, n, steps=2):
    """`steps` fused steps of FUSED_SPEC with momentum and weight decay; returns replica 0's
    parameters and buffers."""
    from mgpu.parallel import FusedModel
    params, buffers, X, y = fused_problem(n)
    reps = [[mgpu.array(a, device=d) for a in params] for d in devices]
    bufs = [[mgpu.array(b, device=d) for b in buffers] for d in devices]
    model = FusedModel(FUSED_SPEC, reps, bufs, devices)
    for _ in range(steps):
        model.train_step(mgpu.array(X), mgpu.array(y), lr=0.3, momentum=0.9, weight_decay=0.01)
    return [t.numpy() for t in reps[-1] + bufs[-1]]


def fused_model(out, local_devices, n):
    state = fused_model_steps([mgpu.cpu(i) for i in range(int(local_devices))], int(n))
    save(out, f"fused_model_L{local_devices}_n{n}", state)


def _devices(local_devices):
    on_gpus = os.environ.get("MGPU_TEST_ON_GPUS") == "1"
    return [mgpu.gpu(i) if on_gpus else mgpu.cpu(i) for i in range(int(local_devices))]


def deterministic_lenet(devices, steps=50, shards=True):
    """`steps` deterministic fused LeNet steps over 250 shuffled examples in batches of 24 (every
    11th batch has the uneven 10), then one batch of 5 (fewer examples than logical shards).
    Returns replica 0's and the last replica's parameters and every step's summed loss."""
    images, labels = synthetic(250)
    it = array_loader(images, labels, 24, shuffle=True, seed=3)
    replicas = [mgpu.get_params(mgpu.lenet_params(seed=0), d) for d in devices]
    losses = []

    def step(X, y):
        ls = mgpu.train_batch(X, y, replicas, devices, lr=0.2, deterministic=shards)
        losses.append(sum(v.item() for v in ls))

    done = 0
    while done < steps:
        for X, y in it:
            step(X, y)
            done += 1
            if done == steps:
                break
    step(mgpu.array(images[:5].reshape(5, 1, 28, 28).astype(np.float32) / 255),
         mgpu.array(labels[:5].astype(np.int32)))
    return ([p.numpy() for p in replicas[0]] + [p.numpy() for p in replicas[-1]] +
            [np.array(losses)])


def bn_net():
    """A small residual network with batch norm (the concise chapter's kinds of layers)."""
    from mgpu import nn
    from mgpu.models import Residual
    mgpu.random.seed(11)
    return nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         Residual(4, 6, use_1x1conv=True, strides=2), nn.AdaptiveAvgPool2d((1, 1)),
                         nn.Flatten(), nn.Linear(6, 10))


def sgd_steps(net, devices, seed, sizes, **step_options):
    """DataParallel.train_step calls of `net` on `devices` (SGD: lr 0.1, momentum 0.9, weight
    decay 1e-3), one per batch size in `sizes`, on normal 1x8x8 images and labels drawn from
    `seed`; `step_options` go to train_step. Returns the DataParallel and the losses."""
    from mgpu import nn, optim
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss = nn.CrossEntropyLoss()
    rng = np.random.default_rng(seed)
    losses = []
    for n in sizes:
        X = mgpu.array(rng.standard_normal((n, 1, 8, 8)).astype(np.float32))
        y = mgpu.array(rng.integers(0, 10, size=n).astype(np.int32))
        losses.append(dp.train_step(X, y, loss, trainer, **step_options).item())
    return dp, losses


def deterministic_bn(devices, steps=6, shards=True, accumulate=1, net=None):
    """`steps` DataParallel.train_step calls (SGD with momentum and weight decay) of `net`
    (bn_net() by default) on batches of 20, the last one of 13, each in `accumulate`
    micro-batches; returns the master's parameters and buffers, the last replica's parameters,
    and the losses."""
    net = net or bn_net()
    sizes = [13 if s == steps - 1 else 20 for s in range(steps)]
    dp, losses = sgd_steps(net, devices, 5, sizes, deterministic=shards, accumulate=accumulate)
    state = [p.numpy() for p in net.parameters()] + [b.numpy() for b in net.buffers()]
    return state + [p.numpy() for p in dp._fused.replica_params[-1]] + [np.array(losses)]


def adamw_clip_steps(devices, shards=False, steps=4, clip=0.05):
    """`steps` DataParallel.train_step calls with AdamW under a cosine schedule and the
    gradients clipped to a global norm of `clip` (below theirs), on batches of 20; returns the
    master's parameters and buffers."""
    from mgpu import nn, optim
    net = bn_net()
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.AdamW(net.parameters(), lr=0.01, eps=1e-4, weight_decay=0.1)
    sched = optim.lr_scheduler.CosineAnnealingLR(trainer, T_max=steps)
    loss = nn.CrossEntropyLoss()
    rng = np.random.default_rng(7)
    for _ in range(steps):
        X = mgpu.array(rng.standard_normal((20, 1, 8, 8)).astype(np.float32))
        y = mgpu.array(rng.integers(0, 10, size=20).astype(np.int32))
        dp.train_step(X, y, loss, trainer, deterministic=shards, clip_grad_norm=clip)
        sched.step()
    return [p.numpy() for p in net.parameters()] + [b.numpy() for b in net.buffers()]


def adamw_clip(out, local_devices, shards):
    save(out, f"adamw_clip_L{local_devices}_{shards}",
         adamw_clip_steps(_devices(local_devices), shards=int(shards) or False))


def sync_bn_steps(devices, steps=4, n=20, sync=True):
    """`steps` DataParallel.train_step calls of bn_net with every batch norm synchronised
    (nn.SyncBatchNorm.convert_sync_batchnorm), SGD with momentum and weight decay, on batches of
    n; returns the master's parameters and buffers (running statistics) and the losses. Under
    mpirun every rank passes the whole batch and takes its own shards of it. sync=False keeps
    per-replica statistics (the control)."""
    from mgpu import nn
    net = nn.SyncBatchNorm.convert_sync_batchnorm(bn_net()) if sync else bn_net()
    _, losses = sgd_steps(net, devices, 8, [n] * steps)
    state = [p.numpy() for p in net.parameters()] + [b.numpy() for b in net.buffers()]
    return state + [np.array(losses)]


def sync_bn(out, local_devices):
    save(out, f"sync_bn_L{local_devices}", sync_bn_steps(_devices(local_devices)))


def accumulated_steps(devices, accumulate, shards=False, steps=3):
    """deterministic_bn's steps with `accumulate` micro-batches each; its arrays and the
    (reductions, bytes) the steps started."""
    mgpu.waitall()
    before = mgpu._core._collective_counts()
    arrays = deterministic_bn(devices, steps, shards, accumulate)
    mgpu.waitall()
    after = mgpu._core._collective_counts()
    return arrays + [np.array([after[0] - before[0], after[1] - before[1]])]


def accumulated(out, local_devices, *configs):
    """accumulated_steps for each "shards:accumulate" of configs."""
    for c in configs:
        shards, k = (int(v) for v in c.split(":"))
        save(out, f"acc_L{local_devices}_{shards}_{k}",
             accumulated_steps(_devices(local_devices), k, shards=shards or False))


def dropout_net():
    """bn_net with dropout after the stem and before the classifier."""
    from mgpu import nn
    from mgpu.models import Residual
    mgpu.random.seed(12)
    return nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Dropout(0.3), Residual(4, 6, use_1x1conv=True, strides=2),
                         nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Dropout(0.5),
                         nn.Linear(6, 10))


def dropout_steps(devices, shards=True, accumulate=1, steps=3):
    """deterministic_bn's steps of dropout_net."""
    return deterministic_bn(devices, steps, shards, accumulate, net=dropout_net())


def dropout(out, local_devices, shards, accumulate):
    save(out, f"dropout_L{local_devices}_{shards}_{accumulate}",
         dropout_steps(_devices(local_devices), int(shards) or False, int(accumulate)))


def deterministic(out, kind, local_devices, steps=None):
    run = deterministic_lenet if kind == "lenet" else deterministic_bn
    kw = {} if steps is None else {"steps": int(steps)}
    save(out, f"det_{kind}_L{local_devices}", run(_devices(local_devices), **kw))


MODES = {"basics": basics, "train_steps": train_steps, "train_api": train_api,
         "mismatch": mismatch, "die": die, "bench": bench, "fused_model": fused_model,
         "deterministic": deterministic, "sync_bn": sync_bn, "nccl_stall": nccl_stall,
         "adamw_clip": adamw_clip, "accumulated": accumulated, "dropout": dropout}

if __name__ == "__main__":
    mode, outdir, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init(os.environ.get("MGPU_TEST_BACKEND", "auto"))  # "nccl": test_gpu.py
    if dist.backend() == "nccl":  # GPU tensors stay on NCCL whatever MGPU_DIST_GPU says later
        os.environ["MGPU_DIST_GPU"] = "host"
    fn = MODES[mode]
    if mode in ("train_steps", "train_api"):
        rest = [int(a) for a in rest]
    fn(outdir, *rest)
