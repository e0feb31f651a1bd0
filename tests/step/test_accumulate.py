"""Gradient accumulation: ``DataParallel.no_sync()`` in the book's loop and ``accumulate=K`` in the
fused step. K micro-batches give one batch's step: bitwise in deterministic mode (on 1, 2, 3 CPU
devices, batch norm included), to float tolerance otherwise (against the book's loop with K
backward() calls and a NumPy float64 reference); the micro-batches start no reduction (counted);
bad values change nothing."""
import json

import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close
from mgpu import nn, optim
from mgpu.chapter import accumulated_backward
from test_deterministic import assert_bitwise
from test_optim import concise_run

CPUS = [mgpu.cpu(i) for i in range(3)]


def batches(steps, n=24, last=None, seed=5, shape=(1, 8, 8)):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        m = last if last is not None and s == steps - 1 else n
        out.append((rng.standard_normal((m, *shape)).astype(np.float32),
                    rng.integers(0, 10, size=m).astype(np.int32)))
    return out


def plain_net():
    """No batch norm: accumulation then computes exactly the whole batch's gradient."""
    mgpu.random.seed(3)
    return nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 10))


def fused_run(make_net, devices, accumulate, deterministic=False, steps=4, last=13,
              optimizer="sgd"):
    """`steps` DataParallel.train_step calls on batches of 24 (the last of `last`); returns the
    master's parameters, its buffers, the last replica's parameters and the losses."""
    net = make_net()
    dp = nn.DataParallel(net, device_ids=devices)
    if optimizer == "sgd":
        trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    else:
        trainer = optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    loss = nn.CrossEntropyLoss()
    losses = []
    for Xn, yn in batches(steps, last=last):
        losses.append(dp.train_step(mgpu.array(Xn), mgpu.array(yn), loss, trainer,
                                    deterministic=deterministic, accumulate=accumulate).item())
    return ([p.numpy() for p in net.parameters()], [b.numpy() for b in net.buffers()],
            [p.numpy() for p in dp._fused.replica_params[-1]], np.array(losses))


def book_run(make_net, devices, accumulate, steps=4, last=13):
    """The book's loop with accumulate micro-batches (no_sync) and SGD as fused_run's."""
    net = make_net()
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    loss = nn.CrossEntropyLoss()
    for Xn, yn in batches(steps, last=last):
        trainer.zero_grad()
        accumulated_backward(dp, loss, mgpu.array(Xn), mgpu.array(yn), accumulate)
        trainer.step()
    return [p.numpy() for p in net.parameters()], [b.numpy() for b in net.buffers()]


# --- deterministic: bitwise the parameters of one batch ----------------------------------------

@pytest.fixture(scope="module")
def bn_whole_batch():
    return fused_run(dist_worker.bn_net, CPUS[:1], 1, deterministic=8)


@pytest.mark.parametrize("devices,accumulate", [(1, 2), (1, 8), (2, 2), (2, 4), (3, 2),
                                                (3, 4)])
def test_deterministic_accumulation_gives_the_bits_of_one_batch(devices, accumulate,
                                                                bn_whole_batch):
    """bn_net (conv, batch norm, a residual block, linear), SGD with momentum and weight decay,
    4 steps with an uneven last batch of 13 (fewer rows than some micro-batches' shards): the
    parameters are bitwise those of accumulate=1 on one device, every replica alike."""
    params, buffers, last, losses = fused_run(dist_worker.bn_net, CPUS[:devices], accumulate,
                                              deterministic=8)
    assert_bitwise(params, bn_whole_batch[0], f"{devices} devices, accumulate={accumulate}")
    assert_bitwise(last, params, "the last replica against the master")
    np.testing.assert_allclose(losses, bn_whole_batch[3], rtol=1e-5)
    # Running statistics move once per micro-batch: not those of one batch.
    assert not np.array_equal(buffers[0], bn_whole_batch[1][0])


