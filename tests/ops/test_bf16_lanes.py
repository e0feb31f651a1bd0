"""precision="bf16" on the lane convolutions (stride 1, no padding, more than 16 taps: LeNet's
conv2; cpp/ops/conv2d_cpu/lanes_bf16.cpp): vdpbf16ps's pair products over 16 images in lanes,
pairs of input channels (forward), of output channels (dx) and of adjacent output columns (dw),
or the same pairs as float32 FMAs on paths without AVX512_BF16.

Every output is a float32 sum of products of bfloat16-rounded operands (exact in float32), so
test_bf16.py's bound holds against float64: ((2u + u^2)(1 + g_k) + g_k) conv(|x|, |w|), and the
sum is within g_k of the rounded operands' exact product. The paths (avx512_bf16, avx512, avx2)
must give the same bits, tiny operands whose products flush to zero included, on one or two
threads. (LeNet's fused conv2d_relu_pool runs these passes: tests/step/test_lenet_bf16.py holds
its step to the op-by-op step's bits and to the same bits on every path.)
"""
import numpy as np
import pytest

import reference as ref
from isa_paths import digests_on_every_path
from test_bf16 import U, bf16_numpy, check_bounds, gamma
from test_bf16_rounded import data, passes

LANES = [
    # (N, C, H, W), K, R: two blocks of 16 images (the second short), odd and even C, K and Q.
    pytest.param((18, 6, 12, 12), 10, 5, id="even-channels"),
    pytest.param((17, 5, 11, 11), 7, 5, id="odd-channels-odd-columns"),
    pytest.param((18, 1, 12, 12), 6, 5, id="one-channel"),
    pytest.param((16, 20, 13, 13), 50, 5, id="lenet-conv2"),
    pytest.param((3, 3, 8, 10), 4, 3, id="3x3-non-square"),
]


@pytest.mark.parametrize("xshape,K,R", LANES)
def test_lane_passes_within_the_bfloat16_bound(monkeypatch, xshape, K, R):
    monkeypatch.setenv("MGPU_CONV_ALGO", "auto")
    N, C, H, W = xshape
    P, Q = H - R + 1, W - R + 1
    x, w, b, dy = data(xshape, K, R, 1, 0, seed=5)
    y, dx, dw, db = passes(x, w, b, dy, 1, 0, "bf16")

    xr, wr, dyr = bf16_numpy(x), bf16_numpy(w), bf16_numpy(dy)
    ax, aw, ady = np.abs(x), np.abs(w), np.abs(dy)
    axr, awr, adyr = np.abs(xr), np.abs(wr), np.abs(dyr)
    conv = lambda u, v: ref.conv2d_forward(u, v, None, 1, 0)  # noqa: E731
    back = lambda u, v, d: ref.conv2d_backward(u, v, d, 1, 0, False)  # noqa: E731
    bias = b[None, :, None, None].astype(np.float64)
    # forward: C*R*S products (C rounded up to pairs) per output, then + b.
    check_bounds(y, conv(x, w) + bias, conv(xr, wr) + bias, conv(ax, aw) + np.abs(bias),
                 conv(axr, awr) + np.abs(bias), (C + 1) * R * R + 1, "y")
    dx64, dw64, _ = back(x, w, dy)
    dxr, dwr, _ = back(xr, wr, dyr)
    adx, adw, _ = back(ax, aw, ady)
    adxr, adwr, _ = back(axr, awr, adyr)
    check_bounds(dx, dx64, dxr, adx, adxr, (K + 1) * R * R, "dx")
    # dw: (Q rounded up to pairs) * P products per lane, 16 lanes added, blocks' slots added.
    check_bounds(dw, dw64, dwr, adw, adwr, P * (Q + 1) + 16 + N, "dw")
    dbr64 = dyr.astype(np.float64).sum(axis=(0, 2, 3))
    assert np.all(np.abs(db - dbr64) <= gamma(N * P * Q) * adyr.sum(axis=(0, 2, 3)))
    db64 = dy.astype(np.float64).sum(axis=(0, 2, 3))
    assert np.all(np.abs(db - db64) <= (U + gamma(N * P * Q)) * ady.sum(axis=(0, 2, 3)))
    if C > 1 and K > 1 and R * R * C > 16:
        # The pair products, not float32's lane kernels on the rounded operands (another order
        # of the same sums: equal in some elements, not in all).
        y32, dx32, dw32, _ = passes(xr, wr, b, dyr, 1, 0, "float32")
        for name, got, other in (("y", y, y32), ("dx", dx, dx32), ("dw", dw, dw32)):
            assert got.tobytes() != other.tobytes(), f"{name}: float32's kernel ran"


ISA_CODE = """
import hashlib, numpy as np, mgpu
from mgpu import _core
rng = np.random.default_rng(11)
t = lambda a: mgpu.array(np.ascontiguousarray(a, np.float32))._t
h = hashlib.sha256()
for threads in (1, 2):
    mgpu.set_num_threads(threads)
    for shape, K, scale, inf in (((17, 5, 11, 11), 7, 1.0, False),
                                 ((18, 6, 12, 12), 10, 1.0, False),
                                 ((17, 5, 11, 11), 7, 2.0 ** -66, False),
                                 ((17, 5, 11, 11), 7, 1.0, True)):
        # scale 2^-66: products near 2^-132, below float32's normal range, so they flush to
        # zero (vdpbf16ps's FTZ, MXCSR.FTZ in the emulation) or survive, by the same rule.
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if inf:
            # In the last column, which dw's last (odd) column pair also meets: its zero dy
            # times inf is a NaN on every path.
            x[3, 2, 4, -1] = np.inf
        w = (rng.standard_normal((K, shape[1], 5, 5)) * scale).astype(np.float32)
        b = rng.standard_normal(K).astype(np.float32) * scale * scale
        y = _core.conv2d_forward(t(x), t(w), t(b), 1, 0, precision="bf16")
        dy = (rng.standard_normal(mgpu.Tensor(y).shape) * scale).astype(np.float32)
        g = _core.conv2d_backward(t(x), t(w), t(dy), 1, 0, True, True, precision="bf16")
        for a in (y, *g):
            a = mgpu.Tensor(a).numpy()
            h.update(np.where(np.isnan(a), np.float32(np.nan), a).tobytes())  # any NaN's bits
print(mgpu.build_info()["cpu_bf16"], h.hexdigest())
"""


def test_lane_passes_give_the_same_bits_on_every_isa_path_and_thread_count():
    seen = digests_on_every_path(ISA_CODE, MGPU_CONV_ALGO="auto")
    assert len(set(seen.values())) == 1, seen

