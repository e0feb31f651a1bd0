"""The concise chapter's fused step (sec. 12.6) beyond plain BatchNorm: synchronised batch norm
inside the C++ step (k devices equal one device on the whole batch, against float64 and against
the book's loop), on CPU devices and emulated GPUs."""
import numpy as np
import pytest

import mgpu
import nn_reference as nref
from mgpu import nn
from test_data_parallel import (
    EPS,
    LR,
    MOMENTUM,
    batch,
    check_updated_state,
    close,
    fused_equals_books_loop,
    host_state,
    tiny_net,
)


def fused_step_and_check(net, devices, X, y, label):
    """One fused step (plain SGD) against the float64 reference on the whole batch."""
    P = host_state(net)
    loss_ref, _, new_ref, running_ref = nref.tiny_step(X, y, P, [len(y)], LR, MOMENTUM, EPS)
    model = nn.DataParallel(net, device_ids=devices)
    trainer = mgpu.optim.SGD(model.parameters(), lr=LR)
    Xt, yt = mgpu.array(X, device=devices[0]), mgpu.array(y, device=devices[0])
    loss = model.train_step(Xt, yt, nn.CrossEntropyLoss(), trainer)
    close(loss.item(), loss_ref, f"loss {label}")
    check_updated_state(net, new_ref, running_ref, label)
    fused = model._fused
    for r in range(1, len(devices)):  # every replica keeps the same running statistics
        for a, b in zip(fused.model._model.buffers(r), fused.model._model.buffers(0)):
            np.testing.assert_array_equal(mgpu.Tensor(a).numpy(), mgpu.Tensor(b).numpy())
    return model


@pytest.mark.parametrize("k", [1, 2, 3])
def test_fused_sync_batch_norm_equals_one_device_on_the_whole_batch(k):
    net = tiny_net(sync=True)
    X, y = batch(7)
    fused_step_and_check(net, [mgpu.cpu(i) for i in range(k)], X, y, f"fused sync k={k}")


def test_fused_per_replica_batch_norm_differs_from_the_whole_batch():
    # The same data without SyncBatchNorm must not meet the whole-batch reference: the check
    # above would pass vacuously if the fused step ignored the sync option and k=1 were used.
    net = tiny_net()
    X, y = batch(7)
    with pytest.raises(AssertionError):
        fused_step_and_check(net, [mgpu.cpu(0), mgpu.cpu(1)], X, y, "per replica")


def test_fused_sync_batch_norm_with_an_empty_replica():
    # Two examples on three devices: the third replica has no rows but joins every exchange.
    net = tiny_net(sync=True)
    X, y = batch(2)
    fused_step_and_check(net, [mgpu.cpu(i) for i in range(3)], X, y, "batch 2 on 3 devices")


@pytest.mark.parametrize("k", [2, 3])
def test_fused_sync_batch_norm_equals_the_books_loop(k):
    """SyncBatchNorm through autograd (the book's loop) and inside the fused step agree."""
    fused_equals_books_loop(k, sync=True)


def test_fused_sync_layer_spec_on_one_device_is_plain_batch_norm_bitwise():
    # With one replica a synchronised layer is a plain one: the same bits, not just close.
    X, y = batch(6)
    nets = [tiny_net(sync=True), tiny_net()]
    for n in nets:
        model = nn.DataParallel(n, device_ids=[mgpu.cpu(0)])
        model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(),
                         mgpu.optim.SGD(n.parameters(), lr=LR))
    for (name, a), b in zip(nets[0].state_dict().items(), nets[1].state_dict().values()):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2])
def test_fused_sync_batch_norm_on_emulated_gpus(k):
    if mgpu.num_gpus() < k:
        pytest.skip(f"needs {k} GPUs (emulated build), this build has {mgpu.num_gpus()}")
    net = tiny_net(sync=True)
    X, y = batch(5)
    fused_step_and_check(net, [mgpu.gpu(i) for i in range(k)], X, y, f"gpu fused sync k={k}")


# --- optimizer state: SGD.state_dict / load_state_dict and the fused step's momentum -------------