def test_fewer_rows_than_shards_or_micro_batches():
    """A last batch of 5 rows over 8 shards in 8 micro-batches (3 of them empty) keeps the bits
    of one batch; without shards, 3 rows in 5 micro-batches (2 empty) the step of one batch."""
    ref = fused_run(dist_worker.bn_net, CPUS[:1], 1, deterministic=8, steps=2, last=5)
    got = fused_run(dist_worker.bn_net, CPUS[:3], 8, deterministic=8, steps=2, last=5)
    assert_bitwise(got[0], ref[0], "3 devices, accumulate=8, a batch of 5")
    one = fused_run(plain_net, CPUS[:1], 1, steps=2, last=3)
    five = fused_run(plain_net, CPUS[:2], 5, steps=2, last=3)
    for i, (g, e) in enumerate(zip(five[0], one[0])):
        assert_close(g, e, "sum", f"param {i}, a batch of 3 in 5 micro-batches")


def test_deterministic_running_statistics_do_not_depend_on_devices():
    """With one accumulate, 1, 2 and 3 devices give the same running statistics too: each
    micro-batch's first shard moves them, in order."""
    one = fused_run(dist_worker.bn_net, CPUS[:1], 2, deterministic=8, steps=2)
    for k in (2, 3):
        got = fused_run(dist_worker.bn_net, CPUS[:k], 2, deterministic=8, steps=2)
        assert_bitwise(got[1], one[1], f"buffers, {k} devices")


def test_deterministic_adamw_accumulation_is_bitwise():
    ref = fused_run(dist_worker.bn_net, CPUS[:1], 1, deterministic=4, steps=2, optimizer="adamw")
    got = fused_run(dist_worker.bn_net, CPUS[:2], 4, deterministic=4, steps=2, optimizer="adamw")
    assert_bitwise(got[0], ref[0], "AdamW, 2 devices, accumulate=4")


# --- otherwise: the same step to float tolerance ----------------------------------------------

@pytest.mark.parametrize("devices", [1, 2, 3])
def test_fused_accumulation_matches_one_batch_without_batch_norm(devices):
    """K micro-batches (24 rows in 3 and 5: uneven micro-batches; 13 in 5) against the whole
    batch at once: the mean loss's gradient either way."""
    ref = fused_run(plain_net, CPUS[:1], 1)
    for k in (3, 5):
        got = fused_run(plain_net, CPUS[:devices], k)
        for i, (g, e) in enumerate(zip(got[0], ref[0])):
            assert_close(g, e, "sum", f"param {i}, {devices} devices, accumulate={k}")
        np.testing.assert_allclose(got[3], ref[3], rtol=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
def test_fused_accumulation_is_the_book_loop_with_no_sync_batch_norm_per_micro_batch(devices):
    """With batch norm, per micro-batch statistics (and running statistics moved per
    micro-batch): the fused step against the book's loop with K backward() calls."""
    fused = fused_run(dist_worker.bn_net, CPUS[:devices], 2)
    book = book_run(dist_worker.bn_net, CPUS[:devices], 2)
    # num_batches_tracked is not counted by the fused step: the float buffers only.
    floats = ([b for b in fused[1] if b.dtype.kind == "f"],
              [b for b in book[1] if b.dtype.kind == "f"])
    for i, (g, e) in enumerate(zip(fused[0] + floats[0], book[0] + floats[1])):
        assert_close(g, e, "sum", f"array {i}, {devices} devices")
    whole = fused_run(dist_worker.bn_net, CPUS[:devices], 1)
    assert not np.allclose(fused[1][1], whole[1][1], rtol=1e-4), \
        "running variance should move per micro-batch, not per batch"


def test_sync_batch_norm_accumulates_alike_in_both_loops():
    """SyncBatchNorm: statistics over every replica of each micro-batch, in the fused step and
    in the book's loop under no_sync alike (parameters and running statistics)."""
    def net():
        return nn.SyncBatchNorm.convert_sync_batchnorm(dist_worker.bn_net())
    fused = fused_run(net, CPUS[:2], 2, steps=2)
    book = book_run(net, CPUS[:2], 2, steps=2)
    floats = ([b for b in fused[1] if b.dtype.kind == "f"],
              [b for b in book[1] if b.dtype.kind == "f"])
    for i, (g, e) in enumerate(zip(fused[0] + floats[0], book[0] + floats[1])):
        assert_close(g, e, "sum", f"array {i}")


def numpy_step(W, b, X, y, parts):
    """Float64: the mean cross-entropy's gradient of a linear model summed over micro-batches
    `parts` (row ranges), each scaled by its share, as accumulation computes it."""
    n = X.shape[0]
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for lo, hi in parts:
        z = X[lo:hi] @ W.T + b
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(hi - lo), y[lo:hi]] -= 1
        gW += p.T @ X[lo:hi] / n
        gb += p.sum(axis=0) / n
    return W - 0.5 * gW, b - 0.5 * gb


