"""bfloat16 mixed precision in the training steps: ``mgpu.autocast("bf16")`` in the book's loop
(conv2d, linear and mm run the bf16 products, forward and backward, and nothing else changes),
and ``DataParallel.train_step(..., precision="bf16")`` (the fused step's conv and linear layers),
which computes what the loop computes under autocast and, with ``deterministic``, the same bits
on any number of devices. The products' accuracy against float64 is tests/ops/test_bf16.py's."""
import threading

import numpy as np
import pytest

import mgpu
from mgpu import _core, nn
from test_data_parallel import LR, batch, close, tiny_net


def arr(a):
    return mgpu.array(np.asarray(a, np.float32))


def same(got, want, what):
    """Bitwise equality (a NaN equals itself, -0 differs from +0)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert got.tobytes() == want.tobytes(), f"{what}: largest difference " \
        f"{np.max(np.abs(got.astype(np.float64) - want)):.3g}"


def test_autocast_runs_conv_linear_and_mm_in_bf16_forward_and_backward():
    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(2, 3, 6, 6)), rng.normal(size=(4, 3, 3, 3)), rng.normal(size=4)
    xt, wt, bt = (arr(v).requires_grad_() for v in (x, w, b))
    with mgpu.autocast("bf16"):
        y = mgpu.conv2d(xt, wt, bt, padding=1)
    dy = rng.normal(size=y.shape).astype(np.float32)
    y.backward(arr(dy))  # after the block: the backward keeps the forward's precision
    raw = [arr(v)._t for v in (x, w, b, dy)]
    same(y.numpy(), mgpu.Tensor(_core.conv2d_forward(*raw[:3], 1, 1, "bf16")).numpy(), "conv y")
    dx, dw, db = (mgpu.Tensor(t).numpy() for t in
                  _core.conv2d_backward(raw[0], raw[1], raw[3], 1, 1, True, True, "bf16"))
    same(xt.grad.numpy(), dx, "conv dx")
    same(wt.grad.numpy(), dw, "conv dw")
    same(bt.grad.numpy(), db, "conv db")
    y32 = mgpu.conv2d(arr(x), arr(w), arr(b), padding=1).numpy()  # outside: float32 again
    assert not np.array_equal(y32, y.numpy())

    a, m = rng.normal(size=(5, 40)), rng.normal(size=(7, 40))
    at, mt = arr(a).requires_grad_(), arr(m).requires_grad_()
    with mgpu.autocast("bfloat16"):
        z = mgpu.ops.linear(at, mt)
        p = mgpu.mm(at, arr(m.T))
    dz = rng.normal(size=(5, 7)).astype(np.float32)
    z.backward(arr(dz))
    bf = lambda u, v, ta=False, tb=False: mgpu.Tensor(  # noqa: E731
        _core.mm(arr(u)._t, arr(v)._t, ta, tb, "bf16")).numpy()
    same(z.numpy(), bf(a, m, False, True), "linear y")
    same(p.numpy(), bf(a, m.T), "mm")
    same(at.grad.numpy(), bf(dz, m), "linear dx")
    same(mt.grad.numpy(), bf(dz, a, True, False), "linear dw")
    assert not np.array_equal(mgpu.ops.linear(arr(a), arr(m)).numpy(), z.numpy())

    # linear's bias gradient sums dy rounded to bfloat16 (the dy the products see), as conv's.
    bias = arr(rng.normal(size=7)).requires_grad_()
    with mgpu.autocast("bf16"):
        zb = mgpu.ops.linear(arr(a), arr(m), bias)
    zb.backward(arr(dz))
    rounded = mgpu.Tensor(_core.bf16_round(arr(dz)._t)).numpy()
    assert not np.array_equal(rounded, dz)
    same(bias.grad.numpy(), mgpu.Tensor(_core.sum_to_shape(arr(rounded)._t, [7])).numpy(),
         "linear db")
    np.testing.assert_allclose(bias.grad.numpy(), rounded.astype(np.float64).sum(axis=0),
                               rtol=1e-6, atol=1e-6)
    assert not np.array_equal(bias.grad.numpy(), dz.sum(axis=0))


def test_autocast_nests_is_per_thread_and_checks_its_dtype():
    assert mgpu.amp.get_precision() == "float32"
    seen = []
    with mgpu.autocast("bf16"):
        assert mgpu.amp.get_precision() == "bf16"
        with mgpu.autocast(enabled=False):
            assert mgpu.amp.get_precision() == "float32"
        assert mgpu.amp.get_precision() == "bf16"
        t = threading.Thread(target=lambda: seen.append(mgpu.amp.get_precision()))
        t.start()
        t.join()
    assert seen == ["float32"]
    assert mgpu.amp.get_precision() == "float32"

    @mgpu.autocast("bf16")
    def inside():
        return mgpu.amp.get_precision()
    assert inside() == "bf16" and mgpu.amp.get_precision() == "float32"
    with pytest.raises(ValueError, match="'float32' or 'bf16'"):
        mgpu.autocast("float16")


def books_loop_and_fused(k, precision):
    """One SGD step of tiny_net by the book's loop under autocast(precision) and by the fused
    step with precision, on k CPU devices; both networks' states."""
    devices = [mgpu.cpu(i) for i in range(k)]
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(n, device_ids=devices) for n in nets]
    trainers = [mgpu.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    loss = nn.CrossEntropyLoss()
    X, y = batch(8)
    Xt, yt = mgpu.array(X), mgpu.array(y)
    trainers[0].zero_grad()
    with mgpu.autocast(precision):
        book = loss(models[0](Xt), yt)
    book.backward()
    trainers[0].step()
    fused = models[1].train_step(Xt, yt, loss, trainers[1], precision=precision)
    close(fused.item(), book.item(), f"loss {precision} k={k}")
    return nets[0].state_dict(), nets[1].state_dict()


@pytest.mark.parametrize("algo", ["auto", "direct"])
@pytest.mark.parametrize("k", [1, 2])
def test_fused_bf16_step_computes_the_books_loop_under_autocast(k, algo, monkeypatch):
    """Bit for bit: the same ops in the same order, under auto (float32's kernels on rounded
    operands at these small convs) and under direct (the bfloat16 products)."""
    monkeypatch.setenv("MGPU_CONV_ALGO", algo)
    book, fused = books_loop_and_fused(k, "bf16")
    for name in book:
        if not name.endswith("num_batches_tracked"):
            b, f = book[name].numpy(), fused[name].numpy()
            assert b.tobytes() == f.tobytes(), (
                f"fused vs book bf16 ({algo}): {name} differs by up to "
                f"{np.max(np.abs(f.astype(np.float64) - b)):.3g}")
    # ... and bf16 took effect: float32's step lands elsewhere.
    _, fused32 = books_loop_and_fused(k, "float32")
    w = "0.weight"
    assert not np.array_equal(fused[w].numpy(), fused32[w].numpy())


def deterministic_steps(devices, precision="bf16"):
    """tiny_net's state after two deterministic (2 shards) fused steps on `devices`."""
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=devices)
    trainer = mgpu.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(2):
        X, y = batch(8, seed=step)
        model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(), trainer,
                         deterministic=2, precision=precision)
    return {n: t.numpy() for n, t in net.state_dict().items()}


def test_fused_bf16_deterministic_step_has_the_same_bits_on_one_and_two_devices():
    one, two = (deterministic_steps([mgpu.cpu(i) for i in range(k)]) for k in (1, 2))
    for name in one:
        same(two[name], one[name], f"{name}: 1 vs 2 devices")


def test_precision_is_checked_where_it_is_given():
    net = tiny_net()
    model = nn.DataParallel(net, device_ids=[mgpu.cpu(0)])
    X, y = batch(4)
    with pytest.raises(ValueError, match="train_step: precision"):
        model.train_step(mgpu.array(X), mgpu.array(y), nn.CrossEntropyLoss(),
                         mgpu.optim.SGD(model.parameters(), lr=LR), precision="half")
