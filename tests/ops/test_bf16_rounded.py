"""precision="bf16" under MGPU_CONV_ALGO=auto (cpp/ops/bf16.h): a conv pass rounds its operands
to bfloat16 and runs float32's kernels on them (Winograd F(4x4, 3x3) where float32's auto takes
it, float32's rule elsewhere), not the bfloat16 products, which direct and im2col keep; the lane
shapes of the rule run their own pair products (test_bf16_lanes.py).

So a pass's result is, bit for bit, the float32 pass on the rounded operands (rounded here by
NumPy), db included: the sum of the rounded dy, as PyTorch's autocast sums a bfloat16 gradient
(the products' path does too, in its own order). Against float64, with u = 2^-8 and
A = conv(|x|, |w|):
  - direct and im2col kernels: the products of rounded operands are exact in float32, so
    test_bf16.py's bound holds as it stands: ((2u + u^2)(1 + g_k) + g_k) A;
  - Winograd: |y - conv(x_r, w_r)| <= 2 g_(C+16) Tbar, float32 Winograd's error on the rounded
    operands (U rounded once, V 8 roundings deep, C products summed, 7 roundings in the output
    transform: C + 16 in all, doubled for the second-order terms; Tbar = |A^T| sum_c |U_c| Vbar_c
    |A| from winograd_bf16_model.py), plus the rounding's own (2u + u^2) A.
"""
import numpy as np
import pytest

import reference as ref
import winograd_bf16_model as model
from isa_paths import digests_on_every_path
from mgpu import _core
from test_bf16 import U, bf16_numpy, check_bounds, cpu_tensor, gamma, numpy_of

ROUNDED = [
    pytest.param((2, 16, 10, 10), 16, 3, 1, 1, True, id="3x3-winograd"),
    pytest.param((3, 8, 12, 12), 16, 3, 2, 1, False, id="3x3-stride2-short"),
    pytest.param((2, 16, 7, 7), 8, 1, 2, 0, False, id="1x1-stride2"),
    pytest.param((9, 1, 18, 18), 4, 3, 1, 0, False, id="3x3-one-channel-direct"),
]


def passes(x, w, b, dy, stride, pad, precision):
    y = _core.conv2d_forward(cpu_tensor(x), cpu_tensor(w), cpu_tensor(b), stride, pad,
                             precision=precision)
    g = _core.conv2d_backward(cpu_tensor(x), cpu_tensor(w), cpu_tensor(dy), stride, pad, True,
                              True, precision=precision)
    return [numpy_of(y)] + [numpy_of(t) for t in g]


def data(xshape, K, R, stride, pad, seed=3):
    rng = np.random.default_rng(seed)
    N, C, H, W = xshape
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - R) // stride + 1
    return (rng.standard_normal(xshape).astype(np.float32),
            rng.standard_normal((K, C, R, R)).astype(np.float32),
            rng.standard_normal(K).astype(np.float32),
            rng.standard_normal((N, K, P, Q)).astype(np.float32))


def winograd_bound(x, w, pad):
    """2 g_(C+16) Tbar of the module docstring, for a 3x3 stride-1 conv of x (N, C, H, W)."""
    _, Tbar = model.bound_terms(np.asarray(x, np.float64), np.asarray(w, np.float64), pad,
                                "F(4x4,3x3)")
    return 2 * gamma(x.shape[1] + 16) * Tbar