def _trained_pair(k=2):
    """Two equal tiny nets under DataParallel on k CPU devices, each with its SGD (momentum,
    weight decay)."""
    devices = [mgpu.cpu(i) for i in range(k)]
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(n, device_ids=devices) for n in nets]
    trainers = [mgpu.optim.SGD(m.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
                for m in models]
    return nets, models, trainers


def _book_step(model, trainer, X, y):
    trainer.zero_grad()
    out = nn.CrossEntropyLoss()(model(mgpu.array(X)), mgpu.array(y))
    out.backward()
    trainer.step()


def _assert_same_state(a, b, label):
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        if not name.endswith("num_batches_tracked"):
            close(sa[name].numpy(), sb[name].numpy(), f"{label}: {name}")


@pytest.mark.parametrize("order", ["book, fused, book, fused", "fused, book, fused, book"])
def test_switching_between_the_books_loop_and_the_fused_step_keeps_momentum(order):
    nets, models, trainers = _trained_pair()
    loss = nn.CrossEntropyLoss()
    for step, kind in enumerate(order.split(", ")):
        X, y = batch(8, seed=step)
        _book_step(models[0], trainers[0], X, y)
        if kind == "book":
            _book_step(models[1], trainers[1], X, y)
        else:
            models[1].train_step(mgpu.array(X), mgpu.array(y), loss, trainers[1])
        _assert_same_state(nets[1], nets[0], f"after step {step} ({kind})")
    # The trainer's state holds the momentum the fused step computed.
    sa, sb = trainers[0].state_dict(), trainers[1].state_dict()
    assert sorted(sa["state"]) == sorted(sb["state"]) == list(range(len(trainers[0].params)))
    for i in sa["state"]:
        close(sb["state"][i]["momentum_buffer"].numpy(), sa["state"][i]["momentum_buffer"].numpy(),
              f"momentum buffer {i}")


def test_fused_momentum_survives_save_and_load_into_a_new_optimizer():
    nets, models, trainers = _trained_pair()
    loss = nn.CrossEntropyLoss()
    X, y = batch(8, seed=0)
    for m, t in zip(models, trainers):
        m.train_step(mgpu.array(X), mgpu.array(y), loss, t)
    saved = trainers[1].state_dict()
    # Plain contents: ints, floats, bools, lists and tensors (what a checkpoint writes).
    assert set(saved) == {"state", "param_groups"}
    assert all(isinstance(v["momentum_buffer"], mgpu.Tensor) for v in saved["state"].values())
    snapshot = {i: v["momentum_buffer"].numpy().copy() for i, v in saved["state"].items()}
    fresh = mgpu.optim.SGD(models[1].parameters(), lr=1.0)
    fresh.load_state_dict(saved)
    assert fresh.lr == LR and fresh.momentum == 0.9 and fresh.weight_decay == 1e-3
    # Loaded as copies (as PyTorch does): clearing what was saved leaves them as they were.
    for v in saved["state"].values():
        v["momentum_buffer"] *= 0.0
    for i, b in fresh.state_dict()["state"].items():
        np.testing.assert_array_equal(b["momentum_buffer"].numpy(), snapshot[i])
    X, y = batch(8, seed=1)
    models[0].train_step(mgpu.array(X), mgpu.array(y), loss, trainers[0])
    models[1].train_step(mgpu.array(X), mgpu.array(y), loss, fresh)
    _assert_same_state(nets[1], nets[0], "after load")


def test_a_fresh_optimizer_restarts_the_fused_momentum():
    # PyTorch semantics: a new SGD has no momentum; the fused step must not reuse the old one.
    nets, models, trainers = _trained_pair(k=1)
    loss = nn.CrossEntropyLoss()
    X0, y0 = batch(8, seed=0)
    X1, y1 = batch(8, seed=1)
    models[1].train_step(mgpu.array(X0), mgpu.array(y0), loss, trainers[1])
    _book_step(models[0], trainers[0], X0, y0)
    again = [mgpu.optim.SGD(m.parameters(), lr=LR, momentum=0.9, weight_decay=1e-3)
             for m in models]
    _book_step(models[0], again[0], X1, y1)
    models[1].train_step(mgpu.array(X1), mgpu.array(y1), loss, again[1])
    _assert_same_state(nets[1], nets[0], "fresh optimizer")


def test_fused_model_momentum_buffers_are_readable_and_settable():
    from mgpu.parallel import FusedModel  # noqa: F401  (the API under test)
    nets, models, trainers = _trained_pair(k=2)
    X, y = batch(8)
    models[1].train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), trainers[1])
    fused = models[1]._fused.model
    bufs = fused.momentum_buffers(1)
    assert [b.shape for b in bufs] == [p.shape for p in nets[1].parameters()]
    target = [mgpu.array(np.full(b.shape, i, np.float32)) for i, b in enumerate(bufs)]
    fused.set_momentum_buffers(target, 1)
    for i, b in enumerate(fused.momentum_buffers(1)):
        np.testing.assert_array_equal(b.numpy(), np.full(b.shape, i, np.float32))
    with pytest.raises(ValueError, match="has shape"):
        fused.set_momentum_buffers([mgpu.ones((3,))] + target[1:], 1)
    with pytest.raises(ValueError, match="parameters, got"):
        fused.set_momentum_buffers(target[:-1], 1)
    with pytest.raises(TypeError, match="expected an mgpu tensor or None"):
        fused.set_momentum_buffers([np.ones(3)] + target[1:], 1)
    for i, b in enumerate(fused.momentum_buffers(1)):  # the failed calls changed nothing
        np.testing.assert_array_equal(b.numpy(), np.full(b.shape, i, np.float32))


