"""A NumPy float64 model of Winograd convolutions with bfloat16 products, and its error bound.

The model of a kernel that rounds the transformed tiles U = G g G^T and V = B^T d B to bfloat16
(round to nearest, ties to even) and does everything else exactly: the products summed exactly,
the output transform exact. Its error against the exact convolution, beside the same model of the
direct bfloat16 conv (x and w rounded, the conv exact), is the price of Winograd in bfloat16
before any float32 rounding. ``python winograd_bf16_model.py`` prints that study at ResNet-18's
3x3 stride-1 layers; tests/ops/test_bf16_winograd.py takes the transforms and the bound from here.

The finding (``python winograd_bf16_model.py``, 3 seeds of 2 images, at each of ResNet-18's 3x3
layers, forward on post-ReLU x and dx on normal dy, d2l's std 0.01 and He's init alike, since a
scale changes no relative error): direct bfloat16's normwise error is 2.3-2.4e-3; F(4x4, 3x3) with
points 0, 1, -1, 1/2, -2 gives 1.3-2.0e-2, 5.5-8.3x direct's (worst elementwise error relative to
conv(|x|, |w|) 5-18e-3 against direct's 0.3-1.3e-3); F(2x2, 3x3) with points 0, 1, -1 gives
3.4-4.3e-3, 1.5-1.8x direct's (elementwise 0.6-3.0e-3). The bound's amplification
T / conv(|x|, |w|) (median) is 7.5-12.9 for F(4x4) and 1.7-2.7 for F(2x2). So bfloat16 takes
F(2x2, 3x3): its error stays within 2x direct's, where F(4x4)'s percent-level forward error would
not.

The bound of a kernel that does round in float32 (cpp/ops/conv2d_cpu/winograd_bf16.cpp), for
data in the normal range, per output element, with u = 2^-8 (bfloat16), e = 2^-24 (float32),
gamma_n = n e / (1 - n e) and g_C = gamma_C, bf16.h's bound on a float32 sum of C products:
  - U is transformed in double and rounded to float32, then to bfloat16: U_r = U (1 + a_),
    |a_| <= a = u + 2e (the double transform's own error is far below e |U|);
  - V is transformed in float32, at most dv roundings deep on any path (F(2x2): 2, one add per
    pass; F(4x4): 8), so |V' - V| <= gamma_dv Vbar with Vbar = |B^T| |d| |B|; rounding V' to
    bfloat16 adds u |V'|: |V_r - V| <= u |V| + (1 + u) gamma_dv Vbar;
  - the products U_r V_r are exact in float32 and their float32 sum over C adds g_C sum |U_r| |V_r|;
  - the output transform and the bias add at most do roundings (F(2x2): 2 + 2 + 1 = 5; F(4x4): 7):
    gamma_do (|A^T| |M_r| |A| + |b|).
With T = |A^T| (sum_c |U_c| |V_c|) |A| and Tbar the same with Vbar_c in place of |V_c|:
    |y - y_exact| <= k1 T + (k2 + gamma_do (1 + k1 + k2)) Tbar + gamma_do |b|,
    k1 = a + u + a u  (~ 2u: bf16.h's 2u + u^2, with T in place of conv(|x|, |w|)),
    k2 = (1 + a)(1 + u)(gamma_dv + g_C (1 + gamma_dv)).
The direct bfloat16 conv's bound (bf16.h) is ~2u conv(|x|, |w|); Winograd's amplification is
T / conv(|x|, |w|), which the transform matrices' entries set.
"""
from __future__ import annotations

import numpy as np

U_BF16 = 2.0 ** -8
EPS32 = 2.0 ** -24

# F(4x4, 3x3), points 0, 1, -1, 1/2, -2 and infinity (cpp/ops/conv2d_cpu/winograd.cpp).
AT4 = np.array([[1, 1, 1, 1, 1, 0],
                [0, 1, -1, 0.5, -2, 0],
                [0, 1, 1, 0.25, 4, 0],
                [0, 1, -1, 0.125, -8, 1]], np.float64)
BT4 = np.array([[2, -3, -4, 3, 2, 0],
                [0, -2, 1, 5, 2, 0],
                [0, 2, -5, 1, 2, 0],
                [0, -2, -1, 2, 1, 0],
                [0, 1, -2, -1, 2, 0],
                [0, 2, -3, -4, 3, 2]], np.float64)
