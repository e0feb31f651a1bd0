"""Winograd F(2x2, 3x3) with bfloat16 products (cpp/ops/conv2d_cpu/winograd_bf16.cpp): conv2d's
bf16 forward and data gradient for 3x3 stride-1 layers, against NumPy float64.

Three checks per pass, as tests/ops/test_bf16.py makes for the GEMM: the error against the exact
conv within winograd_bf16_model.py's bound (~2u T, T = |A^T| (sum_c |U_c| |V_c|) |A|, computed
from the data); against the exact output transform of the exact sum of the *bfloat16-rounded*
transformed tiles (U and V rounded here by NumPy, V transformed in float32 in the kernel's order)
at most the float32 sums' and the output transform's rounding, so the kernel rounds U and V
exactly where and how the header says; and somewhere an error above what float32 may show.
Bits: the same on every MGPU_ISA path, on one and two threads, and batch by batch. The kernel runs
under MGPU_CONV_ALGO=winograd (auto keeps the im2col products, so far faster).
"""
import numpy as np
import pytest

import mgpu
import winograd_bf16_model as model
from isa_paths import digests_on_every_path
from mgpu import _core
from test_bf16 import bf16_numpy, cpu_tensor, gamma, numpy_of

ALGO = "F(2x2,3x3)"
AT = model.AT2


def kernel_rounded_transforms(x, w, pad):
    """U and V as the kernel rounds them: U = G g G^T in double (its order), to float32, to
    bfloat16; V = B^T d B in float32 (rows, then columns; its order), to bfloat16."""
    g = np.asarray(w, np.float64)
    G = model.G2
    gg = [[(G[a, 0] * g[:, :, 0, t] + G[a, 1] * g[:, :, 1, t]) + G[a, 2] * g[:, :, 2, t]
           for t in range(3)] for a in range(4)]
    U = np.empty(g.shape[:2] + (4, 4))
    for a in range(4):
        for b in range(4):
            U[:, :, a, b] = (gg[a][0] * G[b, 0] + gg[a][1] * G[b, 1]) + gg[a][2] * G[b, 2]
    Ur = bf16_numpy(U.astype(np.float32)).astype(np.float64)
    d, P, Q = model.tiles(np.asarray(x, np.float64), pad, 2)
    d = d.astype(np.float32)
    e = np.stack([d[..., 0, :] - d[..., 2, :], d[..., 1, :] + d[..., 2, :],
                  d[..., 2, :] - d[..., 1, :], d[..., 1, :] - d[..., 3, :]], axis=-2)
    V = np.stack([e[..., 0] - e[..., 2], e[..., 1] + e[..., 2],
                  e[..., 2] - e[..., 1], e[..., 1] - e[..., 3]], axis=-1)
    return Ur, bf16_numpy(V).astype(np.float64), P, Q


def check_pass(got, x, w, b, pad, what):
    """The three checks of the module docstring for y = conv(x, w) + b (b may be None)."""
    C = x.shape[1]
    exact = model.conv(x, w, pad) + (0 if b is None else b[None, :, None, None])
    err = np.abs(got.astype(np.float64) - exact)
    bound = model.bound(x, w, b, pad, ALGO)
    assert np.all(err <= bound), (
        f"{what}: error {err.max():.3g} above the bound at "
        f"{np.unravel_index(np.argmax(err - bound), err.shape)}")
    Ur, Vr, P, Q = kernel_rounded_transforms(x, w, pad)
    bias = 0 if b is None else np.asarray(b, np.float64)[None, :, None, None]
    rounded = model.output(np.einsum("kcab,ncxyab->nkxyab", Ur, Vr), AT, P, Q) + bias
    magnitude = model.output(np.einsum("kcab,ncxyab->nkxyab", np.abs(Ur), np.abs(Vr)),
                             np.abs(AT), P, Q) + np.abs(bias)
    dv, do = model.DEPTHS[ALGO]
    err_r = np.abs(got.astype(np.float64) - rounded)
    tol_r = (gamma(C) * (1 + gamma(do)) + gamma(do)) * magnitude + 1e-45
    assert np.all(err_r <= tol_r), (
        f"{what}: {err_r.max():.3g} from the transform of the bfloat16-rounded tiles")
    absconv = model.conv(np.abs(x), np.abs(w), pad)
    assert np.any(err > gamma(9 * C) * absconv), f"{what}: no element shows bfloat16 rounding"


