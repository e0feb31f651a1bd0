"""One training process of the checkpoint tests (tests/test_checkpoint.py starts it, killed or not).

    python ckpt_worker.py CKPT_DIR OUT.npz EPOCHS [EVERY] [DEVICES] [det]

Trains LeNet on synthetic data with ``mgpu.train(checkpoint=CKPT_DIR, resume=True)``, printing
"step N" after every step so the test can kill it at a chosen point, and writes the final
parameters to OUT.npz (with "det": trains deterministic=True, leaving the final parameters in the
newest checkpoint). Under mpirun the same script trains one process per rank.
"""
import os
import sys

import numpy as np

import mgpu
from mgpu import distributed as dist
from mgpu.data import array_loader

# 280 examples in batches of 64: 5 steps per epoch, the last one short (24 examples).
N, BATCH, LR = 280, 64, 0.5


def data():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 10, size=N).astype(np.uint8)
    images = rng.integers(0, 96, size=(N, 28, 28)).astype(np.uint8)
    for i, c in enumerate(labels):
        images[i, 2 * c:2 * c + 6, 4:24] += 150
    return (array_loader(images, labels, BATCH, shuffle=True, seed=11),
            array_loader(images[:64], labels[:64], 64))


def main(ckpt_dir, out, epochs, every=None, devices=1, deterministic=""):
    if deterministic:  # the fused step in its deterministic mode: the same bits on any devices
        mgpu.train(int(devices), BATCH, LR, num_epochs=int(epochs),
                   params=mgpu.lenet_params(scale=0.1, seed=4), data=data(), progress=False,
                   deterministic=True, checkpoint=ckpt_dir, checkpoint_every=int(every),
                   resume=True)
        return
    seen = {}

    def printing_step(X, y, device_params, devs, lr):
        losses = mgpu.train_batch(X, y, device_params, devs, lr)
        seen["params"] = device_params  # train's replicas, to read the final parameters
        seen["n"] = seen.get("n", 0) + 1
        print(f"step {seen['n']}", flush=True)
        return losses
    kw = {} if ckpt_dir == "-" else dict(checkpoint=ckpt_dir, resume=True,
                                         checkpoint_every=int(every) if every else None)
    params = mgpu.lenet_params(scale=0.1, seed=4)
    result = mgpu.train(int(devices), BATCH, LR, num_epochs=int(epochs), params=params,
                        data=data(), progress=False, step=printing_step, **kw)
    if dist.rank() == 0:
        if "params" in seen:
            ps = [p.numpy() for p in seen["params"][0]]
        else:  # resumed after the last step: the newest checkpoint holds the final parameters
            files = sorted(f for f in os.listdir(ckpt_dir) if f.startswith("ckpt-"))
            ps = mgpu.load(os.path.join(ckpt_dir, files[-1]))["params"]
        np.savez(out, *ps, np.array(result.train_loss), np.array(result.test_acc))


if __name__ == "__main__":
    main(*sys.argv[1:])
