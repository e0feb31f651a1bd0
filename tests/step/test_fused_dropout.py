"""nn.Dropout inside the fused step (DataParallel.train_step): one step against a NumPy float64
step applying the reference masks (on 1, 2, 3 CPU devices and with accumulate, whose masks must
be those of the global batch), the same bits on any device count and with accumulate in
deterministic mode, seeds from mgpu.random, evaluation as the identity, and a checkpointed run
resumed after a crash ending with the bits of an uninterrupted one."""
import numpy as np
import pytest

import ckpt_worker
import dist_worker
import mgpu
import reference as ref
from conftest import crash_at_step
from mgpu import nn, optim

CPUS = [mgpu.cpu(0), mgpu.cpu(1), mgpu.cpu(2)]
P = 0.4


def mlp():
    mgpu.random.seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Dropout(P),
                         nn.Linear(12, 10))


def batch(n=9, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 1, 4, 4)).astype(np.float32),
            rng.integers(0, 10, size=n).astype(np.int64))


def next_step_seed():
    """The seed the next fused step draws from mgpu.random (without drawing it)."""
    g = mgpu.random.generator_from_state(mgpu.random.get_state())
    return int(g.integers(0, 2**64, dtype=np.uint64))


def reference_step(X, y, params, mask, lr):
    """Loss and SGD-updated parameters of flatten -> linear -> relu -> x * mask -> linear on the
    mean cross-entropy, in float64."""
    W1, b1, W2, b2 = (np.asarray(p, np.float64) for p in params)
    x = X.reshape(len(X), -1).astype(np.float64)
    pre = x @ W1.T + b1
    h = np.maximum(pre, 0)
    d = h * mask
    z = d @ W2.T + b2
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n = len(X)
    loss = -np.log(prob[np.arange(n), y]).mean()
    dz = prob.copy()
    dz[np.arange(n), y] -= 1
    dz /= n
    dW2, db2 = dz.T @ d, dz.sum(0)
    dpre = (dz @ W2) * mask * (pre > 0)
    dW1, db1 = dpre.T @ x, dpre.sum(0)
    return loss, [p - lr * g for p, g in zip((W1, b1, W2, b2), (dW1, db1, dW2, db2))]


def check_step_against_reference(devices, accumulate=1, deterministic=False):
    """One fused step of mlp() on `devices` against reference_step with the masks of the seed
    the step draws (stream 3: the dropout layer's index in the spec)."""
    net = mlp()
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(net.parameters(), lr=0.5)
    X, y = batch()
    before = [p.numpy().copy() for p in net.parameters()]
    seed = next_step_seed()
    loss = dp.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), trainer,
                         accumulate=accumulate, deterministic=deterministic).item()
    kinds = [kind for kind, _ in dp._fused.spec]
    assert kinds == ["flatten", "linear", "relu", "dropout", "linear"]
    mask = ref.dropout_mask((9, 12), P, seed, stream=3).astype(np.float64)
    assert 0 < np.count_nonzero(mask) < mask.size
    want_loss, want = reference_step(X, y, before, mask, 0.5)
    assert abs(loss - want_loss) < 1e-5 * max(1.0, abs(want_loss))
    for i, (got, exp) in enumerate(zip(net.parameters(), want)):
        np.testing.assert_allclose(got.numpy(), exp, rtol=1e-4, atol=1e-6,
                                   err_msg=f"parameter {i}")
    # The step drew its seed from mgpu.random: the next one differs.
    assert next_step_seed() != seed


@pytest.mark.parametrize("devices,accumulate,deterministic", [
    (1, 1, False), (2, 1, False), (3, 1, False), (2, 3, False), (1, 1, True), (3, 2, True)])
def test_one_step_matches_the_float64_step_with_the_reference_masks(devices, accumulate,
                                                                    deterministic):
    check_step_against_reference(CPUS[:devices], accumulate, deterministic)


def deterministic_arrays(devices, accumulate=1):
    return dist_worker.dropout_steps(devices, True, accumulate)