@pytest.mark.parametrize("devices", [1, 2])
def test_fused_accumulation_against_numpy_float64(devices):
    rng = np.random.default_rng(1)
    X = rng.standard_normal((22, 6))
    y = rng.integers(0, 4, size=22)
    mgpu.random.seed(2)
    net = nn.Sequential(nn.Linear(6, 4))
    W0, b0 = (p.numpy().astype(np.float64) for p in net.parameters())
    dp = nn.DataParallel(net, device_ids=CPUS[:devices])
    trainer = optim.SGD(net.parameters(), lr=0.5)
    dp.train_step(mgpu.array(X.astype(np.float32)), mgpu.array(y.astype(np.int32)),
                  nn.CrossEntropyLoss(), trainer, accumulate=4)
    W, b = numpy_step(W0, b0, X, y, [(0, 6), (6, 12), (12, 17), (17, 22)])
    assert_close(net[0].weight.numpy(), W, "sum", "W")
    assert_close(net[0].bias.numpy(), b, "sum", "b")


# --- no_sync in the book's loop -----------------------------------------------------------------

def grads_of(net):
    return [p.grad.numpy().copy() for p in net.parameters()]


def micro_grads(X, y, a, b, scale, devices):
    """The gradients of one micro-batch's scaled loss alone, from a fresh network."""
    ref = plain_net()
    (nn.CrossEntropyLoss()(nn.DataParallel(ref, device_ids=devices)(X[a:b]), y[a:b])
     * scale).backward()
    return grads_of(ref)


def test_no_sync_keeps_gradients_local_and_the_next_backward_sends_their_sum():
    Xn, yn = batches(1, n=16)[0]
    X, y = mgpu.array(Xn), mgpu.array(yn)
    loss = nn.CrossEntropyLoss()
    first = micro_grads(X, y, 0, 8, 0.5, CPUS[:2])
    second = micro_grads(X, y, 8, 16, 0.5, CPUS[:2])
    device0 = micro_grads(X, y, 0, 4, 0.25, CPUS[:1])  # cpu(0)'s shard of the first

    net = plain_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:2])
    with dp.no_sync():
        (loss(dp(X[0:8]), y[0:8]) * 0.5).backward()
    for i, (g, e) in enumerate(zip(grads_of(net), device0)):
        assert_close(g, e, "sum", f"param {i} after a no_sync backward: device 0's part only")
    (loss(dp(X[8:16]), y[8:16]) * 0.5).backward()
    for i, (g, a, b) in enumerate(zip(grads_of(net), first, second)):
        assert_close(g, a + b, "sum", f"param {i} after the synced backward: the whole sum")
    # The kept gradients were sent once: another backward adds only its own.
    (loss(dp(X[8:16]), y[8:16]) * 0.5).backward()
    for i, (g, a, b) in enumerate(zip(grads_of(net), first, second)):
        assert_close(g, a + 2 * b, "sum", f"param {i} after one more backward")


def test_zero_grad_drops_what_no_sync_kept():
    Xn, yn = batches(1, n=16)[0]
    X, y = mgpu.array(Xn), mgpu.array(yn)
    loss = nn.CrossEntropyLoss()
    net = plain_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:2])
    trainer = optim.SGD(net.parameters(), lr=0.1)
    with dp.no_sync():
        loss(dp(X[0:8]), y[0:8]).backward()
    trainer.zero_grad()  # the accumulation is abandoned
    loss(dp(X[8:16]), y[8:16]).backward()
    got = grads_of(net)
    ref = plain_net()
    loss(nn.DataParallel(ref, device_ids=CPUS[:2])(X[8:16]), y[8:16]).backward()
    for i, (g, e) in enumerate(zip(got, grads_of(ref))):
        assert_close(g, e, "sum", f"param {i}: only the last batch's gradients")
    with dp.no_sync():
        loss(dp(X[0:8]), y[0:8]).backward()
    dp.zero_grad()
    loss(dp(X[8:16]), y[8:16]).backward()
    for i, (g, e) in enumerate(zip(grads_of(net), grads_of(ref))):
        assert_close(g, e, "sum", f"param {i} after net.zero_grad()")