def test_sgd_load_state_dict_rejects_bad_entries_and_changes_nothing():
    net = tiny_net()
    params = list(net.parameters())
    trainer = mgpu.optim.SGD(params, lr=0.1, momentum=0.9)
    X, y = batch(8)
    _book_step(net, trainer, X, y)
    good = trainer.state_dict()
    before = {i: b.numpy().copy() for i, b in trainer._buffers.items()}

    def variant(edit):
        sd = {"state": {i: dict(v) for i, v in good["state"].items()},
              "param_groups": [dict(good["param_groups"][0])]}
        edit(sd)
        return sd

    cases = [
        (lambda sd: sd.pop("state"), ValueError, "no 'state'"),
        (lambda sd: sd["param_groups"][0].pop("lr"), ValueError, "no 'lr'"),
        (lambda sd: sd["param_groups"][0].__setitem__("params", [0, 1]), ValueError,
         "is for 2 parameters"),
        (lambda sd: sd["state"].__setitem__(99, {"momentum_buffer": mgpu.ones((3,))}),
         ValueError, "not a parameter position"),
        (lambda sd: sd["state"][0].__setitem__("momentum_buffer", mgpu.ones((1, 2))),
         ValueError, "has shape"),
        (lambda sd: sd["state"][1].pop("momentum_buffer"), ValueError, "momentum_buffer"),
        (lambda sd: sd["state"][1].__setitem__("momentum_buffer", [1.0]), TypeError,
         "expected an mgpu tensor"),
        (lambda sd: sd["param_groups"][0].__setitem__("momentum", -1.0), ValueError,
         "momentum must be"),
    ]
    for edit, error, match in cases:
        with pytest.raises(error, match=match):
            trainer.load_state_dict(variant(edit))
        assert trainer.lr == 0.1 and trainer.momentum == 0.9
        assert sorted(trainer._buffers) == sorted(before)
        for i, b in trainer._buffers.items():
            np.testing.assert_array_equal(b.numpy(), before[i])
    with pytest.raises(TypeError, match="expected a dict"):
        trainer.load_state_dict([1, 2])


# --- memory: the steady state allocates nothing ---------------------------------------------------

