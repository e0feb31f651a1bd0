"""The shared update of CPU replicas (comm/shared_update.h, driven by train/optimizer_step.cpp):
on k CPU devices of one process the fused step sums the gradients and updates every replica in
one collective after backward, device j taking chunk j of the flat parameters of every replica.
It must give what the bucketed all-reduce followed by per-replica updates gives
(MGPU_CPU_SHARED_UPDATE=0), bit for bit: every replica's parameters, momentum buffers and
batch-norm statistics, and the losses; and both
must match the float64 reference."""
import numpy as np
import pytest

import mgpu
from conftest import assert_close
from mgpu import nn
from mgpu.parallel import get_params, train_batch
from test_fused_step import make, problem, sgd_reference, wide_linear_problem


def _residual_steps(k, X, y, params, shared, monkeypatch, steps=3):
    """(losses per step, every replica's params, every replica's momentum) after `steps` steps."""
    monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "1" if shared else "0")
    devices = [mgpu.cpu(i) for i in range(k)]
    model, replicas = make(params, devices)
    losses = []
    for _ in range(steps):
        out = model.train_step(mgpu.array(X), mgpu.array(y), lr=0.1, momentum=0.9,
                               weight_decay=0.01)
        losses.append([t.item() for t in out])
    reps = [[p.numpy() for p in r] for r in replicas]
    bufs = [[b.numpy() for b in model._model.momentum_buffers(d)] for d in range(k)]
    return losses, reps, bufs


@pytest.mark.parametrize("k,n", [(2, 6), (3, 7), (3, 2)], ids=["2dev", "3dev_uneven", "3dev_empty"])
def test_shared_update_equals_bucketed_allreduce_bitwise(k, n, monkeypatch):
    """Uneven shards (7 over 3) and an empty one (2 examples over 3 devices) included."""
    X, y, params = problem(n)
    on = _residual_steps(k, X, y, params, True, monkeypatch)
    off = _residual_steps(k, X, y, params, False, monkeypatch)
    assert on[0] == off[0]
    for d in range(k):
        for i, (a, b, p0) in enumerate(zip(on[1][d], off[1][d], params)):
            assert not np.array_equal(a, p0), f"param {i} of replica {d} did not move"
            np.testing.assert_array_equal(a, b, err_msg=f"param {i} of replica {d}")
        for i, (a, b) in enumerate(zip(on[2][d], off[2][d])):
            np.testing.assert_array_equal(a, b, err_msg=f"momentum {i} of replica {d}")
    # And it is the right step: PyTorch's SGD on the mean loss, in float64.
    want, want_bufs = sgd_reference(X, y, params, 3, 0.1, 0.9, 0.01)
    for d in range(k):
        for i, (a, e) in enumerate(zip(on[1][d], want)):
            assert_close(a, e, "sum", f"param {i} of replica {d} against float64")
        for i, (a, e) in enumerate(zip(on[2][d], want_bufs)):
            assert_close(a, e, "sum", f"momentum {i} of replica {d} against float64")


def test_shared_update_of_wide_layers_spans_parameters_and_blocks(monkeypatch):
    """1.4 M parameters: device chunks cut through parameters, and each chunk runs in several
    16 K-element blocks, some of them short (a parameter's end)."""
    spec, params, X, y = wide_linear_problem()
    out = {}
    for shared in (True, False):
        monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "1" if shared else "0")
        model, reps = make(params, [mgpu.cpu(0), mgpu.cpu(1)], spec)
        for _ in range(2):
            model.train_step(mgpu.array(X), mgpu.array(y), lr=0.1, momentum=0.9)
        out[shared] = [[p.numpy() for p in r] for r in reps]
    for d in range(2):
        for i, (a, b) in enumerate(zip(out[True][d], out[False][d])):
            np.testing.assert_array_equal(a, b, err_msg=f"param {i} of replica {d}")


def test_shared_update_of_lenet_sum_rule_bitwise(monkeypatch):
    """The chapter's train_batch (p -= lr / N * g, no momentum) on 2 CPU devices."""
    from mgpu.models import lenet_params
    rng = np.random.default_rng(11)
    X = mgpu.array(rng.random((10, 1, 28, 28), dtype=np.float32))
    y = mgpu.array(rng.integers(0, 10, 10).astype(np.int64))
    out = {}
    for shared in (True, False):
        monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "1" if shared else "0")
        devices = [mgpu.cpu(0), mgpu.cpu(1)]
        dp = [get_params(lenet_params(seed=2), d) for d in devices]
        losses = [[t.item() for t in train_batch(X, y, dp, devices, 0.3)] for _ in range(2)]
        out[shared] = losses, [[p.numpy() for p in r] for r in dp]
    assert out[True][0] == out[False][0]
    for d in range(2):
        for i, (a, b) in enumerate(zip(out[True][1][d], out[False][1][d])):
            np.testing.assert_array_equal(a, b, err_msg=f"param {i} of replica {d}")


def test_shared_update_with_batch_norm_via_data_parallel_bitwise(monkeypatch):
    """nn.DataParallel.train_step of a conv + batch norm net: every replica's parameters and
    running statistics, the master's state dict and the losses."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(6, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=6)
    out = {}
    for shared in (True, False):
        monkeypatch.setenv("MGPU_CPU_SHARED_UPDATE", "1" if shared else "0")
        mgpu.random.seed(4)
        net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                            nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(3, 4))
        model = nn.DataParallel(net, device_ids=[mgpu.cpu(0), mgpu.cpu(1)])
        trainer = mgpu.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        loss = nn.CrossEntropyLoss()
        losses = [model.train_step(mgpu.array(X), mgpu.array(y), loss, trainer).item()
                  for _ in range(3)]
        fused = model._fused
        reps = [[t.numpy() for t in fused.replica_params[d] + fused.replica_buffers[d]]
                for d in range(2)]
        out[shared] = losses, reps, {k: v.numpy() for k, v in net.state_dict().items()}
    assert out[True][0] == out[False][0]
    for d in range(2):
        for i, (a, b) in enumerate(zip(out[True][1][d], out[False][1][d])):
            np.testing.assert_array_equal(a, b, err_msg=f"state {i} of replica {d}")
    for k in out[True][2]:
        np.testing.assert_array_equal(out[True][2][k], out[False][2][k], err_msg=k)