def to_backward_spans(tmp_path, fn):
    """How many gradient copies between devices (recorded copies' backward) fn's work made."""
    path = tmp_path / "trace.json"
    with mgpu.profile(str(path)):
        fn()
    events = json.loads(path.read_text())["traceEvents"]
    return sum(1 for e in events if e.get("name") == "to backward")


def test_micro_steps_under_no_sync_copy_no_gradient_between_devices(tmp_path):
    """Measured on the timeline: a backward under no_sync copies no parameter gradient to the
    master; the synced one copies one per parameter and other device, as a plain step does."""
    Xn, yn = batches(1, n=24)[0]
    X, y = mgpu.array(Xn), mgpu.array(yn)
    loss = nn.CrossEntropyLoss()
    net = plain_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:3])
    params = len(list(net.parameters()))

    def micro(a, b):
        return lambda: loss(dp(X[a:b]), y[a:b]).backward()

    with dp.no_sync():
        assert to_backward_spans(tmp_path, micro(0, 12)) == 0
        assert to_backward_spans(tmp_path, micro(12, 18)) == 0
    assert to_backward_spans(tmp_path, micro(18, 24)) == params * 2
    assert to_backward_spans(tmp_path, micro(0, 24)) == params * 2


# --- the fused step's micro-batches start no reduction (counted) --------------------------------

@pytest.mark.parametrize("shared", ["1", "0"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_micro_batches_start_no_reduction(monkeypatch, shared, optimizer):
    """Reductions per step (bucket all-reduces, or the CPU devices' shared update) and their
    bytes are the same with accumulate=4 as with 1."""
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", shared)
    counts = {}
    for k in (1, 4):
        net = dist_worker.bn_net()
        dp = nn.DataParallel(net, device_ids=CPUS[:2])
        trainer = (optim.SGD(net.parameters(), lr=0.1) if optimizer == "sgd"
                   else optim.AdamW(net.parameters(), lr=0.01))
        Xn, yn = batches(1)[0]
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer)  # warm
        mgpu.waitall()
        c0 = mgpu._core._collective_counts()
        for Xn, yn in batches(2):
            dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer,
                          accumulate=k)
        mgpu.waitall()
        c1 = mgpu._core._collective_counts()
        counts[k] = (c1[0] - c0[0], c1[1] - c0[1])
    assert counts[1][0] >= 2 and counts[1][1] > 0
    assert counts[4] == counts[1], f"accumulate=4 reduced {counts[4]}, one batch {counts[1]}"


# --- plumbing: train_concise, checkpoints, LeNet's train ---------------------------------------

@pytest.mark.parametrize("fused,kw", [(False, {}), (True, {}), (True, dict(deterministic=4))])
def test_train_concise_with_accumulation_resumes_bitwise(tmp_path, monkeypatch, fused, kw):
    ref = concise_run(tmp_path, None, fused=fused, accumulate=2, **kw)
    with pytest.raises(KeyboardInterrupt):
        concise_run(tmp_path, "c", crash_at=7, monkeypatch=monkeypatch, fused=fused, accumulate=2,
                    **kw)
    monkeypatch.undo()
    got = concise_run(tmp_path, "c", fused=fused, accumulate=2, **kw)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    from mgpu.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="accumulate=2"):
        concise_run(tmp_path, "c", fused=fused, accumulate=1, **kw)


def test_train_concise_book_loop_and_fused_accumulate_alike(tmp_path):
    book = concise_run(tmp_path, None, accumulate=3)
    fused = concise_run(tmp_path, None, fused=True, accumulate=3)
    for k in book:
        if not k.endswith("num_batches_tracked"):  # the fused step does not count it
            assert_close(fused[k], book[k], "sum", k)