def test_deterministic_bits_on_one_two_and_three_devices_and_with_accumulate():
    one = deterministic_arrays(CPUS[:1])
    for name, got in (("2 devices", deterministic_arrays(CPUS[:2])),
                      ("3 devices", deterministic_arrays(CPUS)),
                      ("2 devices, accumulate=2", deterministic_arrays(CPUS[:2], 2)),
                      ("1 device, accumulate=4", deterministic_arrays(CPUS[:1], 4))):
        nparams = len(list(dist_worker.dropout_net().parameters()))
        for i in range(nparams):
            assert np.array_equal(got[i], one[i]), f"{name}: parameter {i} differs from 1 device"
        if "accumulate" not in name:  # batch norm's running statistics move per micro-batch
            for i, (g, e) in enumerate(zip(got, one)):
                assert np.array_equal(g, e), f"{name}: array {i} differs from 1 device"


def test_the_seed_repeats_the_masks_and_another_seed_changes_them():
    def steps(seed):
        net = dist_worker.dropout_net()  # seeds 12 itself: the same initial weights
        mgpu.random.seed(seed)  # the step seeds' source
        return dist_worker.deterministic_bn(CPUS[:1], 2, net=net)
    a, b, c = steps(100), steps(100), steps(101)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not np.array_equal(a[0], c[0])


def test_evaluation_is_the_identity():
    net = mlp()
    dp = nn.DataParallel(net, device_ids=CPUS[:2])
    trainer = optim.SGD(net.parameters(), lr=0.5)
    X, y = batch()
    dp.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), trainer)
    W1, b1, W2, b2 = (p.numpy().astype(np.float64) for p in net.parameters())
    want = np.maximum(X.reshape(9, -1) @ W1.T + b1, 0) @ W2.T + b2
    fused = dp._fused.model.forward(mgpu.array(X)).numpy()
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-6)
    net.eval()
    np.testing.assert_allclose(net(mgpu.array(X)).numpy(), want, rtol=1e-5, atol=1e-6)
    counts = dp._fused.model.evaluate_counts(mgpu.array(X), mgpu.array(y))
    assert sum(c.item() for c in counts) == np.sum(want.argmax(1) == y)


def test_dropout_p0_adds_no_layer_and_p1_zeroes_the_classifier_input():
    mgpu.random.seed(3)
    net = nn.Sequential(nn.Flatten(), nn.Dropout(0.0), nn.Linear(16, 10))
    dp = nn.DataParallel(net, device_ids=CPUS[:1])
    X, y = batch()
    dp.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(),
                  optim.SGD(net.parameters(), lr=0.5))
    assert [kind for kind, _ in dp._fused.spec] == ["flatten", "linear"]
    mgpu.random.seed(3)
    net = nn.Sequential(nn.Flatten(), nn.Dropout(1.0), nn.Linear(16, 10))
    W = net[2].weight.numpy().copy()
    dp = nn.DataParallel(net, device_ids=CPUS[:1])
    dp.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(),
                  optim.SGD(net.parameters(), lr=0.5))
    assert np.array_equal(net[2].weight.numpy(), W)  # its input was all zeros
    assert not np.array_equal(net[2].bias.numpy(), np.zeros(10, np.float32))


def _concise(tmp_path, name, crash_at=None, monkeypatch=None):
    if crash_at is not None:
        crash_at_step(monkeypatch, crash_at)
    mgpu.random.seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.AvgPool2d(2), nn.Flatten(), nn.Dropout(0.5),
                        nn.Linear(4 * 14 * 14, 10))
    kw = {} if name is None else dict(checkpoint=str(tmp_path / name), checkpoint_every=2,
                                      resume=True)
    result = mgpu.chapter.train_concise(net, 2, ckpt_worker.BATCH, 0.2, 2,
                                        data=ckpt_worker.data(), progress=False, fused=True,
                                        **kw)
    return {k: v.numpy() for k, v in net.state_dict().items()}, result


def test_a_checkpointed_run_resumed_after_a_crash_ends_bitwise(tmp_path, monkeypatch):
    ref_state, ref_result = _concise(tmp_path, None)
    with pytest.raises(KeyboardInterrupt):
        _concise(tmp_path, "c", crash_at=7, monkeypatch=monkeypatch)
    monkeypatch.undo()
    got, result = _concise(tmp_path, "c")
    for k in ref_state:
        assert np.array_equal(got[k], ref_state[k]), k
    assert result.train_loss == ref_result.train_loss
