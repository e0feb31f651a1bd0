"""What the timed rivals of ``mgpu bench train`` share: Fashion-MNIST's IDX files, the synthetic
draw, the shuffled batches and the timing loop. NumPy only: ``torch_rival.py`` and
``jax_rival.py`` run in other interpreters and load this file by path (they never import mgpu),
and mgpu's own side of the ResNet-18 bench uses it too, so every side reads the same data, draws
the same shuffles and is timed by the same loop.
"""
import gzip
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path):
    """An IDX file (raw, or gzip when the name ends in .gz) as a NumPy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = raw[0] * 256 + raw[1], raw[2], raw[3]
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(data_dir, split):
    """[images (n, 28, 28), labels (n,)] uint8 of Fashion-MNIST's ``split`` ('train', 'test')."""
    out = []
    for name in _FILES[split]:
        for candidate in (name + ".gz", name):
            path = os.path.join(data_dir, candidate)
            if os.path.exists(path):
                out.append(read_idx(path))
                break
        else:
            raise FileNotFoundError(f"{name}[.gz] not found in {data_dir}")
    return out


def synthetic_split(n, seed):
    """n random uint8 images and labels; every side draws the same ones for the same seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8),
            rng.integers(0, 10, size=n, dtype=np.uint8)]


def peak_rss_bytes():
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Batches:
    """Shuffled minibatches over images already in memory; the gather is part of each step.

    The images stay uint8 (47 MB for Fashion-MNIST's training set instead of 188 MB as float32)
    and each batch is gathered with NumPy and scaled to [0, 1] as float32 (B, 1, 28, 28), with
    int64 labels; ``make(X, y)`` then turns the pair into the framework's arrays (a view, a copy
    to a device, or a layout change such as NHWC). Every side gets the same values in the same
    order for the same seed."""

    def __init__(self, images, labels, batch_size, limit, seed, make=None):
        self.images = np.ascontiguousarray(images).reshape(-1, 1, 28, 28)
        self.y = np.asarray(labels).astype(np.int64)
        self.batch_size = batch_size
        self.make = make or (lambda X, y: (X, y))
        full = -(-len(self.y) // batch_size)
        self.full_batches = full
        self.num_batches = min(full, limit) if limit else full
        self.rng = np.random.default_rng(seed)

    def gather(self, idx):
        """The batch of images ``idx``, scaled to [0, 1] and made the framework's arrays."""
        return self.make(self.images[idx].astype(np.float32) / np.float32(255.0), self.y[idx])

    def epoch(self, num_batches=None):
        order = self.rng.permutation(len(self.y))
        for i in range(num_batches or self.num_batches):
            yield self.gather(order[i * self.batch_size:(i + 1) * self.batch_size])


def run_config(name, step, batches, epochs, warmup, on_timed=None, finish=None):
    """Warm-up batches, then ``epochs`` timed epochs (each cut at the batch limit).

    ``step(X, y)`` returns the batch's summed loss: a float, or an array still being computed
    when the framework runs asynchronously; ``finish(outputs)``, when given, waits for the
    epoch's outputs inside the timed region (e.g. JAX's block_until_ready), so an epoch is timed
    as the chapters time it: steps dispatched back to back, one wait at the end. The warm-up
    (compilation, first-touch allocation) is never timed. ``on_timed()``, when given, runs
    between the two (e.g. to read counters of the timed part)."""
    if warmup > 0:
        outs = [step(X, y) for X, y in batches.epoch(warmup)]
        if finish is not None:
            finish(outs)
    if on_timed is not None:
        on_timed()
    times, cpu_times, losses = [], [], []
    for _ in range(epochs):
        outs, seen = [], 0
        t0, c0 = time.perf_counter(), time.process_time()
        for X, y in batches.epoch():
            outs.append(step(X, y))
            seen += X.shape[0]
        if finish is not None:
            finish(outs)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        losses.append(sum(float(v) for v in outs) / max(1, seen))
    steps = batches.num_batches
    per_step = [t / steps for t in times]
    return {
        "name": name, "epoch_times": times, "epoch_cpu_times": cpu_times,
        "steps_per_epoch": steps,
        "full_batches": batches.full_batches,
        "sec_per_step": statistics.median(per_step),
        "sec_per_epoch": statistics.median(per_step) * batches.full_batches,
        "extrapolated": steps != batches.full_batches,
        "train_loss": losses,
    }


def rival_arguments(argv, doc, variants, threads_help):
    """The command line every rival takes (bench train passes the same to each)."""
    import argparse
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--data-dir", help="directory with the Fashion-MNIST IDX files")
    p.add_argument("--synthetic", type=int, default=0, help="use N random images instead")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--devices", default="1,2", help="chapter variant: numbers of CPU 'devices'")
    p.add_argument("--variants", default=variants)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per configuration")
    p.add_argument("--limit-batches", type=int, default=0, help="batches per epoch (0: all)")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--threads", type=int, default=2, help=threads_help)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_images(args):
    """(images, labels, seconds) from the rival's command line: Fashion-MNIST or synthetic."""
    t0 = time.perf_counter()
    if args.synthetic:
        images, labels = synthetic_split(args.synthetic, args.seed)
    else:
        images, labels = load_split(args.data_dir, "train")
    return images, labels, time.perf_counter() - t0


def print_result(results, load_sec, **settings):
    """The rival's one JSON object on stdout: its settings (framework versions, threads), this
    interpreter's, the data's load time and every configuration's result."""
    out = dict(settings, numpy_version=np.__version__, python=sys.executable,
               python_version=platform.python_version(), data_load_sec=load_sec,
               results=results)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