G4 = np.array([[1 / 2, 0, 0],
               [1 / 6, 1 / 6, 1 / 6],
               [-1 / 6, 1 / 6, -1 / 6],
               [-16 / 15, -8 / 15, -4 / 15],
               [1 / 30, -1 / 15, 2 / 15],
               [0, 0, 1 / 2]], np.float64)
# F(2x2, 3x3), points 0, 1, -1 and infinity (Lavin & Gray's).
AT2 = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)
BT2 = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
G2 = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float64)

ALGOS = {"F(4x4,3x3)": (AT4, BT4, G4), "F(2x2,3x3)": (AT2, BT2, G2)}
# The float32 roundings on any path through the input transform (dv) and through the output
# transform with the bias (do), as the kernels compute them.
DEPTHS = {"F(4x4,3x3)": (8, 7), "F(2x2,3x3)": (2, 5)}


def gamma(n):
    e = n * EPS32
    return e / (1 - e)


def round_bf16(x):
    """float64 values rounded to 8 significant bits, to nearest, ties to even (no denormals)."""
    m, e = np.frexp(np.asarray(x, np.float64))
    return np.ldexp(np.rint(m * 256.0), e - 8)


def tiles(x, pad, m):
    """The (alpha x alpha) input tiles of x (N, C, H, W) for m x m output tiles of a 3x3, stride-1
    conv with padding pad: (N, C, tr, tc, alpha, alpha), zeros past the image, and (P, Q)."""
    N, C, H, W = x.shape
    P, Q = H + 2 * pad - 2, W + 2 * pad - 2
    tr, tc = -(-P // m), -(-Q // m)
    alpha = m + 2
    xp = np.zeros((N, C, tr * m + 2, tc * m + 2))
    xp[:, :, pad:pad + H, pad:pad + W] = x
    d = np.empty((N, C, tr, tc, alpha, alpha))
    for i in range(tr):
        for j in range(tc):
            d[:, :, i, j] = xp[:, :, i * m:i * m + alpha, j * m:j * m + alpha]
    return d, P, Q


def transforms(x, w, pad, algo="F(4x4,3x3)"):
    """U (K, C, a, a) = G w G^T, V (N, C, tr, tc, a, a) = B^T d B, Vbar = |B^T| |d| |B|, exact."""
    AT, BT, G = ALGOS[algo]
    d, P, Q = tiles(np.asarray(x, np.float64), pad, AT.shape[0])
    U = np.einsum("ar,kcrs,bs->kcab", G, np.asarray(w, np.float64), G)
    V = np.einsum("ai,ncxyij,bj->ncxyab", BT, d, BT)
    Vbar = np.einsum("ai,ncxyij,bj->ncxyab", np.abs(BT), np.abs(d), np.abs(BT))
    return U, V, Vbar, P, Q


def output(M, AT, P, Q):
    """y (N, K, P, Q) from the transformed products M (N, K, tr, tc, a, a): A^T M A per tile,
    the overhang dropped."""
    Y = np.einsum("ia,nkxyab,jb->nkxiyj", AT, M, AT)
    N, K, tr, m, tc, _ = Y.shape
    return Y.reshape(N, K, tr * m, tc * m)[:, :, :P, :Q]


def winograd(x, w, pad, algo="F(4x4,3x3)", rounded=True):
    """The model: y = A^T [sum_c r(U_c) r(V_c)] A exactly, r = bfloat16 rounding (or none)."""
    U, V, _, P, Q = transforms(x, w, pad, algo)
    if rounded:
        U, V = round_bf16(U), round_bf16(V)
    M = np.einsum("kcab,ncxyab->nkxyab", U, V)
    return output(M, ALGOS[algo][0], P, Q)


def bound_terms(x, w, pad, algo="F(4x4,3x3)"):
    """T and Tbar of the module docstring (N, K, P, Q)."""
    AT = ALGOS[algo][0]
    U, V, Vbar, P, Q = transforms(x, w, pad, algo)
    aU = np.abs(U)
    T = output(np.einsum("kcab,ncxyab->nkxyab", aU, np.abs(V)), np.abs(AT), P, Q)
    Tbar = output(np.einsum("kcab,ncxyab->nkxyab", aU, Vbar), np.abs(AT), P, Q)
    return T, Tbar


def bound(x, w, b, pad, algo="F(2x2,3x3)"):
    """The elementwise bound of the module docstring on |y - y_exact| of a float32 kernel."""
    C = np.shape(x)[1]
    T, Tbar = bound_terms(x, w, pad, algo)
    u, a = U_BF16, U_BF16 + 2 * EPS32
    gC = gamma(C)
    k1 = a + u + a * u
    dv, do = DEPTHS[algo]
    k2 = (1 + a) * (1 + u) * (gamma(dv) + gC * (1 + gamma(dv)))
    absb = 0.0 if b is None else np.abs(np.asarray(b, np.float64))[None, :, None, None]
    return k1 * T + (k2 + gamma(do) * (1 + k1 + k2)) * Tbar + gamma(do) * absb


def conv(x, w, pad):
    """The exact 3x3 stride-1 cross-correlation, (N, C, H, W) * (K, C, 3, 3) in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    N, C, H, W = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    P, Q = H + 2 * pad - 2, W + 2 * pad - 2
    y = np.zeros((N, w.shape[0], P, Q))
    for r in range(3):
        for s in range(3):
            y += np.einsum("kc,ncpq->nkpq", w[:, :, r, s], xp[:, :, r:r + P, s:s + Q])
    return y


def study(seeds=(0, 1, 2), batch=2):
    """Normwise and elementwise errors of both Winograd models and the direct model against the
    exact conv at ResNet-18's 3x3 layers, forward and dx (dy with the flipped, transposed kernel),
    at d2l's initialisation (std 0.01) and He's; x post-ReLU (half-normal) for the forward, dy
    normal for dx. Also T / conv(|x|, |w|), the bound's amplification."""
    rows = []
    for C, H in [(64, 28), (128, 14), (256, 7), (512, 4)]:
        for init, std in [("d2l", 0.01), ("he", np.sqrt(2.0 / (9 * C)))]:
            for pas in ("forward", "dx"):
                res = {k: [] for k in ("direct", "F(4x4,3x3)", "F(2x2,3x3)")}
                elem = {k: [] for k in res}
                amp = {k: [] for k in ("F(4x4,3x3)", "F(2x2,3x3)")}
                for seed in seeds:
                    rng = np.random.default_rng(seed)
                    w = rng.normal(0, std, (C, C, 3, 3))
                    x = rng.normal(size=(batch, C, H, H))
                    if pas == "forward":
                        x = np.maximum(x, 0)
                    else:  # dx = conv(dy, w flipped, channels swapped), pad 2 - 1
                        w = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
                    exact = conv(x, w, 1)
                    absconv = conv(np.abs(x), np.abs(w), 1)
                    outs = {"direct": conv(round_bf16(x), round_bf16(w), 1)}
                    for algo in amp:
                        outs[algo] = winograd(x, w, 1, algo)
                        amp[algo].append(np.median(bound_terms(x, w, 1, algo)[0] / absconv))
                    for k, y in outs.items():
                        res[k].append(np.linalg.norm(y - exact) / np.linalg.norm(exact))
                        elem[k].append(np.max(np.abs(y - exact) / absconv))
                rows.append((C, H, init, pas, {k: max(v) for k, v in res.items()},
                             {k: max(v) for k, v in elem.items()},
                             {k: float(np.median(v)) for k, v in amp.items()}))
    return rows


if __name__ == "__main__":
    print("layer        init pass     normwise error: direct / F4 / F2  (F4/direct, F2/direct)"
          "   max |err|/conv(|x|,|w|): direct / F4 / F2   median T/conv(|x|,|w|): F4 / F2")
    for C, H, init, pas, nw, el, amp in study():
        d, f4, f2 = nw["direct"], nw["F(4x4,3x3)"], nw["F(2x2,3x3)"]
        print(f"{C:3d}ch {H:2d}x{H:<2d}  {init:4s} {pas:7s}  {d:.2e} / {f4:.2e} / {f2:.2e}"
              f"  ({f4 / d:4.1f}x, {f2 / d:4.1f}x)   {el['direct']:.2e} / "
              f"{el['F(4x4,3x3)']:.2e} / {el['F(2x2,3x3)']:.2e}   "
              f"{amp['F(4x4,3x3)']:.1f} / {amp['F(2x2,3x3)']:.1f}")
