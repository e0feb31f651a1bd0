"""The JAX chapters' code, timed on CPU for ``mgpu bench train --compare jax``.

Runs in a separate interpreter (a Python with jax, flax, optax and NumPy: ``bash .ci/peers.sh
jax`` makes one in build/peers/jax) and must never import mgpu: it shares only the NumPy-only
``rival_common.py`` (IDX files, synthetic draw, shuffled batches, timing loop) with the PyTorch
rival and prints one JSON object on stdout. Variants:

``chapter``: the JAX chapter's code (sec. 12.5 in JAX: lenet with lax.conv_general_dilated and
reduce_window average pooling, init N(0, 0.01^2) from PRNGKey splits, get_params stacking the
replicas, split_batch reshaping, pmap_step with pmean of the gradients, train_batch) on k host
devices, made with ``XLA_FLAGS=--xla_force_host_platform_device_count=k`` before jax is imported.

``resnet18``: the concise chapter's Flax ResNet18 (sec. 12.6 in JAX: d2l's Residual, nn.BatchNorm
with its batch_stats mutable in training, mean softmax cross-entropy, optax.sgd(lr)), the step
jitted on one device, or pmapped with pmean of the gradients on k > 1 host devices. Its input is
NHWC, as Flax expects; the layout change is part of the batch's gather, outside the step.

Both see the same shuffled batches as the other sides of the bench; the first calls (compilation)
are warm-up, and each timed epoch ends by blocking on the step's outputs (block_until_ready).
Threads: XLA's CPU client sizes its thread pool from the CPUs this process may run on, so
``--threads N`` restricts the process's CPU affinity to N CPUs (and N = 1 also turns XLA's
multi-threaded Eigen off); the JSON records the threads, XLA_FLAGS and the OS threads seen.
XLA divides those threads among the process's host devices (a 1-device step in a process made
with 2 host devices runs on one thread), so ``--devices`` should name one count per process for
timings: the process gets max(devices) host devices.
"""
import functools
import os
import sys
from types import SimpleNamespace

import numpy as np

try:  # imported as mgpu.bench.jax_rival
    from . import rival_common as common
except ImportError:  # run by path: bench train's launcher has loaded it as a top-level module
    import rival_common as common


def configure_xla(num_devices, threads):
    """XLA_FLAGS and CPU affinity for ``num_devices`` host devices on ``threads`` CPUs; must run
    before jax is imported. Returns the number of CPUs this process may use."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={int(num_devices)}")
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    cpus = sorted(os.sched_getaffinity(0))
    if 0 < threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])
    return len(os.sched_getaffinity(0))


# --- the JAX chapter's code (sec. 12.5 in JAX) --------------------------------------------------

def chapter_params(jax, jnp, seed):
    """The chapter's initial parameters: N(0, 0.01^2) weights from four PRNGKey splits, zero
    biases (the chapter uses PRNGKey(0); ``seed`` picks the key)."""
    scale = 0.01
    key = jax.random.PRNGKey(seed)
    keys = jax.random.split(key, 4)
    W1 = jax.random.normal(keys[0], (20, 1, 3, 3)) * scale
    b1 = jnp.zeros(20)
    W2 = jax.random.normal(keys[1], (50, 20, 5, 5)) * scale
    b2 = jnp.zeros(50)
    W3 = jax.random.normal(keys[2], (800, 128)) * scale
    b3 = jnp.zeros(128)
    W4 = jax.random.normal(keys[3], (128, 10)) * scale
    b4 = jnp.zeros(10)
    return [W1, b1, W2, b2, W3, b3, W4, b4]


def make_chapter(jax, jnp, optax):
    """The chapter's functions as it writes them; the one change is marked."""
    def lenet(params, X):
        h1_conv = jax.lax.conv_general_dilated(
            X, params[0], window_strides=(1, 1), padding='VALID',
            dimension_numbers=('NCHW', 'OIHW', 'NCHW'))
        h1_conv = h1_conv + params[1].reshape(1, -1, 1, 1)
        h1_activation = jax.nn.relu(h1_conv)
        # Average pooling
        h1 = jax.lax.reduce_window(
            h1_activation, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2),
            'VALID') / 4.0
        h2_conv = jax.lax.conv_general_dilated(
            h1, params[2], window_strides=(1, 1), padding='VALID',
            dimension_numbers=('NCHW', 'OIHW', 'NCHW'))
        h2_conv = h2_conv + params[3].reshape(1, -1, 1, 1)
        h2_activation = jax.nn.relu(h2_conv)
        h2 = jax.lax.reduce_window(
            h2_activation, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2),
            'VALID') / 4.0
        h2 = h2.reshape(h2.shape[0], -1)
        h3_linear = jnp.dot(h2, params[4]) + params[5]
        h3 = jax.nn.relu(h3_linear)
        y_hat = jnp.dot(h3, params[6]) + params[7]
        return y_hat

    def get_params(params, num_devices):
        """Replicate parameters across multiple devices."""
        return jax.tree.map(lambda x: jnp.stack([x] * num_devices), params)

    def split_batch(X, y, num_devices):
        """Split `X` and `y` across devices by reshaping."""
        assert X.shape[0] == y.shape[0]
        batch_size = X.shape[0]

        def _reshape(a):
            return a.reshape(num_devices, batch_size // num_devices, *a.shape[1:])
        return _reshape(X), _reshape(y)

    @functools.partial(jax.pmap, axis_name='batch', static_broadcasted_argnums=(3,))
    def pmap_step(params, X_shard, y_shard, lr):
        """One training step executed in parallel on each device."""
        def loss_fn(p):
            y_hat = lenet(p, X_shard)
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(y_hat, y_shard))
        # Change: value_and_grad instead of grad, and the mean loss returned beside the new
        # parameters, so the JSON has the training loss as the PyTorch rival's has; the loss
        # is the forward pass's own value, so the step's work is the same.
        loss, grads = jax.value_and_grad(loss_fn)(params)
        # All-reduce: sum gradients across devices
        grads = jax.lax.pmean(grads, axis_name='batch')
        # SGD update
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, jax.lax.pmean(loss, axis_name='batch')

    def train_batch(replicated_params, X, y, num_gpus, lr):
        X_shards, y_shards = split_batch(X, y, num_gpus)
        return pmap_step(replicated_params, X_shards, y_shards, lr)

    return SimpleNamespace(lenet=lenet, get_params=get_params, split_batch=split_batch,
                           pmap_step=pmap_step, train_batch=train_batch)


