"""DataParallel's fused step copies a master parameter into the other replicas only when it may
have changed since the last fused step (its version moved, or another library may write its
memory). Each way of writing a master parameter is tried between two fused steps, and the second
step must give the bits of a fresh network started from the written state: a replica left stale
computes its shard's gradients from old weights, and the bits differ."""
import ctypes

import numpy as np
import pytest

import mgpu
from mgpu import nn
from test_data_parallel import batch, tiny_net

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)
LOSS = nn.CrossEntropyLoss()


def _data():
    Xn, yn = batch(8)
    return mgpu.array(Xn), mgpu.array(yn)


def _fused(net, X, y):
    net.train_step(X, y, LOSS, mgpu.optim.SGD(net.parameters(), lr=0.1))


def _host(net):
    return {k: v.numpy().copy() for k, v in net.module.state_dict().items()}


def _first(net):
    return next(iter(net.parameters()))


def _book_step(optimizer):
    def write(net, X, y):
        trainer = optimizer(net.parameters())
        trainer.zero_grad()
        LOSS(net(X), y).backward()
        trainer.step()
    return write


def _load_state_dict(net, X, y):
    state = {k: v + 0.01 for k, v in _host(net).items() if not k.endswith("num_batches_tracked")}
    net.module.load_state_dict(state, strict=False)


def _in_place(op):
    def write(net, X, y):
        with mgpu.autograd.no_grad():
            op(_first(net))
    return write


def _set_item(p):
    p[:] = p.numpy() * 0.5


def _copy_into(p):
    (p * 0.5).copyto(p)


def _init(net, X, y):
    nn.init.normal_(_first(net), std=0.1)


def _allreduce(net, X, y):
    p = _first(net)
    mgpu.allreduce([p, p.copyto(C1)])  # the master's p doubled in place


def _dlpack_export(net, X, y):
    """A consumer writing through the exported memory (as torch.from_dlpack's tensor can; NumPy
    maps it read-only, so the write goes through its address)."""
    a = np.from_dlpack(_first(net))
    view = np.ctypeslib.as_array(ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float)),
                                 a.shape)
    view *= 0.5


WRITERS = {
    "sgd_step": _book_step(lambda ps: mgpu.optim.SGD(ps, lr=0.05)),
    "adam_step": _book_step(lambda ps: mgpu.optim.Adam(ps, lr=0.01)),
    "load_state_dict": _load_state_dict,
    "iadd": _in_place(lambda p: p.__iadd__(0.01)),
    "imul": _in_place(lambda p: p.__imul__(0.5)),
    "setitem": _in_place(_set_item),
    "zero_": _in_place(lambda p: p.zero_()),
    "fill_": _in_place(lambda p: p.fill_(0.25)),
    "copyto": _in_place(_copy_into),
    "nn_init": _init,
    "allreduce": _allreduce,
    "dlpack_export": _dlpack_export,
}


def _check_reaches_replicas(net, write, X, y):
    _fused(net, X, y)  # the replicas equal the master, their versions noted
    before = _host(net)
    write(net, X, y)
    written = _host(net)
    assert any(not np.array_equal(written[k], before[k]) for k in before), "nothing was written"
    _fused(net, X, y)
    fresh = nn.DataParallel(tiny_net(), device_ids=[C0, C1])
    fresh.module.load_state_dict(written)
    _fused(fresh, X, y)
    got, want = _host(net), _host(fresh)
    for k in want:
        assert np.array_equal(got[k], want[k]), f"{k}: a replica missed the write"


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_to_a_master_parameter_reaches_every_replica(writer):
    X, y = _data()
    net = nn.DataParallel(tiny_net(), device_ids=[C0, C1])
    _check_reaches_replicas(net, WRITERS[writer], X, y)


def test_a_parameter_in_imported_memory_is_copied_at_every_step():
    """The owner of memory mgpu imported through DLPack writes it without mgpu knowing."""
    X, y = _data()
    module = tiny_net()
    conv = module[0]
    owner = conv.weight.numpy().copy()
    conv.weight = nn.Parameter(mgpu.from_dlpack(owner))
    net = nn.DataParallel(module, device_ids=[C0, C1])

    def write(net, X, y):
        np.multiply(owner, 0.5, out=owner)  # in NumPy: mgpu's version counter stays

    _check_reaches_replicas(net, write, X, y)


def test_steady_fused_steps_copy_no_parameter(monkeypatch):
    """Between fused steps that nothing else touches, the replicas are current: no copies."""
    X, y = _data()
    net = nn.DataParallel(tiny_net(), device_ids=[C0, C1])
    trainer = mgpu.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.train_step(X, y, LOSS, trainer)
    copies = []
    real = mgpu._core.copy
    monkeypatch.setattr(mgpu._core, "copy", lambda dst, src: (copies.append(dst), real(dst, src)))
    net.train_step(X, y, LOSS, trainer)
    net.train_step(X, y, LOSS, trainer)
    assert copies == []
    with mgpu.autograd.no_grad():
        _first(net).__iadd__(0.0)  # a write, even of the same values: one parameter is copied
    net.train_step(X, y, LOSS, trainer)
    assert len(copies) == 1