def test_lenet_train_accumulates_in_the_fused_step():
    import ckpt_worker
    a = mgpu.train(1, ckpt_worker.BATCH, 0.3, 1, data=ckpt_worker.data(), progress=False,
                   deterministic=True, accumulate=4, seed=1)
    b = mgpu.train(1, ckpt_worker.BATCH, 0.3, 1, data=ckpt_worker.data(), progress=False,
                   deterministic=True, seed=1)
    assert a.test_acc == b.test_acc
    with pytest.raises(ValueError, match="op-by-op step takes the whole batch"):
        mgpu.chapter.train_op_by_op(1, ckpt_worker.BATCH, 0.3, 1, data=ckpt_worker.data(),
                                    progress=False, accumulate=2)


# --- bad values change nothing -------------------------------------------------------------------

@pytest.mark.parametrize("value,error,match", [
    (0, ValueError, "accumulate must be >= 1"), (-2, ValueError, "accumulate must be >= 1"),
    (1.5, TypeError, "accumulate .* must be an integer"), (True, TypeError, "must be an integer"),
    ("2", TypeError, "must be an integer"),
])
def test_bad_accumulate_is_refused_and_changes_nothing(value, error, match):
    net = dist_worker.bn_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:2])
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    before = [t.numpy().copy() for t in list(net.parameters()) + list(net.buffers())]
    Xn, yn = batches(1)[0]
    with pytest.raises(error, match=match):
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer,
                      accumulate=value)
    assert_bitwise([t.numpy() for t in list(net.parameters()) + list(net.buffers())], before,
                   "state after a refused step")
    with pytest.raises(error, match=match):
        mgpu.chapter.train_concise(dist_worker.bn_net(), 1, 8, 0.1, 1, data=([], []),
                                   accumulate=value)


def test_accumulate_that_does_not_divide_the_shards_names_the_values_that_work():
    net = dist_worker.bn_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:2])
    trainer = optim.SGD(net.parameters(), lr=0.1)
    before = [p.numpy().copy() for p in net.parameters()]
    Xn, yn = batches(1)[0]
    with pytest.raises(ValueError, match=r"accumulate=3 does not divide the 8 logical shards.*"
                                         r"\[1, 2, 4, 8\]"):
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer,
                      deterministic=True, accumulate=3)
    assert_bitwise([p.numpy() for p in net.parameters()], before, "parameters")
    with pytest.raises(ValueError, match="does not divide the 8 logical shards"):
        mgpu.train_batch(mgpu.array(np.zeros((8, 1, 28, 28), np.float32)),
                         mgpu.array(np.zeros(8, np.int32)),
                         [mgpu.get_params(mgpu.lenet_params(), CPUS[0])], CPUS[:1], 0.1,
                         deterministic=True, accumulate=3)
    with pytest.raises(ValueError, match="inside no_sync"):
        with dp.no_sync():
            dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer)


def test_engine_refuses_bad_accumulate_itself():
    """The C++ step checks too (a caller of mgpu._core.Model)."""
    net = dist_worker.bn_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:1])
    fused = dp._fused_model()
    Xn, yn = batches(1)[0]
    with pytest.raises(ValueError, match="accumulate must be >= 1"):
        fused.model._model.train_step(mgpu.array(Xn)._t, mgpu.array(yn)._t, 0.1, accumulate=0)
    with pytest.raises(ValueError, match="must divide the number of logical shards"):
        fused.model._model.train_step(mgpu.array(Xn)._t, mgpu.array(yn)._t, 0.1, shards=8,
                                      accumulate=3)


def test_cli_accumulate_reaches_both_loops(monkeypatch, capsys):
    import sys

    from mgpu.cli import main
    seen = {}
    monkeypatch.setattr(mgpu.chapter, "train_concise",
                        lambda *a, **kw: seen.setdefault("concise", kw))
    monkeypatch.setattr(sys.modules["mgpu.train"], "train",
                        lambda *a, **kw: seen.setdefault("lenet", kw))
    assert main(["train", "--model", "resnet18", "--accumulate", "4", "--epochs", "1"]) == 0
    assert main(["train", "--accumulate", "2", "--epochs", "1"]) == 0
    assert seen["concise"]["accumulate"] == 4 and seen["lenet"]["accumulate"] == 2
    monkeypatch.undo()
    assert main(["train", "--accumulate", "2", "--op-by-op", "--epochs", "1"]) == 2
    assert "op-by-op step takes the whole batch" in capsys.readouterr().err
    assert main(["train", "--accumulate", "0", "--epochs", "1"]) == 2
    assert "accumulate must be >= 1" in capsys.readouterr().err
