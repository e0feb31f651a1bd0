"""bfloat16 products (cpp/ops/bf16.h): rounding, mm and conv2d's three passes with
precision="bf16", against NumPy float64.

Bounds from bfloat16's 8-bit significand, for data in the normal range. Rounding an operand to
bfloat16 changes it by a relative error of at most u = 2^-8, so a product a*b picks up at most
2u + u^2; the float32 sum of k products adds at most g_k = k 2^-24 / (1 - k 2^-24) of the sum
of |products|. So for every output element

    |y - y_exact| <= ((2u + u^2)(1 + g_k) + g_k) * sum |a| |b|,

with sum |a| |b| the same product of the absolute values (for a conv, the conv of |x| and |w|),
in float64. Two sharper checks guard what the bound alone would not: against the float64 product
of the *bfloat16-rounded* operands (rounded here, independently, by NumPy) the error is at most
g_k * sum |a_r| |b_r|, so the kernel rounds exactly where and how bf16.h says; and somewhere the
error exceeds what a float32 product may show (g_k), so the operands were rounded at all.
"""
import numpy as np
import pytest

import mgpu
import reference as ref
from mgpu import _core

U = 2.0 ** -8


def gamma(k):
    e = k * 2.0 ** -24
    return e / (1 - e)


def bf16_numpy(x):
    """x rounded to bfloat16 by NumPy: the two bfloat16 neighbours of each value (truncation and
    the next one away from zero), the nearer in float64, a tie to the even one; zeros and
    float32 denormals to a signed zero. Finite inputs only."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    down = bits & np.uint32(0xFFFF0000)
    up = down + np.uint32(0x10000)
    d = np.abs(down.view(np.float32).astype(np.float64))
    u = np.abs(up.view(np.float32).astype(np.float64))
    u[np.isinf(u)] = 2.0 ** 128  # past the largest finite bfloat16 (IEEE: halfway rounds to inf)
    ax = np.abs(x.astype(np.float64))
    even_down = (down >> np.uint32(16)) % 2 == 0
    pick_up = (u - ax < ax - d) | ((u - ax == ax - d) & ~even_down)
    out = np.where(pick_up, up, down).view(np.float32)
    tiny = np.abs(x) < np.float32(2.0 ** -126)
    return np.where(tiny, np.copysign(np.float32(0), x), out).astype(np.float32)


def cpu_tensor(a):
    return mgpu.array(np.ascontiguousarray(a, np.float32), device=mgpu.cpu(0))._t


def numpy_of(t):
    return mgpu.Tensor(t).numpy()


def check_bounds(got, exact, exact_rounded, abs_product, abs_product_rounded, k, what):
    """The three checks of the module docstring, elementwise."""
    err = np.abs(got.astype(np.float64) - exact)
    bound = ((2 * U + U * U) * (1 + gamma(k)) + gamma(k)) * abs_product
    assert np.all(err <= bound), (
        f"{what}: error {err.max():.3g} above the bfloat16 bound at {np.argmax(err - bound)}")
    err_r = np.abs(got.astype(np.float64) - exact_rounded)
    assert np.all(err_r <= gamma(k) * abs_product_rounded + 1e-45), (
        f"{what}: {err_r.max():.3g} from the product of the bfloat16-rounded operands")
    assert np.any(err > gamma(k) * abs_product), f"{what}: no element shows bfloat16 rounding"


def test_round_is_nearest_even_with_signed_zeros():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-30, 30, 4096))).astype(np.float32)
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 2.0 ** -130, -2.0 ** -140,
                     0.0, -0.0, np.uint32(0x7F7FA000).view(np.float32)], np.float32)
    x = np.concatenate([x, ties])
    got = numpy_of(_core.bf16_round(cpu_tensor(x)))
    want = bf16_numpy(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got[-8] == 1.0 and got[-7] == 1 + 2.0 ** -6      # ties to the even neighbour
    assert np.signbit(got[-4]) and got[-4] == 0               # a denormal becomes a signed zero
    assert got[-1] == np.inf                                  # past max + half an ulp: inf
    specials = np.array([np.inf, -np.inf, np.nan], np.float32)
    s = numpy_of(_core.bf16_round(cpu_tensor(specials)))
    assert s[0] == np.inf and s[1] == -np.inf and np.isnan(s[2])


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_mm_bf16_within_the_bfloat16_bound(trans_a, trans_b):
    rng = np.random.default_rng(1)
    m, k, n = 37, 301, 53
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    a_in = np.ascontiguousarray(a.T) if trans_a else a
    b_in = np.ascontiguousarray(b.T) if trans_b else b
    got = numpy_of(_core.mm(cpu_tensor(a_in), cpu_tensor(b_in), trans_a, trans_b,
                            precision="bf16"))
    ar, br = bf16_numpy(a).astype(np.float64), bf16_numpy(b).astype(np.float64)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    check_bounds(got, a64 @ b64, ar @ br, np.abs(a64) @ np.abs(b64), np.abs(ar) @ np.abs(br), k,
                 "mm")


def test_mm_float32_is_unchanged_by_default():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((9, 40)).astype(np.float32)
    b = rng.standard_normal((40, 7)).astype(np.float32)
    got = numpy_of(_core.mm(cpu_tensor(a), cpu_tensor(b)))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.all(np.abs(got - exact) <= gamma(40) * (np.abs(a) @ np.abs(b)) + 1e-30)


CONVS = [
    pytest.param((4, 3, 11, 9), 6, 3, 1, 1, id="3x3-pad1-odd"),
    pytest.param((3, 8, 12, 12), 16, 3, 2, 1, id="3x3-stride2"),
    pytest.param((2, 16, 7, 7), 8, 1, 1, 0, id="1x1"),
    pytest.param((40, 2, 6, 6), 5, 5, 1, 2, id="5x5-pad2-many-chunks"),
    pytest.param((3, 4, 9, 9), 5, 5, 1, 0, id="5x5-pad0"),
    pytest.param((4, 3, 7, 7), 6, 1, 1, 1, id="1x1-pad1"),
    pytest.param((33, 20, 4, 4), 40, 3, 1, 1, id="4x4-outputs"),
]


@pytest.mark.parametrize("xshape,K,R,stride,pad", CONVS)
def test_conv2d_bf16_passes_within_the_bfloat16_bound(monkeypatch, xshape, K, R, stride, pad):
    """The im2col products (MGPU_CONV_ALGO=direct, as auto): winograd's are bounded in
    test_bf16_winograd.py."""
    monkeypatch.setenv("MGPU_CONV_ALGO", "direct")
    rng = np.random.default_rng(3)
    N, C, H, W = xshape
    x = rng.standard_normal(xshape).astype(np.float32)
    w = rng.standard_normal((K, C, R, R)).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    y = numpy_of(_core.conv2d_forward(cpu_tensor(x), cpu_tensor(w), cpu_tensor(b), stride, pad,
                                      precision="bf16"))
    P, Q = y.shape[2:]
    dy = rng.standard_normal((N, K, P, Q)).astype(np.float32)
    dx, dw, db = _core.conv2d_backward(cpu_tensor(x), cpu_tensor(w), cpu_tensor(dy), stride, pad,
                                       True, True, precision="bf16")
    dx, dw, db = numpy_of(dx), numpy_of(dw), numpy_of(db)

    xr, wr, dyr = bf16_numpy(x), bf16_numpy(w), bf16_numpy(dy)
    ax, aw, ady = np.abs(x), np.abs(w), np.abs(dy)
    axr, awr, adyr = np.abs(xr), np.abs(wr), np.abs(dyr)
    conv = lambda u, v: ref.conv2d_forward(u, v, None, stride, pad)  # noqa: E731
    back = lambda u, v, d: ref.conv2d_backward(u, v, d, stride, pad, False)  # noqa: E731

    # forward: C*R*S products per output, then + b (one more float32 rounding, inside g_k+1).
    bias = b[None, :, None, None].astype(np.float64)
    check_bounds(y, conv(x, w) + bias, conv(xr, wr) + bias, conv(ax, aw) + np.abs(bias),
                 conv(axr, awr) + np.abs(bias), C * R * R + 1, "y")
    # dx: K*R*S products per input, the col2im adds among them (at most R*S more roundings).
    dx64, dw64, _ = back(x, w, dy)
    dxr, dwr, _ = back(xr, wr, dyr)
    adx, adw, _ = back(ax, aw, ady)
    adxr, adwr, _ = back(axr, awr, adyr)
    check_bounds(dx, dx64, dxr, adx, adxr, K * R * R + R * R, "dx")
    # dw: N*P*Q products per weight, a chunk's sum starting from the chunks' before it.
    check_bounds(dw, dw64, dwr, adw, adwr, N * P * Q + N, "dw")
    # db: float32 sums of the rounded dy (per image, then images in double): within g of the
    # rounded dy's exact sum, and within u + g of dy's.
    dbr64 = dyr.astype(np.float64).sum(axis=(0, 2, 3))
    assert np.all(np.abs(db - dbr64) <= gamma(P * Q + 1) * adyr.sum(axis=(0, 2, 3)))
    db64 = dy.astype(np.float64).sum(axis=(0, 2, 3))
    assert np.all(np.abs(db - db64) <= (U + gamma(P * Q + 1)) * ady.sum(axis=(0, 2, 3)))


def test_bf16_kernel_is_named_and_precision_is_checked():
    assert _core.bf16_kernel() in ("avx512_bf16", "avx512", "avx2")
    a = cpu_tensor(np.ones((2, 2)))
    with pytest.raises(ValueError, match="precision 'half' is not known"):
        _core.mm(a, a, precision="half")


def test_bf16_passes_give_the_same_bits_on_one_and_two_threads():
    rng = np.random.default_rng(4)
    # 50 images of 9x9: several chunks of images in dw's sum, with an odd number of columns.
    x = rng.standard_normal((50, 4, 9, 9)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((50, 8, 9, 9)).astype(np.float32)
    a = rng.standard_normal((70, 90)).astype(np.float32)
    before = mgpu.num_threads()
    runs = []
    try:
        for threads in (1, 2):
            mgpu.set_num_threads(threads)
            y = _core.conv2d_forward(cpu_tensor(x), cpu_tensor(w), None, 1, 1, precision="bf16")
            g = _core.conv2d_backward(cpu_tensor(x), cpu_tensor(w), cpu_tensor(dy), 1, 1, True,
                                      False, precision="bf16")
            p = _core.mm(cpu_tensor(a), cpu_tensor(a), False, True, precision="bf16")
            runs.append([numpy_of(t).tobytes() for t in (y, g[0], g[1], p)])
    finally:
        mgpu.set_num_threads(before)
    assert runs[0] == runs[1]