def conv_passes(x, w, b, dy, pad):
    y = numpy_of(_core.conv2d_forward(cpu_tensor(x), cpu_tensor(w),
                                      None if b is None else cpu_tensor(b), 1, pad,
                                      precision="bf16"))
    g = _core.conv2d_backward(cpu_tensor(x), cpu_tensor(w), cpu_tensor(dy), 1, pad, True,
                              b is not None, precision="bf16")
    return y, numpy_of(g[0])


SHAPES = [  # (N, C, H, W), K, pad
    pytest.param((3, 17, 9, 11), 20, 1, id="odd-image-odd-C-pad1"),
    pytest.param((2, 16, 7, 5), 24, 0, id="pad0"),
    pytest.param((2, 19, 6, 7), 33, 2, id="pad2-K33"),
    pytest.param((2, 40, 4, 4), 40, 1, id="whole-tiles"),
    pytest.param((4, 3, 5, 6), 9, 1, id="few-channels"),
]


@pytest.mark.parametrize("xshape,K,pad", SHAPES)
def test_forward_and_dx_within_the_bound(monkeypatch, xshape, K, pad):
    rng = np.random.default_rng(5)
    N, C, H, W = xshape
    x = rng.standard_normal(xshape).astype(np.float32)
    w = rng.standard_normal((K, C, 3, 3)).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    P, Q = H + 2 * pad - 2, W + 2 * pad - 2
    dy = rng.standard_normal((N, K, P, Q)).astype(np.float32)
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    y, dx = conv_passes(x, w, b, dy, pad)
    check_pass(y, x, w, b, pad, "y")
    # dx: the forward of dy with the kernel flipped and its channels swapped, padding 2 - pad.
    wf = np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
    check_pass(dx, dy, wf, None, 2 - pad, "dx")
    # ... and the im2col products, which auto and direct keep, give other bits.
    for algo in ("auto", "direct"):
        monkeypatch.setenv("MGPU_CONV_ALGO", algo)
        y_d, dx_d = conv_passes(x, w, b, dy, pad)
        assert not np.array_equal(y, y_d) and not np.array_equal(dx, dx_d)


def test_same_bits_on_one_and_two_threads_and_batch_by_batch(monkeypatch):
    """600 channels: the kernel cuts the 70 images' tiles into chunks of 54 images; the same
    images in other calls (other chunks) and on other thread counts give the same bits."""
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((70, 600, 3, 3)).astype(np.float32)
    w = rng.standard_normal((600, 600, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((70, 600, 3, 3)).astype(np.float32)
    before = mgpu.num_threads()
    runs = []
    try:
        for threads in (1, 2):
            mgpu.set_num_threads(threads)
            runs.append(conv_passes(x, w, None, dy, 1))
    finally:
        mgpu.set_num_threads(before)
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    parts = [conv_passes(x[s], w, None, dy[s], 1) for s in (slice(0, 10), slice(10, 70))]
    assert np.concatenate([p[0] for p in parts]).tobytes() == runs[0][0].tobytes()
    assert np.concatenate([p[1] for p in parts]).tobytes() == runs[0][1].tobytes()


ISA_CODE = """
import hashlib, numpy as np, mgpu
from mgpu import _core
rng = np.random.default_rng(7)
x = rng.standard_normal((3, 17, 9, 11)).astype(np.float32)
w = rng.standard_normal((20, 17, 3, 3)).astype(np.float32)
dy = rng.standard_normal((3, 20, 9, 11)).astype(np.float32)
t = lambda a: mgpu.array(a)._t
y = _core.conv2d_forward(t(x), t(w), None, 1, 1, precision="bf16")
dx = _core.conv2d_backward(t(x), t(w), t(dy), 1, 1, True, False, precision="bf16")[0]
h = hashlib.sha256(mgpu.Tensor(y).numpy().tobytes() + mgpu.Tensor(dx).numpy().tobytes())
print(mgpu.build_info()["cpu_bf16"], h.hexdigest())
"""


def test_same_bits_on_every_isa_path():
    """avx512_bf16 (vdpbf16ps), avx512 and avx2 (float32 FMAs on rounded values), each where
    this CPU runs it."""
    seen = digests_on_every_path(ISA_CODE, MGPU_CONV_ALGO="winograd")
    assert len(set(seen.values())) == 1, seen
