"""LeNet's fused step in bfloat16 (``mgpu.train_batch(..., precision="bf16")``, ``mgpu.train``,
``mgpu train --model lenet --precision bf16``): both convolutions and both linear layers take
bfloat16 operands in every product (forward, data and weight gradients) with float32 sums;
bias, relu, pooling, the loss and SGD stay float32 (the convs' bias gradients sum the rounded dy
their products see, the linear layers' the unrounded one).

The reference is NumPy's, in float64: the same step with the operands of every product rounded
to bfloat16 (``test_bf16.bf16_numpy``: round to nearest, ties to even, from the float32 values
the step holds). Against it the fused step differs by float32's own rounding (sums of at most a
few thousand terms, each within k 2^-24: about 1e-6 of each update, normwise) and by the rare
operand whose float32 value rounds to the other bfloat16 neighbour than its float64 value does,
or the relu input on the other side of zero: one term among hundreds off by one bfloat16 step,
2^-7 of itself at most. So each update is within u / 8 of the reference, normwise, u = 2^-8 (the
problem below has such a flip: 3.2e-4, about u / 12; problems without one stay near 1e-6). A
product that skips the rounding is as far as bfloat16 is from float32, a kernel that rounds
another way (truncation) farther, 5e-3 to 1e-1 here. And the bf16 step lies farther from the
float32 step than float32's rounding explains (its distance from the exact float64 step, near
1e-6), many times over, so the test tells bfloat16 from float32.
"""
import numpy as np
import pytest

import ckpt_worker
import mgpu
import reference as ref
from conftest import crash_at_step, requires_fashion_mnist
from isa_paths import digests_on_every_path
from mgpu import checkpoint as ck
from test_bf16 import bf16_numpy

U = 2.0 ** -8
N, LR = 12, 0.2
TIGHT = U / 8  # from the rounded reference: float32 sums and rare flipped operands


