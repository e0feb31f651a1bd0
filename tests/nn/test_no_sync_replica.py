"""DataParallel.no_sync(): each replica but the master computes its shard with a leaf copy of the
master's parameters on its device, copied again only when the master may have changed. Writes to
the master between micro-batches and between steps (moves away and back with ``.to()``, in-place
edits, optimizer steps, writes through DLPack-shared memory) must reach that copy: two steps of
accumulated micro-batches on cpu(0) and cpu(1) give the gradients and parameters of the same
steps on cpu(0) alone (no batch norm, so the split changes nothing but float rounding)."""
import contextlib
import ctypes

import numpy as np
import pytest

import mgpu
from mgpu import nn

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)
LOSS = nn.CrossEntropyLoss()


def _net():
    mgpu.random.seed(3)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 5 * 5, 4))


def _batches():
    rng = np.random.default_rng(7)
    return [(mgpu.array(rng.normal(size=(6, 2, 5, 5)).astype(np.float32)),
             mgpu.array(rng.integers(0, 4, size=6))) for _ in range(6)]


def _first(module):
    return next(iter(module.parameters()))


def _two_steps(model, module, between_micro, before_update):
    """Two steps of three micro-batches each (two under no_sync when ``model`` is a
    DataParallel); ``between_micro`` runs between the first two, ``before_update`` between the
    last backward and the optimizer's step. The gradients of each step and the parameters."""
    trainer = mgpu.optim.SGD(module.parameters(), lr=0.2, momentum=0.5)
    batches, grads = _batches(), []
    for step in range(2):
        trainer.zero_grad()
        (X0, y0), (X1, y1), (X2, y2) = batches[3 * step:3 * step + 3]
        accumulate = model.no_sync() if isinstance(model, nn.DataParallel) \
            else contextlib.nullcontext()
        with accumulate:
            LOSS(model(X0), y0).backward()
            between_micro(model, module)
            LOSS(model(X1), y1).backward()
        LOSS(model(X2), y2).backward()
        before_update(model, module)
        grads.append([p.grad.numpy().copy() for p in module.parameters()])
        trainer.step()
    return grads, [p.numpy().copy() for p in module.parameters()]


def _nothing(model, module):
    pass


def _move_away_and_back(model, module):
    model.to(C1)
    model.to(C0)


def _move_then_edit(model, module):
    """A move gives the parameters new memory, whose version counts from 0 again: one edit
    brings a parameter's version back to the one its copy was made at."""
    _move_away_and_back(model, module)
    with mgpu.autograd.no_grad():
        _first(module).__imul__(0.5)


def _write_through_dlpack(model, module):
    """A consumer of the exported memory writes it (NumPy maps it read-only, so through its
    address): mgpu's version counter does not move."""
    a = np.from_dlpack(_first(module))
    view = np.ctypeslib.as_array(ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float)),
                                 a.shape)
    view *= 0.5


CASES = {
    # (between micro-batches, between the last backward and the update)
    "steady": (_nothing, _nothing),
    "move_between_micro_batches": (_move_away_and_back, _nothing),
    "move_and_edit_between_micro_batches": (_move_then_edit, _nothing),
    "move_before_the_update": (_nothing, _move_away_and_back),
    "dlpack_write_between_micro_batches": (_write_through_dlpack, _nothing),
    "dlpack_write_before_the_update": (_nothing, _write_through_dlpack),
}


def _check(make, between_micro, before_update):
    reference = make()
    want_grads, want = _two_steps(reference, reference, between_micro, before_update)
    module = make()
    dp = nn.DataParallel(module, device_ids=[C0, C1])
    grads, got = _two_steps(dp, module, between_micro, before_update)
    for step in range(2):
        for i, (g, w) in enumerate(zip(grads[step], want_grads[step])):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step}, gradient of parameter {i}")
    for i, (p, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(p, w, rtol=1e-5, atol=1e-6, err_msg=f"parameter {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_accumulated_micro_batches_see_every_write_to_the_master(case):
    _check(_net, *CASES[case])


def test_a_parameter_in_imported_memory_written_by_its_owner():
    """Memory mgpu imported through DLPack, written by its owner (NumPy) between micro-batches
    and before the update: mgpu sees no write."""
    owners = {}  # id(module) -> the NumPy array holding its first convolution's weight

    def make():
        net = _net()
        owner = net[0].weight.numpy().copy()
        net[0].weight = nn.Parameter(mgpu.from_dlpack(owner))
        owners[id(net)] = owner
        return net

    def write(model, module):
        mgpu.waitall()  # the owner writes only once the queued work that reads it has run
        owner = owners[id(module)]
        np.multiply(owner, 0.5, out=owner)

    _check(make, write, write)


def test_two_forwards_before_one_backward_with_exported_memory():
    """Memory shared through DLPack but not written: the copy a first forward's graph saved is
    still current at the second forward, so it is neither copied into (which would break that
    graph) nor stale."""
    def grads(make_model):
        module = _net()
        np.from_dlpack(_first(module))  # exported: another library could write it
        model = make_model(module)
        (X0, y0), (X1, y1), (X2, y2) = _batches()[:3]
        accumulate = model.no_sync() if model is not module else contextlib.nullcontext()
        with accumulate:
            (LOSS(model(X0), y0) + LOSS(model(X1), y1)).backward()
        LOSS(model(X2), y2).backward()
        return [p.grad.numpy() for p in module.parameters()]

    want = grads(lambda m: m)
    got = grads(lambda m: nn.DataParallel(m, device_ids=[C0, C1]))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"parameter {i}")


@pytest.mark.parametrize("exported", [False, True])
def test_a_current_copy_is_not_copied_again(monkeypatch, exported):
    """The steady state: micro-batches under no_sync with nothing written in between copy no
    parameter (memory shared through DLPack is compared, not copied)."""
    module = _net()
    if exported:
        np.from_dlpack(_first(module))
    dp = nn.DataParallel(module, device_ids=[C0, C1])
    (X0, y0), (X1, y1), (X2, y2) = _batches()[:3]
    params, copies = {id(p) for p in module.parameters()}, []
    real = mgpu.Tensor.copyto

    def copyto(t, dst):
        if id(t) in params:  # a master parameter copied to a replica
            copies.append(t)
        return real(t, dst)

    monkeypatch.setattr(mgpu.Tensor, "copyto", copyto)
    with dp.no_sync():
        LOSS(dp(X0), y0).backward()
        first = len(copies)
        LOSS(dp(X1), y1).backward()
        LOSS(dp(X2), y2).backward()
    assert first == len(params) and len(copies) == first
    with mgpu.autograd.no_grad():
        _first(module).__iadd__(0.0)  # a write, even of the same values: that one is copied
    with dp.no_sync():
        LOSS(dp(X0), y0).backward()
    assert len(copies) == first + 1


def test_a_parameter_replaced_between_micro_batches_keeps_the_others_gradients():
    """A new Parameter object changes the module tree, so the replicas are built again; the
    gradients no_sync kept on the old ones reach the master first, not lost with them."""
    def grads(dp_on):
        module = _net()
        model = nn.DataParallel(module, device_ids=[C0, C1]) if dp_on else module
        (X0, y0), (X1, y1), (X2, y2) = _batches()[:3]
        with model.no_sync() if dp_on else contextlib.nullcontext():
            LOSS(model(X0), y0).backward()
            module[3].bias = nn.Parameter(module[3].bias.detach().copyto(C0))
            LOSS(model(X1), y1).backward()
        LOSS(model(X2), y2).backward()
        return [p.grad.numpy() for p in module.parameters()]

    want, got = grads(False), grads(True)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"parameter {i}")