@pytest.mark.parametrize("k,sync", [(1, False), (2, False), (2, True)])
def test_steady_state_fused_steps_take_no_new_memory_from_the_system(k, sync):
    """Steps 3..6 (each awaited) reuse the CPU allocator's blocks: no block and no byte comes
    from the system, whatever order the device threads release their tensors in (the timing
    differs from run to run; the step reserves a block for each its first step took)."""
    net = tiny_net(sync=sync)
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss = nn.CrossEntropyLoss()
    X, y = batch(8)
    Xt, yt = mgpu.array(X), mgpu.array(y)
    for _ in range(2):
        model.train_step(Xt, yt, loss, trainer).item()
        mgpu.waitall()
    before = mgpu.cpu_memory_stats()
    for _ in range(4):
        model.train_step(Xt, yt, loss, trainer).item()
        mgpu.waitall()
    after = mgpu.cpu_memory_stats()
    assert after["system_mallocs"] == before["system_mallocs"], (before, after)
    assert after["system_bytes"] == before["system_bytes"]
    assert after["peak_allocated"] >= after["allocated"] > 0


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("wait", [True, False])
def test_steady_state_steps_allocate_nothing_with_or_without_waiting(k, wait):
    """The residual net's steps 4..9 take no block from the system, whether the loop waits after
    each step or runs ahead (the loss never read), on 1 and 2 CPU devices: every step finds a
    cached block for each request, the allocator's count says so (not a timing)."""
    net = tiny_net(seed=3)
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(i) for i in range(k)])
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loss = nn.CrossEntropyLoss()
    X, y = batch(12)
    Xt, yt = mgpu.array(X), mgpu.array(y)

    def steps(n):
        for _ in range(n):
            out = model.train_step(Xt, yt, loss, trainer)
            if wait:
                mgpu.waitall()
        return out

    steps(3)
    mgpu.waitall()
    before = mgpu.cpu_memory_stats()
    out = steps(6)
    mgpu.waitall()
    after = mgpu.cpu_memory_stats()
    assert np.isfinite(out.item())
    assert after["system_mallocs"] == before["system_mallocs"], (before, after)
    assert after["system_bytes"] == before["system_bytes"]


def test_cpu_memory_stats_count_system_blocks_and_the_peak():
    mgpu.waitall()
    mgpu.empty_cache()
    s0 = mgpu.cpu_memory_stats()
    a = mgpu.zeros((1000, 1000))  # 4 MB: a new block from the system
    a.numpy()
    s1 = mgpu.cpu_memory_stats()
    assert s1["system_mallocs"] == s0["system_mallocs"] + 1
    assert s1["system_bytes"] >= s0["system_bytes"] + 4_000_000
    assert s1["allocated"] >= s0["allocated"] + 4_000_000
    assert s1["peak_allocated"] >= s1["allocated"]
    del a
    mgpu.waitall()
    s2 = mgpu.cpu_memory_stats()
    assert s2["allocated"] <= s1["allocated"] - 4_000_000 and s2["cached"] >= 4_000_000
    b = mgpu.zeros((1000, 1000))  # the cached block again: nothing new from the system
    b.numpy()
    assert mgpu.cpu_memory_stats()["system_mallocs"] == s1["system_mallocs"]


