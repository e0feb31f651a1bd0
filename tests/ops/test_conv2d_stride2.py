"""The CPU conv's stride-2 paths (cpp/ops/conv2d_cpu.cpp, cpp/ops/conv2d_cpu/im2col.cpp):
ResNet-18's 3x3 and 1x1 stride-2 convolutions, forward and backward (dx, dw, db), against the
float64 references of reference.py at ResNet-18's shapes (small batch) and at odd sizes: odd H
and W so the last stride-2 window overhangs the image (pad 1) or leaves a row and column no
window reaches (pad 0, where dx must be 0), 1 and 3 channels in and out, batch 1, channel counts
that split the data gradient's channel groups unevenly, and a batch of several image blocks.
Runs on the CPU path this process chose; CI runs it again with MGPU_ISA=avx2 (.ci/test.sh), and
test_stride2_on_avx2 runs a subset in a subprocess with MGPU_ISA=avx2 so a plain run covers both
paths.

Error measure: the largest absolute error over a tensor divided by the tensor's largest
reference magnitude (normwise). The im2col + sgemm path's float32 sums measured <= 1e-6 on this
CPU (AMD EPYC Zen 4); the bound is 5e-6, and a misplaced tap or pixel gives errors of order 1.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import mgpu
import reference as ref

TOL = 5e-6

# (N, C, H, W), K, R (= S), padding; stride 2 everywhere
RESNET = [
    pytest.param((2, 64, 28, 28), 128, 3, 1, id="3x3-64-128-28x28"),
    pytest.param((2, 128, 14, 14), 256, 3, 1, id="3x3-128-256-14x14"),
    pytest.param((2, 256, 7, 7), 512, 3, 1, id="3x3-256-512-7x7"),
    pytest.param((2, 64, 28, 28), 128, 1, 0, id="1x1-64-128-28x28"),
    pytest.param((2, 128, 14, 14), 256, 1, 0, id="1x1-128-256-14x14"),
    pytest.param((2, 256, 7, 7), 512, 1, 0, id="1x1-256-512-7x7"),
]
ODD = [
    pytest.param((1, 1, 7, 7), 1, 3, 1, id="3x3-1ch-7x7-batch1"),
    pytest.param((1, 3, 9, 5), 3, 3, 1, id="3x3-3ch-9x5-batch1"),
    pytest.param((3, 3, 8, 11), 5, 3, 0, id="3x3-pad0-8x11"),
    pytest.param((2, 5, 6, 6), 1, 3, 1, id="3x3-k1-6x6"),
    pytest.param((9, 13, 13, 7), 7, 3, 1, id="3x3-batch9-13x7"),
    pytest.param((2, 3, 1, 1), 2, 3, 1, id="3x3-1x1-image"),
    pytest.param((1, 1, 7, 7), 1, 1, 0, id="1x1-1ch-7x7-batch1"),
    pytest.param((1, 3, 9, 5), 3, 1, 0, id="1x1-3ch-9x5-batch1"),
    pytest.param((3, 13, 11, 8), 5, 1, 0, id="1x1-c13-11x8"),
    pytest.param((9, 19, 7, 9), 1, 1, 0, id="1x1-k1-c19-batch9"),
    pytest.param((2, 6, 5, 7), 4, 1, 1, id="1x1-pad1-5x7"),
    # 4x4 outputs: blocks of 32 images (512 columns), the last one short
    pytest.param((40, 16, 7, 7), 24, 3, 1, id="3x3-batch40-blocks"),
    pytest.param((40, 8, 7, 7), 16, 1, 0, id="1x1-batch40-blocks"),
]


def _inputs(rng, xshape, K, R):
    C = xshape[1]
    x = rng.normal(size=xshape).astype(np.float32)
    w = (rng.normal(size=(K, C, R, R)) / np.sqrt(R * R * C)).astype(np.float32)
    b = rng.normal(size=(K,)).astype(np.float32)
    return x, w, b


def _errors(x, w, b, pad, dy_seed=1):
    xt = mgpu.array(x, device=mgpu.cpu(0)).requires_grad_()
    wt = mgpu.array(w, device=mgpu.cpu(0)).requires_grad_()
    bt = mgpu.array(b, device=mgpu.cpu(0)).requires_grad_()
    y = mgpu.conv2d(xt, wt, bt, stride=2, padding=pad)
    dy = np.random.default_rng(dy_seed).normal(size=y.shape).astype(np.float32)
    y.backward(mgpu.array(dy, device=mgpu.cpu(0)))
    ry = ref.conv2d_forward(x, w, b, 2, pad)
    rdx, rdw, rdb = ref.conv2d_backward(x, w, dy, 2, pad)
    assert y.shape == ry.shape

    def err(got, want):
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    return {"y": err(y.numpy(), ry), "dx": err(xt.grad.numpy(), rdx),
            "dw": err(wt.grad.numpy(), rdw), "db": err(bt.grad.numpy(), rdb)}


@pytest.mark.parametrize("algo", ["auto", "im2col"])
@pytest.mark.parametrize("xshape, K, R, pad", RESNET + ODD)
def test_stride2_matches_float64(monkeypatch, rng, algo, xshape, K, R, pad):
    monkeypatch.setenv("MGPU_CONV_ALGO", algo)
    x, w, b = _inputs(rng, xshape, K, R)
    e = _errors(x, w, b, pad)
    bad = {k: v for k, v in e.items() if not v <= TOL}
    assert not bad, f"MGPU_CONV_ALGO={algo}, ISA {mgpu.build_info().get('cpu_isa')}: " \
                    f"normwise errors {e} above {TOL}"


def test_stride2_dx_is_zero_where_no_window_reaches(rng):
    # 1x1 stride 2 reads only even rows and columns: dx elsewhere is exactly 0, at the even
    # ones exactly w^T dy (one product per pixel, no sums to round differently).
    x, w, b = _inputs(rng, (2, 5, 7, 6), 3, 1)
    xt = mgpu.array(x, device=mgpu.cpu(0)).requires_grad_()
    wt = mgpu.array(w, device=mgpu.cpu(0)).requires_grad_()
    y = mgpu.conv2d(xt, wt, mgpu.array(b, device=mgpu.cpu(0)), stride=2)
    dy = rng.normal(size=y.shape).astype(np.float32)
    y.backward(mgpu.array(dy, device=mgpu.cpu(0)))
    dx = xt.grad.numpy()
    odd = np.ones(dx.shape, bool)
    odd[:, :, ::2, ::2] = False
    assert np.all(dx[odd] == 0.0)
    want = np.einsum("nkpq,kc->ncpq", dy.astype(np.float64), w[:, :, 0, 0].astype(np.float64))
    assert np.abs(dx[:, :, ::2, ::2] - want).max() <= TOL * np.abs(want).max()


def test_stride2_on_avx2():
    """A subset of the shapes above on the AVX2 path, in a subprocess with MGPU_ISA=avx2 (the
    path is chosen once per process)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MGPU_ISA="avx2")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k",
                        "matches_float64 and (28x28 or batch9 or 9x5 or pad0 or c13 or batch40)"
                        " or zero_where"],
                       env=env, cwd=here, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
    check = subprocess.run([sys.executable, "-c", "import mgpu; print(mgpu.build_info()"
                            ".get('cpu_isa'))"], env=env, capture_output=True, text=True)
    assert check.stdout.strip() == "avx2", check.stdout + check.stderr