@pytest.mark.parametrize("xshape,K,R,stride,pad,winograd", ROUNDED)
def test_auto_runs_float32_kernels_on_rounded_operands(monkeypatch, xshape, K, R, stride, pad,
                                                       winograd):
    monkeypatch.setenv("MGPU_CONV_ALGO", "auto")
    x, w, b, dy = data(xshape, K, R, stride, pad)
    y, dx, dw, db = passes(x, w, b, dy, stride, pad, "bf16")
    xr, wr, dyr = bf16_numpy(x), bf16_numpy(w), bf16_numpy(dy)
    y32, dx32, dw32, db32 = passes(xr, wr, b, dyr, stride, pad, "float32")
    for name, got, want in (("y", y, y32), ("dx", dx, dx32), ("dw", dw, dw32), ("db", db, db32)):
        assert got.tobytes() == want.tobytes(), f"{name}: not float32's kernel on rounded operands"
    db64 = dy.astype(np.float64).sum(axis=(0, 2, 3))
    assert np.all(np.abs(db - db64) <= (U + gamma(dy.size)) * np.abs(dy).sum(axis=(0, 2, 3)))

    ax, aw, ady = np.abs(x), np.abs(w), np.abs(dy)
    axr, awr, adyr = np.abs(xr), np.abs(wr), np.abs(dyr)
    conv = lambda u, v: ref.conv2d_forward(u, v, None, stride, pad)  # noqa: E731
    back = lambda u, v, d: ref.conv2d_backward(u, v, d, stride, pad, False)  # noqa: E731
    bias = b[None, :, None, None].astype(np.float64)
    dx64, dw64, _ = back(x, w, dy)
    dxr, dwr, _ = back(xr, wr, dyr)
    adx, adw, _ = back(ax, aw, ady)
    adxr, adwr, _ = back(axr, awr, adyr)
    N, C, _, _ = xshape
    P, Q = dy.shape[2:]
    if not winograd:
        check_bounds(y, conv(x, w) + bias, conv(xr, wr) + bias, conv(ax, aw) + np.abs(bias),
                     conv(axr, awr) + np.abs(bias), C * R * R + 1, "y")
        check_bounds(dx, dx64, dxr, adx, adxr, K * R * R + R * R, "dx")
        check_bounds(dw, dw64, dwr, adw, adwr, N * P * Q + N, "dw")
        return
    flipped = wr[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # dx's kernel (C, K, 3, 3)
    for name, got, exact, absolute, slack in (
            ("y", y, conv(x, w) + bias, conv(ax, aw) + np.abs(bias),
             winograd_bound(xr, wr, pad) + 2 * gamma(C + 16) * np.abs(bias)),
            ("dx", dx, dx64, adx, winograd_bound(dyr, flipped, 2 - pad))):
        err = np.abs(got.astype(np.float64) - exact)
        assert np.all(err <= (2 * U + U * U) * absolute + slack), f"{name}: above the bound"
        assert np.any(err > gamma(9 * C) * absolute), f"{name}: no element shows the rounding"
    # dw through Winograd's transformed domain: float32-level against the rounded operands'
    # exact gradient, bfloat16-level against the unrounded ones'.
    rel = lambda a, e: np.linalg.norm(a - e) / np.linalg.norm(e)  # noqa: E731
    assert rel(dw, dwr) < 1e-5 < rel(dw, dw64) < 2 * U


def test_auto_and_direct_take_different_kernels_at_a_long_product(monkeypatch):
    """C*R*S = 1152, where the products beat float32 on AVX512_BF16 but not on AVX2: auto still
    runs float32's kernels on the rounded operands (a route by the shape alone), direct the
    products."""
    args = ((2, 128, 8, 8), 8, 3, 2, 1)
    x, w, b, dy = data(*args)
    runs = {}
    for algo in ("auto", "direct"):
        monkeypatch.setenv("MGPU_CONV_ALGO", algo)
        runs[algo] = passes(x, w, b, dy, 2, 1, "bf16")
    rounded = passes(bf16_numpy(x), bf16_numpy(w), b, bf16_numpy(dy), 2, 1, "float32")
    for i, name in enumerate(("y", "dx", "dw", "db")):
        assert runs["auto"][i].tobytes() == rounded[i].tobytes(), name
    # db sums the same rounded dy either way (here exactly: few terms of 8 significant bits).
    for i, name in enumerate(("y", "dx", "dw")):
        assert runs["auto"][i].tobytes() != runs["direct"][i].tobytes(), name


ISA_CODE = """
import hashlib, numpy as np, mgpu
from mgpu import _core
rng = np.random.default_rng(7)
t = lambda a: mgpu.array(a)._t
h = hashlib.sha256()
for shape, K, R, st in (((3, 17, 9, 11), 20, 3, 1), ((2, 8, 9, 9), 8, 1, 2)):
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((K, shape[1], R, R)).astype(np.float32)
    pad = R // 2
    y = _core.conv2d_forward(t(x), t(w), None, st, pad, precision="bf16")
    dy = rng.standard_normal(mgpu.Tensor(y).shape).astype(np.float32)
    g = _core.conv2d_backward(t(x), t(w), t(dy), st, pad, True, False, precision="bf16")
    for a in (y, g[0], g[1]):
        h.update(mgpu.Tensor(a).numpy().tobytes())
print(mgpu.build_info()["cpu_bf16"], h.hexdigest())
"""


def test_same_bits_on_every_isa_path():
    """The rounding (the path's vector width) and float32's kernels give every path's bits."""
    seen = digests_on_every_path(ISA_CODE, MGPU_CONV_ALGO="auto")
    assert len(set(seen.values())) == 1, seen