# --- the concise chapter's Flax ResNet18 (sec. 12.6 in JAX) ---------------------------------------

def make_resnet18(nn, num_classes=10, training=True):
    """The concise chapter's ResNet18 module with d2l's JAX Residual block."""
    class Residual(nn.Module):
        """The Residual block of ResNet models (d2l.Residual, JAX)."""
        num_channels: int
        use_1x1conv: bool = False
        strides: tuple = (1, 1)
        training: bool = True

        def setup(self):
            self.conv1 = nn.Conv(self.num_channels, kernel_size=(3, 3), padding='same',
                                 strides=self.strides)
            self.conv2 = nn.Conv(self.num_channels, kernel_size=(3, 3), padding='same')
            if self.use_1x1conv:
                self.conv3 = nn.Conv(self.num_channels, kernel_size=(1, 1),
                                     strides=self.strides)
            else:
                self.conv3 = None
            self.bn1 = nn.BatchNorm(not self.training)
            self.bn2 = nn.BatchNorm(not self.training)

        def __call__(self, X):
            Y = nn.relu(self.bn1(self.conv1(X)))
            Y = self.bn2(self.conv2(Y))
            if self.conv3:
                X = self.conv3(X)
            Y += X
            return nn.relu(Y)

    class ResNet18(nn.Module):
        """A slightly modified ResNet-18 model."""
        num_classes: int = 10
        training: bool = True

        def setup(self):
            self.net = nn.Sequential([
                nn.Conv(64, kernel_size=(3, 3), strides=(1, 1), padding='same'),
                nn.BatchNorm(not self.training),
                nn.relu,
                # ResNet blocks
                Residual(64, training=self.training),
                Residual(64, training=self.training),
                Residual(128, use_1x1conv=True, strides=(2, 2), training=self.training),
                Residual(128, training=self.training),
                Residual(256, use_1x1conv=True, strides=(2, 2), training=self.training),
                Residual(256, training=self.training),
                Residual(512, use_1x1conv=True, strides=(2, 2), training=self.training),
                Residual(512, training=self.training),
                # Global average pooling and classifier
                lambda x: x.mean(axis=(1, 2)),
                nn.Dense(self.num_classes),
            ])

        def __call__(self, x):
            return self.net(x)

    return ResNet18(num_classes=num_classes, training=training)