def problem(seed=0, n=N):
    rng = np.random.default_rng(seed)
    X = rng.random((n, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, size=n)
    # The chapter's init times 10, so every gradient is well away from zero.
    params = [p.numpy() for p in mgpu.lenet_params(scale=0.1, seed=seed)]
    return X, y, params


def rounded(a):
    """A product's operand: the float64 value as the step holds it (float32), in bfloat16."""
    return bf16_numpy(np.asarray(a, np.float32)).astype(np.float64)


def exact(a):
    return np.asarray(a, np.float64)


def reference_step(X, y, params, q):
    """(summed loss, gradients) of one LeNet step in float64 where q(operand) is what each
    product of the convs and linear layers sees (``rounded`` or ``exact``); the biases, relu,
    pooling and the loss take the float64 values."""
    W1, b1, W2, b2, W3, b3, W4, b4 = (exact(p) for p in params)
    z1 = ref.conv2d_forward(q(X), q(W1), b1)
    h1 = ref.relu_forward(z1)
    p1 = ref.avg_pool2d_forward(h1, 2)
    z2 = ref.conv2d_forward(q(p1), q(W2), b2)
    h2 = ref.relu_forward(z2)
    p2 = ref.avg_pool2d_forward(h2, 2)
    f2 = p2.reshape(len(X), -1)
    z3 = q(f2) @ q(W3) + b3
    h3 = ref.relu_forward(z3)
    logits = q(h3) @ q(W4) + b4
    losses = ref.softmax_cross_entropy_forward(logits, y)
    dlogits = ref.softmax_cross_entropy_backward(logits, y, np.ones_like(losses))
    dW4, db4 = q(h3).T @ q(dlogits), dlogits.sum(0)
    dz3 = ref.relu_backward(z3, q(dlogits) @ q(W4).T)
    dW3, db3 = q(f2).T @ q(dz3), dz3.sum(0)
    dh2 = ref.avg_pool2d_backward(h2.shape, (q(dz3) @ q(W3).T).reshape(p2.shape), 2)
    dz2 = ref.relu_backward(z2, dh2)
    dp1, dW2, _ = ref.conv2d_backward(q(p1), q(W2), q(dz2))
    dz1 = ref.relu_backward(z1, ref.avg_pool2d_backward(h1.shape, dp1, 2))
    _, dW1, _ = ref.conv2d_backward(q(X), q(W1), q(dz1))
    # The convs' bias gradients sum the dy their products see: on CPUs LeNet's convs run
    # float32's kernels on rounded operands, db included (cpp/ops/bf16.h).
    db2, db1 = q(dz2).sum((0, 2, 3)), q(dz1).sum((0, 2, 3))
    return losses.sum(), [dW1, db1, dW2, db2, dW3, db3, dW4, db4]


def fused_step(X, y, params, devices, precision, deterministic=False, steps=1):
    """The replicas of the first device and the summed losses after `steps` fused steps."""
    reps = [mgpu.get_params([mgpu.array(p) for p in params], d) for d in devices]
    losses = []
    for _ in range(steps):
        out = mgpu.train_batch(mgpu.array(X), mgpu.array(y), reps, devices, LR,
                               deterministic=deterministic, precision=precision)
        losses.append(sum(v.item() for v in out))
    return [p.numpy() for p in reps[0]], losses


def updates(params, after):
    """p - p' of each parameter, in float64 (the step's lr / N * g, rounded into float32 p')."""
    return [exact(p) - exact(a) for p, a in zip(params, after)]


def normwise(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_against_reference(X, y, params, after, loss, what):
    """The module docstring's bound, on every parameter's update and on the loss; returns the
    updates."""
    loss_r, grads_r = reference_step(X, y, params, rounded)
    got = updates(params, after)
    for i, (d, g) in enumerate(zip(got, grads_r)):
        err = normwise(d, LR / len(X) * g)
        assert err <= TIGHT, f"{what}: param {i} is {err:.3g} from the bf16-rounded reference"
    assert abs(loss - loss_r) <= TIGHT * abs(loss_r), f"{what}: loss {loss} vs {loss_r}"
    return got


def test_lenet_bf16_step_is_the_rounded_reference_and_not_float32():
    X, y, params = problem()
    after, losses = fused_step(X, y, params, [mgpu.cpu(0)], "bf16")
    got = check_against_reference(X, y, params, after, losses[0], "bf16 step")
    after32, _ = fused_step(X, y, params, [mgpu.cpu(0)], "float32")
    got32 = updates(params, after32)
    _, grads_x = reference_step(X, y, params, exact)
    for i, (d, d32, g) in enumerate(zip(got, got32, grads_x)):
        f32_err = normwise(d32, LR / len(X) * g)  # float32's own distance from float64
        apart = normwise(d, d32)
        assert apart > 10 * f32_err and apart > U / 64, (
            f"param {i}: bf16 is {apart:.3g} from float32, whose error is {f32_err:.3g}: "
            "the products did not take bfloat16 operands")


def test_lenet_bf16_on_two_devices_and_an_odd_batch_is_the_reference():
    """The split batch (7 and 6 images) and the all-reduce in float32 change nothing beyond
    float32 rounding."""
    X, y, params = problem(seed=1, n=13)
    after, losses = fused_step(X, y, params, [mgpu.cpu(0), mgpu.cpu(1)], "bf16")
    check_against_reference(X, y, params, after, losses[0], "bf16 step on 2 devices")


def test_lenet_bf16_deterministic_has_the_same_bits_on_one_and_two_devices():
    X, y, params = problem(seed=2)
    one, l1 = fused_step(X, y, params, [mgpu.cpu(0)], "bf16", deterministic=True, steps=2)
    two, l2 = fused_step(X, y, params, [mgpu.cpu(0), mgpu.cpu(1)], "bf16", deterministic=True,
                         steps=2)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a.tobytes() == b.tobytes(), f"param {i}: 1 vs 2 devices"
    assert l1 == l2
    f32, _ = fused_step(X, y, params, [mgpu.cpu(0)], "float32", deterministic=True, steps=2)
    assert not np.array_equal(f32[0], one[0])  # bf16 took effect in the deterministic step


ISA_CODE = """
import hashlib, numpy as np, mgpu
rng = np.random.default_rng(5)
X = rng.random((10, 1, 28, 28)).astype(np.float32)
y = rng.integers(0, 10, size=10)
devices = [mgpu.cpu(0), mgpu.cpu(1)]
reps = [mgpu.get_params(mgpu.lenet_params(scale=0.1, seed=5), d) for d in devices]
for _ in range(2):
    mgpu.train_batch(mgpu.array(X), mgpu.array(y), reps, devices, 0.2, deterministic=True,
                     precision="bf16")
h = hashlib.sha256(b"".join(p.numpy().tobytes() for p in reps[0]))
print(mgpu.build_info()["cpu_bf16"], h.hexdigest())
"""


def test_lenet_bf16_step_has_the_same_bits_on_every_isa_path():
    """avx512_bf16 (vdpbf16ps), avx512 and avx2 (float32 FMAs on the rounded values), each where
    this CPU runs it: the whole step, float32 parts included."""
    seen = digests_on_every_path(ISA_CODE, MGPU_EMULATED_GPUS="0")
    assert len(set(seen.values())) == 1, seen


def test_lenet_precision_is_checked_where_it_is_given():
    X, y, params = problem(n=2)
    reps = [mgpu.get_params([mgpu.array(p) for p in params], mgpu.cpu(0))]
    with pytest.raises(ValueError, match="train_batch: precision must be 'float32' or 'bf16'"):
        mgpu.train_batch(mgpu.array(X), mgpu.array(y), reps, [mgpu.cpu(0)], LR, precision="fp16")
    with pytest.raises(ValueError, match="train: precision must be 'float32' or 'bf16'"):
        mgpu.train(1, 4, LR, 1, data=([], []), precision="half")


@pytest.mark.parametrize("k", [1, 2])
def test_lenet_bf16_fused_step_is_the_chapters_step_under_autocast(k):
    """The chapter's op-by-op step (autograd, Python all-reduce) under mgpu.autocast("bf16")
    runs the same products on the same values: the fused step's bits."""
    X, y, params = problem(seed=1, n=13)
    devices = [mgpu.cpu(i) for i in range(k)]
    fused, _ = fused_step(X, y, params, devices, "bf16")
    reps = [mgpu.get_params([mgpu.array(p) for p in params], d) for d in devices]
    with mgpu.autocast("bf16"):
        mgpu.chapter.train_batch(mgpu.array(X), mgpu.array(y), reps, devices, LR)
    for i, (a, b) in enumerate(zip(fused, reps[0])):
        assert a.tobytes() == b.numpy().tobytes(), f"param {i}: fused vs op by op"


def train_bf16(tmp_path, name=None, precision="bf16"):
    ck = {} if name is None else dict(checkpoint=str(tmp_path / name), checkpoint_every=3,
                                      resume=True)
    params = mgpu.lenet_params(scale=0.1, seed=4)
    result = mgpu.train(2, 64, 0.5, num_epochs=2, params=params, data=ckpt_worker.data(),
                        progress=False, precision=precision, **ck)
    return result


def test_train_bf16_resumes_to_the_same_losses_and_refuses_another_precision(tmp_path,
                                                                            monkeypatch):
    """2 devices, 5 steps an epoch: a crash at step 7 resumes from step 6's checkpoint."""
    whole = train_bf16(tmp_path)
    crash_at_step(monkeypatch, 7)
    with pytest.raises(KeyboardInterrupt):
        train_bf16(tmp_path, "c")
    monkeypatch.undo()
    resumed = train_bf16(tmp_path, "c")
    assert resumed.train_loss == whole.train_loss and resumed.test_acc == whole.test_acc
    with pytest.raises(ck.CheckpointError, match="precision='bf16', this run has "
                       "precision='float32'"):
        train_bf16(tmp_path, "c", precision="float32")
    f32 = train_bf16(tmp_path, precision="float32")
    assert f32.train_loss != whole.train_loss  # bf16 took effect in mgpu.train


@requires_fashion_mnist
def test_cli_trains_lenet_in_bf16(capsys):
    from mgpu import cli
    assert cli.main(["train", "--model", "lenet", "--precision", "bf16", "--num-gpus", "2",
                     "--limit-batches", "3", "--epochs", "1", "--batch-size", "64",
                     "--deterministic"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("test acc: ")
    assert cli.main(["train", "--model", "lenet", "--precision", "bf16", "--op-by-op",
                     "--limit-batches", "2", "--epochs", "1", "--batch-size", "64"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("test acc: ")