_ARENA_SCRIPT = r"""
import numpy as np
import mgpu

MiB = 1 << 20
stats = mgpu.cpu_memory_stats
mgpu.waitall()
s0 = stats()
# Two 32 MiB blocks fill the first 64 MiB segment exactly; released, they merge, and a 64 MiB
# block fits the merged chunk: no second segment from the system.
a = mgpu.full((8 * MiB,), 1.0)
b = mgpu.full((8 * MiB,), 2.0)
mgpu.waitall()
s1 = stats()
assert s1["system_mallocs"] == s0["system_mallocs"] + 1, (s0, s1)
assert s1["allocated"] == s0["allocated"] + 64 * MiB, (s0, s1)
del a, b
mgpu.waitall()
s2 = stats()
assert s2["allocated"] == s0["allocated"] and s2["cached"] == s1["cached"] + 64 * MiB, (s1, s2)
c = mgpu.full((16 * MiB,), 3.0)
mgpu.waitall()
assert stats()["system_mallocs"] == s1["system_mallocs"], (s1, stats())
del c
# Blocks of many sizes, released at random and made again: each keeps its own value (no two
# live blocks overlap), and the counters add up.
rng = np.random.default_rng(0)
live = {}
for i in range(300):
    if live and rng.random() < 0.45:
        del live[list(live)[rng.integers(len(live))]]
    else:
        n = int(rng.integers(MiB // 4 + 1, 6 * MiB))  # 1 MiB to 24 MiB of float32
        live[i] = (mgpu.full((n,), float(i)), n)
    if i % 50 == 49:
        for k, (t, n) in live.items():
            v = t.numpy()
            assert v.shape == (n,) and v[0] == k and v[-1] == k and (v == k).all(), k
        del t, v
mgpu.waitall()
held = sum((4 * n + 65535) // 65536 * 65536 for _, n in live.values())
assert stats()["allocated"] == s0["allocated"] + held, (stats(), held)
live.clear()
mgpu.waitall()
mgpu.empty_cache()
assert stats()["allocated"] == s0["allocated"] and stats()["cached"] == 0, (s0, stats())
print("ok")
"""


def test_large_blocks_come_from_an_arena_that_merges_free_neighbours():
    """Blocks over 1 MiB are cut best-fit from arena segments and merge with free neighbours when
    released (two 32 MiB blocks freed make room for a 64 MiB one without a new segment); blocks
    of random sizes made and released at random never overlap (each keeps its value); the counters
    add up and empty_cache gives every free segment back. In its own process, so the arena starts
    empty."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _ARENA_SCRIPT], capture_output=True, text=True,
                       env=dict(os.environ, MGPU_EMULATED_GPUS="0"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# --- bad input to the fused step: a clear exception, nothing changed -----------------------------

def _state(net):
    return {k: v.numpy().copy() for k, v in net.state_dict().items()}


def _unchanged(net, before):
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k], err_msg=k)


@pytest.mark.parametrize("sync", [False, True])
def test_fused_step_bad_inputs_raise_and_change_nothing(sync):
    net = tiny_net(sync=sync)
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = nn.CrossEntropyLoss()
    before = _state(net)
    y = mgpu.array(np.arange(4) % 5)
    with pytest.raises(ValueError, match="channels"):
        model.train_step(mgpu.ones((4, 3, 6, 6)), y, loss, trainer)
    _unchanged(net, before)
    with pytest.raises(ValueError, match="same number of examples"):
        model.train_step(mgpu.ones((4, 2, 6, 6)), mgpu.array(np.arange(3) % 5), loss, trainer)
    _unchanged(net, before)
    with pytest.raises(TypeError):
        model.train_step(np.ones((4, 2, 6, 6), np.float32), y, loss, trainer)
    _unchanged(net, before)
    assert trainer.state_dict()["state"] == {}


def test_fused_step_input_too_small_fails_after_a_batch_norm_and_changes_nothing():
    # The pooling window (4) is larger than the 3x3 image, after a BatchNorm that has already
    # computed its statistics: its running statistics must not move.
    mgpu.random.seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(),
                        nn.AvgPool2d(4), nn.Flatten(), nn.Linear(2, 3))
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    trainer = mgpu.optim.SGD(model.parameters(), lr=0.1)
    before = _state(net)
    with pytest.raises(ValueError, match="avg_pool2d"):
        model.train_step(mgpu.ones((4, 1, 3, 3)), mgpu.array(np.arange(4) % 3),
                         nn.CrossEntropyLoss(), trainer)
    _unchanged(net, before)
    # A batch norm with one value per channel over all replicas (synchronised): the same.
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Flatten(),
                      nn.Linear(2, 3)))
    model = nn.DataParallel(sync, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
    before = _state(sync)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model.train_step(mgpu.ones((1, 1, 1, 1)), mgpu.array([0]), nn.CrossEntropyLoss(),
                         mgpu.optim.SGD(model.parameters(), lr=0.1))
    _unchanged(sync, before)