def make_resnet_step(jax, optax, model, tx, num_devices):
    """The training step: BatchNorm's batch_stats updated (mutable), mean softmax cross-entropy,
    ``tx`` (optax.sgd) applied; jitted on one device, pmapped with pmean of the gradients (and of
    the reported loss) on more. Each device keeps the batch statistics of its own shard."""
    axis = "batch" if num_devices > 1 else None

    def step(params, batch_stats, opt_state, X, y):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": batch_stats}, X,
                                          mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, updates["batch_stats"]
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if axis:
            grads = jax.lax.pmean(grads, axis_name=axis)
            loss = jax.lax.pmean(loss, axis_name=axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    return jax.pmap(step, axis_name=axis) if axis else jax.jit(step)


def param_count(jax, tree):
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


# --- timing -----------------------------------------------------------------------------------

class _Loss:
    """A step's mean loss (a device array, maybe still being computed) as the batch's summed
    loss: converted only after the epoch's timing, so no step waits for its predecessor."""

    def __init__(self, loss, batch):
        self.loss, self.batch = loss, batch

    def __float__(self):
        return float(np.asarray(self.loss).reshape(-1)[0]) * self.batch


def _time(jax, name, step, state, batches, args):
    """common.run_config with JAX's waits: each epoch ends by blocking on the last state and
    every loss. Compilation stays in the warm-up: at least 2 steps, because a pmapped step
    compiles again on its second call (its inputs are then the first call's outputs, sharded
    over the devices), then, when whole epochs are timed and the last batch is smaller, one
    step on that batch's shape."""
    def finish(outs):
        jax.block_until_ready(([o.loss for o in outs], state["now"]))

    warmup = max(2, args.warmup)
    n, b = len(batches.y), batches.batch_size
    smaller_last = batches.num_batches == batches.full_batches and n % b

    def last_batch():
        if smaller_last:
            finish([step(*batches.gather(np.arange(n - n % b, n)))])

    r = common.run_config(name, step, batches, args.epochs, warmup, on_timed=last_batch,
                          finish=finish)
    r["warmup_batches"] = warmup + bool(smaller_last)  # what ran untimed, compilation included
    return r


def _chapter_config(jax, jnp, optax, k, images, labels, args):
    ch = make_chapter(jax, jnp, optax)
    state = {"now": ch.get_params(chapter_params(jax, jnp, args.seed), k)}
    batches = common.Batches(images, labels, args.batch_size, args.limit_batches, args.seed,
                             make=lambda X, y: (jnp.asarray(X), jnp.asarray(y.astype(np.int32))))

    def step(X, y):
        state["now"], loss = ch.train_batch(state["now"], X, y, k, args.lr)
        return _Loss(loss, y.size)

    r = _time(jax, f"jax chapter pmap_step, {k} device{'s' if k > 1 else ''}", step, state,
              batches, args)
    r.update(variant="chapter", num_devices=k, global_batch=args.batch_size)
    return r


def _resnet_config(jax, jnp, optax, nn, k, images, labels, args):
    model = make_resnet18(nn)
    variables = model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, 28, 28, 1), jnp.float32))
    tx = optax.sgd(args.lr)
    tree = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
    if k > 1:
        tree = jax.tree.map(lambda x: jnp.stack([x] * k), tree)
    state = {"now": tree}
    train_step = make_resnet_step(jax, optax, model, tx, k)

    def make(X, y):
        X = np.ascontiguousarray(X.transpose(0, 2, 3, 1))  # NCHW -> NHWC
        y = y.astype(np.int32)
        if k > 1:  # pmap takes the shards along a leading device axis
            X, y = X.reshape(k, -1, *X.shape[1:]), y.reshape(k, -1)
        return X, y

    batches = common.Batches(images, labels, args.batch_size, args.limit_batches, args.seed,
                             make=make)

    def step(X, y):
        *state["now"], loss = train_step(*state["now"], X, y)
        return _Loss(loss, y.size)

    how = "jit" if k == 1 else "pmap"
    r = _time(jax, f"jax Flax ResNet-18 ({how}), {k} device{'s' if k > 1 else ''}", step, state,
              batches, args)
    r.update(variant="resnet18", num_devices=k, global_batch=args.batch_size,
             num_params=param_count(jax, variables["params"]),
             peak_rss_bytes=common.peak_rss_bytes())
    return r


def main(argv=None):
    args = common.rival_arguments(argv, __doc__, "chapter",
                                  "CPUs (so XLA threads) this process uses")
    devices = [int(s) for s in args.devices.split(",") if s]
    cpus = configure_xla(max(devices), args.threads)

    import flax
    import jax
    import optax
    from flax import linen as nn
    from jax import numpy as jnp

    images, labels, load_sec = common.load_images(args)
    results = []
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - {"chapter", "resnet18"}
    if unknown:
        raise SystemExit(f"jax_rival: unknown variants {sorted(unknown)} (chapter, resnet18)")
    for k in devices:
        if "chapter" in variants:
            results.append(_chapter_config(jax, jnp, optax, k, images, labels, args))
        if "resnet18" in variants:
            results.append(_resnet_config(jax, jnp, optax, nn, k, images, labels, args))
    for r in results:  # this process's settings, on each row (bench train runs one k a process)
        r.update(threads=cpus, host_devices=jax.local_device_count(),
                 xla_flags=os.environ["XLA_FLAGS"])

    common.print_result(
        results, load_sec, jax_version=jax.__version__, jaxlib_version=jax.lib.__version__,
        flax_version=flax.__version__, optax_version=optax.__version__, threads=cpus,
        xla_flags=os.environ["XLA_FLAGS"], os_threads=len(os.listdir("/proc/self/task")),
        host_devices=jax.local_device_count())
    return 0


if __name__ == "__main__":
    sys.exit(main())
