"""bfloat16 products on emulated GPUs (cpp/ops/bf16_gpu.h): mm and conv2d's three passes with
precision="bf16" run our CUDA kernels, which sum in the CPU's order, so they give the CPU
kernels' bits; against NumPy float64 they keep tests/ops/test_bf16.py's bound (bfloat16's 8-bit
significand). The CPU's side runs MGPU_CONV_ALGO=direct, its bfloat16 products: auto runs
float32's kernels on rounded operands at most shapes (bf16.h), another order of sums. The book's
loop under ``mgpu.autocast("bf16")`` and the fused step with
``precision="bf16"`` run on GPUs too, and the deterministic fused step gives the same bits on 1
and 2 GPUs."""
import numpy as np
import pytest

import ckpt_worker
import mgpu
import reference as ref
from mgpu import _core, nn
from test_bf16 import U, bf16_numpy, check_bounds, gamma
from test_bf16_step import deterministic_steps
from test_data_parallel import LR, batch, close, tiny_net

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(mgpu.num_gpus() == 0, reason="needs GPUs (emulated or real)")]


def on(device, a):
    return mgpu.array(np.ascontiguousarray(a, np.float32), device=device)._t


def numpy_of(t):
    return mgpu.Tensor(t).numpy()


def same(got, want, what):
    """Bitwise equality (-0 differs from +0)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    diff = got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8)
    assert not diff.any(), (f"{what}: bytes differ, largest difference "
                            f"{np.max(np.abs(got.astype(np.float64) - want)):.3g}")


def test_round_on_a_gpu_is_the_cpus():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(3000) * np.exp2(rng.integers(-40, 40, 3000))).astype(np.float32)
    x = np.concatenate([x, np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 2.0 ** -130, -2.0 ** -140,
                                     -0.0, np.inf, -np.inf], np.float32)])
    got = numpy_of(_core.bf16_round(on(mgpu.gpu(0), x)))
    same(got, numpy_of(_core.bf16_round(on(mgpu.cpu(0), x))), "bf16_round gpu vs cpu")
    same(got[:-2], bf16_numpy(x[:-2]), "bf16_round gpu vs NumPy")  # bf16_numpy: finite only
    assert got[-2] == np.inf and got[-1] == -np.inf


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_mm_bf16_on_a_gpu_is_the_cpus_bits_and_within_the_bound(trans_a, trans_b):
    rng = np.random.default_rng(1)
    m, k, n = 13, 45, 11  # odd k: the last pair is padded
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a_in = np.ascontiguousarray(a.T) if trans_a else a
    b_in = np.ascontiguousarray(b.T) if trans_b else b
    got = numpy_of(_core.mm(on(mgpu.gpu(0), a_in), on(mgpu.gpu(0), b_in), trans_a, trans_b,
                            precision="bf16"))
    cpu = numpy_of(_core.mm(on(mgpu.cpu(0), a_in), on(mgpu.cpu(0), b_in), trans_a, trans_b,
                            precision="bf16"))
    same(got, cpu, "mm gpu vs cpu")
    ar, br = bf16_numpy(a).astype(np.float64), bf16_numpy(b).astype(np.float64)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    check_bounds(got, a64 @ b64, ar @ br, np.abs(a64) @ np.abs(b64), np.abs(ar) @ np.abs(br), k,
                 "mm on a gpu")


CONVS = [
    pytest.param((3, 3, 7, 6), 5, 3, 1, 1, True, id="3x3-pad1-odd"),
    pytest.param((2, 4, 8, 8), 6, 3, 2, 1, True, id="3x3-stride2"),
    pytest.param((2, 5, 5, 5), 3, 1, 1, 0, False, id="1x1-no-bias"),
    # 11x11 outputs: chunks of 17 images, 2057 columns, so dw's pairs restart mid-batch.
    pytest.param((19, 1, 13, 13), 2, 3, 1, 0, True, id="chunked-dw"),
]


def conv_passes(device, x, w, b, dy, stride, pad):
    bt = on(device, b) if b is not None else None
    y = _core.conv2d_forward(on(device, x), on(device, w), bt, stride, pad, precision="bf16")
    g = _core.conv2d_backward(on(device, x), on(device, w), on(device, dy), stride, pad, True,
                              b is not None, precision="bf16")
    return [numpy_of(y)] + [numpy_of(t) for t in g if t is not None]


@pytest.mark.parametrize("xshape,K,R,stride,pad,bias", CONVS)
def test_conv2d_bf16_on_a_gpu_is_the_cpus_bits_and_within_the_bound(xshape, K, R, stride, pad,
                                                                     bias, monkeypatch):
    monkeypatch.setenv("MGPU_CONV_ALGO", "direct")
    rng = np.random.default_rng(3)
    N, C, H, W = xshape
    x = rng.standard_normal(xshape).astype(np.float32)
    w = rng.standard_normal((K, C, R, R)).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32) if bias else None
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - R) // stride + 1
    dy = rng.standard_normal((N, K, P, Q)).astype(np.float32)
    gpu = conv_passes(mgpu.gpu(0), x, w, b, dy, stride, pad)
    cpu = conv_passes(mgpu.cpu(0), x, w, b, dy, stride, pad)
    for name, g, c in zip(("y", "dx", "dw", "db"), gpu, cpu):
        same(g, c, f"{name} gpu vs cpu")
    y, dx, dw = gpu[:3]
    xr, wr, dyr = bf16_numpy(x), bf16_numpy(w), bf16_numpy(dy)
    ax, aw, ady = np.abs(x), np.abs(w), np.abs(dy)
    conv = lambda u, v: ref.conv2d_forward(u, v, None, stride, pad)  # noqa: E731
    back = lambda u, v, d: ref.conv2d_backward(u, v, d, stride, pad, False)  # noqa: E731
    bias64 = (b if bias else np.zeros(K, np.float32))[None, :, None, None].astype(np.float64)
    check_bounds(y, conv(x, w) + bias64, conv(xr, wr) + bias64, conv(ax, aw) + np.abs(bias64),
                 conv(np.abs(xr), np.abs(wr)) + np.abs(bias64), C * R * R + 1, "y on a gpu")
    dx64, dw64, _ = back(x, w, dy)
    dxr, dwr, _ = back(xr, wr, dyr)
    adx, adw, _ = back(ax, aw, ady)
    adxr, adwr, _ = back(np.abs(xr), np.abs(wr), np.abs(dyr))
    check_bounds(dx, dx64, dxr, adx, adxr, K * R * R + R * R, "dx on a gpu")
    if N * P * Q < 1000:
        check_bounds(dw, dw64, dwr, adw, adwr, N * P * Q + N, "dw on a gpu")
    else:  # float32's own g_k is as large as bfloat16's error: the bound alone
        k = N * P * Q + N
        bound = ((2 * U + U * U) * (1 + gamma(k)) + gamma(k)) * adw
        assert np.all(np.abs(dw - dw64) <= bound), "dw on a gpu: above the bfloat16 bound"


def test_autocast_on_a_gpu_runs_the_bf16_products(monkeypatch):
    monkeypatch.setenv("MGPU_CONV_ALGO", "direct")
    rng = np.random.default_rng(4)
    x, w, b = rng.normal(size=(2, 3, 6, 6)), rng.normal(size=(4, 3, 3, 3)), rng.normal(size=4)
    g = mgpu.gpu(0)
    xt, wt, bt = (mgpu.array(np.asarray(a, np.float32), device=g) for a in (x, w, b))
    xt.attach_grad()
    wt.attach_grad()
    with mgpu.autocast("bf16"):
        y = mgpu.conv2d(xt, wt, bt, padding=1)
    y.sum().backward()
    cpu = mgpu.cpu(0)
    y_cpu = numpy_of(_core.conv2d_forward(on(cpu, x), on(cpu, w), on(cpu, b), 1, 1, "bf16"))
    dx, dw, _ = (numpy_of(t) for t in _core.conv2d_backward(
        on(cpu, x), on(cpu, w), on(cpu, np.ones(y.shape)), 1, 1, True, True, precision="bf16"))
    same(y.numpy(), y_cpu, "autocast conv y on a gpu")
    same(xt.grad.numpy(), dx, "autocast conv dx on a gpu")
    same(wt.grad.numpy(), dw, "autocast conv dw on a gpu")
    assert not np.array_equal(mgpu.conv2d(xt, wt, bt, padding=1).numpy(), y.numpy())


def books_loop_and_fused(devices):
    """One bf16 SGD step of tiny_net by the book's loop under autocast and by the fused step on
    `devices`; both networks' states."""
    nets = [tiny_net(), tiny_net()]
    models = [nn.DataParallel(n, device_ids=devices) for n in nets]
    trainers = [mgpu.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    loss = nn.CrossEntropyLoss()
    X, y = batch(8)
    Xt, yt = mgpu.array(X, device=devices[0]), mgpu.array(y, device=devices[0])
    trainers[0].zero_grad()
    with mgpu.autocast("bf16"):
        book = loss(models[0](Xt), yt)
    book.backward()
    trainers[0].step()
    fused = models[1].train_step(Xt, yt, loss, trainers[1], precision="bf16")
    close(fused.item(), book.item(), "loss")
    return ({n: t.numpy() for n, t in nets[0].state_dict().items()},
            {n: t.numpy() for n, t in nets[1].state_dict().items()})


def test_books_loop_and_fused_step_in_bf16_on_gpus_agree_with_cpu_devices():
    """GPUs' float32 ops (batch norm, the loss) are not the CPU's bits: float tolerance here."""
    k = min(2, mgpu.num_gpus())
    book, fused = books_loop_and_fused([mgpu.gpu(i) for i in range(k)])
    cpu_book, _ = books_loop_and_fused([mgpu.cpu(i) for i in range(k)])
    for name in book:
        if name.endswith("num_batches_tracked"):  # the fused step does not count batches
            continue
        close(fused[name], book[name], f"fused vs book on gpus: {name}")
        close(book[name], cpu_book[name], f"gpus vs cpu devices: {name}")


@pytest.mark.skipif(mgpu.num_gpus() < 2, reason="needs 2 GPUs")
def test_fused_bf16_deterministic_step_has_the_same_bits_on_one_and_two_gpus():
    one, two = (deterministic_steps([mgpu.gpu(i) for i in range(k)]) for k in (1, 2))
    for name in one:
        same(two[name], one[name], f"{name}: 1 vs 2 gpus")
    # ... and bf16 took effect on the GPUs: float32's steps land elsewhere.
    f32 = deterministic_steps([mgpu.gpu(0)], "float32")
    assert not np.array_equal(f32["0.weight"], one["0.weight"])


@pytest.mark.skipif(mgpu.num_gpus() < 2, reason="needs 2 GPUs")
def test_train_concise_bf16_deterministic_on_one_and_two_gpus():
    """Sec. 12.6's loop with precision="bf16", fused and deterministic, one epoch on synthetic
    data: the same parameters on 1 and 2 GPUs."""
    params = []
    for k in (1, 2):
        mgpu.random.seed(0)
        net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.AvgPool2d(4),
                            nn.Flatten(), nn.Linear(2 * 7 * 7, 10))
        mgpu.chapter.train_concise(net, k, ckpt_worker.BATCH, 0.1, 1, data=ckpt_worker.data(),
                                   progress=False, fused=True, deterministic=True,
                                   precision="bf16")
        params.append([p.numpy() for p in net.parameters()])
    for i, (two, one) in enumerate(zip(params[1], params[0])):
        same(two, one, f"parameter {i}: 1 vs 2 gpus")
