"""The CPU conv's algorithms (MGPU_CONV_ALGO, cpp/ops/conv2d.h): Winograd F(4x4, 3x3) forward,
data gradient and weight gradient, and the forced direct and im2col paths, against the float64
references of reference.py at ResNet-18's 3x3 stride-1 shapes (small batch) and at odd sizes
(tiles overhanging the image, a 1x1 image, 1 and 3 channels, batch 1, pad 0 and 2); auto's
choice by the shape, tune's per-shape measurement; and a bad value's error.

Error measure: the largest absolute error over a tensor divided by the tensor's largest
reference magnitude (normwise; Winograd's error is spread over a tile, so a relative error per
element says nothing at entries that cancel to near 0). Measured on this CPU (AMD EPYC Zen 4,
worst of 3 seeds, inputs as in _inputs): Winograd forward <= 7.7e-6, dx <= 8.8e-6, dw <= 8.3e-6
at ResNet-18's layers (28x28x64 to 4x4x512), <= 2.6e-6 at the odd sizes; direct and im2col
<= 8.6e-7 (db, a plain sum on every path, <= 1.6e-6). F(4x4, 3x3)'s transforms amplify
float32 rounding by ~10x over the direct sum. Each bound below is ~3x the worst measured; a
wrong transform coefficient or tile offset gives errors of order 1. The fused forward
(winograd_fused.cpp, also dx's) measured forward <= 3.8e-6, dx <= 4.9e-6 at those layers
(seeds 0-2); one FMA chain over all 512 channels had given 1.2e-5 and 1.8e-5.
"""
import numpy as np
import pytest

import mgpu
import reference as ref

WINOGRAD_TOL = 3e-5  # normwise, ~3x the worst measured (see the docstring)
DIRECT_TOL = 5e-6

# (N, C, H, W), K, padding
RESNET = [
    pytest.param((2, 64, 28, 28), 64, 1, id="b1-64-28x28"),
    pytest.param((2, 128, 14, 14), 128, 1, id="b2-128-14x14"),
    pytest.param((2, 256, 7, 7), 256, 1, id="b3-256-7x7"),
    pytest.param((2, 512, 4, 4), 512, 1, id="b4-512-4x4"),
]
ODD = [
    pytest.param((1, 1, 5, 5), 1, 1, id="5x5-1ch-batch1"),
    pytest.param((1, 3, 7, 7), 3, 1, id="7x7-3ch-batch1"),
    pytest.param((2, 3, 1, 1), 2, 1, id="1x1-image"),
    pytest.param((3, 1, 6, 9), 3, 1, id="6x9-1ch-to-3"),
    pytest.param((2, 3, 7, 5), 4, 0, id="pad0-7x5"),
    pytest.param((1, 2, 5, 6), 3, 2, id="pad2-5x6"),
    pytest.param((9, 3, 13, 11), 5, 1, id="batch9-13x11"),
]


# The fused forward's edges (cpp/ops/conv2d_cpu/winograd_fused.cpp; its register tiles are 8
# (AVX-512) or 6 (AVX2) output channels by 32 or 16 tiles, its blocks 32 or 64 tiles): channel
# counts that are no multiple of either tile, tiles overhanging the image, blocks with a short
# last one, blocks of 64 tiles, 1 and 3 channels, batch 1, pad 0 and 2, a single output pixel.
# The data gradient runs the same forward on dy (K in, C out): each shape tests both ways round.
FUSED_EDGES = [
    pytest.param((3, 19, 11, 13), 13, 1, id="c19-k13-overhang-36tiles"),
    pytest.param((1, 3, 17, 17), 7, 0, id="batch1-3ch-pad0"),
    pytest.param((2, 1, 9, 10), 9, 2, id="1ch-k9-pad2"),
    pytest.param((1, 5, 3, 3), 3, 0, id="one-output-pixel"),
    pytest.param((5, 8, 6, 6), 8, 1, id="k8-exact"),
    pytest.param((4, 33, 9, 9), 6, 1, id="k6-c33-2blocks"),
    pytest.param((17, 176, 7, 7), 171, 1, id="64-tile-blocks-k171"),
]


def _inputs(rng, xshape, K):
    N, C, H, W = xshape
    x = rng.normal(size=xshape).astype(np.float32)
    w = (rng.normal(size=(K, C, 3, 3)) / np.sqrt(9 * C)).astype(np.float32)
    b = rng.normal(size=(K,)).astype(np.float32)
    return x, w, b


def _run(x, w, b, pad, dy_seed):
    xt = mgpu.array(x, device=mgpu.cpu(0)).requires_grad_()
    wt = mgpu.array(w, device=mgpu.cpu(0)).requires_grad_()
    bt = mgpu.array(b, device=mgpu.cpu(0)).requires_grad_()
    y = mgpu.conv2d(xt, wt, bt, padding=pad)
    dy = np.random.default_rng(dy_seed).normal(size=y.shape).astype(np.float32)
    y.backward(mgpu.array(dy, device=mgpu.cpu(0)))
    return y.numpy(), xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy(), dy


def _errors(x, w, b, pad, out):
    y, dx, dw, db, dy = out
    ry = ref.conv2d_forward(x, w, b, 1, pad)
    rdx, rdw, rdb = ref.conv2d_backward(x, w, dy, 1, pad)

    def err(got, want):
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    return {"y": err(y, ry), "dx": err(dx, rdx), "dw": err(dw, rdw), "db": err(db, rdb)}


@pytest.mark.parametrize("algo", ["winograd", "im2col", "direct", "auto", "tune"])
@pytest.mark.parametrize("xshape, K, pad", RESNET + ODD)
def test_conv_algorithms_match_float64(monkeypatch, rng, algo, xshape, K, pad):
    monkeypatch.setenv("MGPU_CONV_ALGO", algo)
    x, w, b = _inputs(rng, xshape, K)
    e = _errors(x, w, b, pad, _run(x, w, b, pad, 1))
    tol = DIRECT_TOL if algo in ("im2col", "direct") else WINOGRAD_TOL
    bad = {k: v for k, v in e.items() if not v <= tol}
    assert not bad, f"MGPU_CONV_ALGO={algo}: normwise errors {e} above {tol}"


@pytest.mark.parametrize("xshape, K, pad", FUSED_EDGES)
def test_winograd_fused_forward_edges_match_float64(monkeypatch, rng, xshape, K, pad):
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    x, w, b = _inputs(rng, xshape, K)
    e = _errors(x, w, b, pad, _run(x, w, b, pad, 1))
    bad = {k: v for k, v in e.items() if not v <= WINOGRAD_TOL}
    assert not bad, f"normwise errors {e} above {WINOGRAD_TOL}"


def test_winograd_bias_is_added_per_output_channel(monkeypatch, rng):
    """A zero input leaves only the bias: exactly b[k] at every output of channel k."""
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    _, w, b = _inputs(rng, (3, 19, 11, 13), 13)
    x = np.zeros((3, 19, 11, 13), np.float32)
    y = mgpu.conv2d(mgpu.array(x), mgpu.array(w), mgpu.array(b), padding=1).numpy()
    assert np.array_equal(y, np.broadcast_to(b[None, :, None, None], y.shape))


@pytest.mark.parametrize("xshape, K, pad", RESNET[:2] + ODD[:2])
def test_winograd_is_a_different_path_from_im2col(monkeypatch, rng, xshape, K, pad):
    """The forced paths really differ: their results agree (above) but not bit for bit."""
    x, w, b = _inputs(rng, xshape, K)
    outs = {}
    for algo in ("winograd", "im2col"):
        monkeypatch.setenv("MGPU_CONV_ALGO", algo)
        outs[algo] = _run(x, w, b, pad, 1)
    for i, name in enumerate(["y", "dx", "dw"]):
        assert not np.array_equal(outs["winograd"][i], outs["im2col"][i]), name


def test_tune_measures_each_shape_once_and_reports_it(monkeypatch, rng):
    monkeypatch.setenv("MGPU_CONV_ALGO", "tune")
    x, w, b = _inputs(rng, (3, 16, 9, 10), 17)
    first = _run(x, w, b, 1, 2)
    report = mgpu._core.conv_autotune_report()
    line = [s for s in report.splitlines() if s.startswith("forward C=16 H=9 W=10 K=17 3x3")]
    assert len(line) == 1, report
    assert ": winograd (" in line[0] or ": direct (" in line[0], line[0]
    assert any(s.startswith("backward C=16 H=9 W=10 K=17") for s in report.splitlines()), report
    # The second call runs the pick: the same bits as the first, which kept the pick's output.
    again = _run(x, w, b, 1, 2)
    for a, c in zip(first, again):
        assert np.array_equal(a, c)
    # A different batch size reuses the shape's measurement (no new line).
    _run(x[:1], w, b, 1, 2)
    assert mgpu._core.conv_autotune_report() == report


def test_tune_leaves_few_channels_and_other_shapes_to_the_rule(monkeypatch, rng):
    monkeypatch.setenv("MGPU_CONV_ALGO", "tune")
    x, w, b = _inputs(rng, (2, 3, 8, 8), 15)
    before = mgpu._core.conv_autotune_report()
    _run(x, w, b, 1, 3)
    assert mgpu._core.conv_autotune_report() == before


@pytest.mark.parametrize("xshape, K, pad, want", [
    ((2, 16, 7, 7), 16, 1, "winograd"),   # 7x7 output, 16 channels: Winograd
    ((2, 16, 6, 6), 16, 1, "winograd"),   # 6x6: the smallest output auto gives Winograd
    ((2, 16, 5, 5), 16, 1, "direct"),     # 5x5 output: below the size where it pays
    ((2, 15, 8, 8), 16, 1, "direct"),     # too few input channels
    ((2, 16, 8, 8), 15, 1, "direct"),     # too few output channels
    ((2, 512, 4, 4), 512, 1, "winograd"),  # 4x4, one whole tile, 512 channels (ResNet-18's)
    ((2, 256, 4, 4), 512, 1, "direct"),   # 4x4 with fewer input channels: unmeasured, direct
    ((2, 512, 5, 5), 512, 1, "direct"),   # 5x5: tiles overhang the output
])
def test_auto_chooses_by_the_shape_alone(monkeypatch, rng, xshape, K, pad, want):
    # auto's result is bit for bit the forced algorithm's, and it measures nothing.
    x, w, b = _inputs(rng, xshape, K)
    before = mgpu._core.conv_autotune_report()
    monkeypatch.setenv("MGPU_CONV_ALGO", "auto")
    got = _run(x, w, b, pad, 1)
    monkeypatch.setenv("MGPU_CONV_ALGO", want)
    forced = _run(x, w, b, pad, 1)
    for name, a, c in zip(["y", "dx", "dw", "db"], got, forced):
        assert np.array_equal(a, c), f"auto differs from {want} in {name}"
    assert mgpu._core.conv_autotune_report() == before


def test_unknown_algorithm_is_a_value_error(monkeypatch):
    monkeypatch.setenv("MGPU_CONV_ALGO", "fft")
    x = mgpu.array(np.ones((1, 1, 4, 4), np.float32))
    w = mgpu.array(np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match="MGPU_CONV_ALGO=fft"):
        mgpu.conv2d(x, w, padding=1)


def _resnet18_steps(monkeypatch, algo, steps=4, perturb=0.0):
    """Losses and final parameters of ``steps`` SGD steps (lr 0.05, batch 8) of d2l's
    resnet18(10, 1), op by op, with the input scaled by (1 + perturb * noise)."""
    monkeypatch.setenv("MGPU_CONV_ALGO", algo)
    mgpu.random.seed(0)
    net = mgpu.models.resnet18(10, 1)
    rng = np.random.default_rng(0)
    Xn = rng.uniform(size=(8, 1, 28, 28))
    Xn *= 1 + perturb * np.random.default_rng(5).standard_normal(Xn.shape)
    X = mgpu.array(Xn.astype(np.float32))
    y = mgpu.array(rng.integers(0, 10, 8))
    trainer = mgpu.optim.SGD(net.parameters(), lr=0.05)
    loss = mgpu.nn.CrossEntropyLoss()
    losses = []
    for _ in range(steps):
        out = loss(net(X), y)
        losses.append(out.item())
        out.backward()
        trainer.step()
        trainer.zero_grad()
    return np.array(losses), [p.numpy() for p in net.parameters()]


def test_resnet18_steps_with_winograd_stay_within_float32_noise(monkeypatch):
    """Four SGD steps of ResNet-18 (every 3x3 stride-1 conv on Winograd) against the same steps
    on the direct paths. Training a batch of 8 this hard is chaotic: the input changed by 1e-6
    (relative) moves the fourth loss by ~3.5% (measured). So the first loss must agree to 1e-5
    and every later loss and parameter must be no further from direct's than 5x that
    perturbation's (measured: Winograd 6e-7, 4e-5, 7.7e-3, 3.9e-2 relative; the perturbation
    1e-7, 2.7e-4, 6.7e-3, 3.5e-2; parameters 2.9e-3 and 3.5e-3 at most)."""
    direct, p_direct = _resnet18_steps(monkeypatch, "direct")
    wino, p_wino = _resnet18_steps(monkeypatch, "winograd")
    noisy, p_noisy = _resnet18_steps(monkeypatch, "direct", perturb=1e-6)
    assert direct[-1] < 0.5 * direct[0], direct
    assert abs(wino[0] - direct[0]) <= 1e-5 * direct[0], (wino, direct)
    bound = 5 * np.abs(noisy - direct) + 1e-5 * direct
    assert np.all(np.abs(wino - direct) <= bound), (wino, direct, noisy)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(p_noisy, p_direct))
    wino_moved = max(float(np.abs(a - b).max()) for a, b in zip(p_wino, p_direct))
    assert wino_moved <= 5 * moved, (wino_moved, moved)


def test_winograd_gives_the_same_bits_on_1_and_2_threads(monkeypatch, rng):
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    x, w, b = _inputs(rng, (5, 17, 9, 7), 19)
    threads = mgpu._core.num_threads()
    try:
        outs = []
        for n in (1, 2):
            mgpu._core.set_num_threads(n)
            outs.append(_run(x, w, b, 1, 4))
    finally:
        mgpu._core.set_num_threads(threads)
    for a, c in zip(*outs):
        assert np.array_equal(a, c)


# The weight gradient (cpp/ops/conv2d_cpu/winograd_dw.cpp) at sizes against its blocking:
# channels in 16-lane chunks (Cp), register tiles of 6 output channels x 64 (AVX-512) or 16
# (AVX2) input channels, blocks of ~256 tiles of whole images (9 tiles per 9x9 image: 28 images;
# 1 tile per 4x4 image: 256 images), so the last block is short.
DW_SHAPES = [
    pytest.param((2, 17, 6, 6), 13, 1, id="C17-K13-tails"),
    pytest.param((1, 70, 5, 5), 7, 1, id="C70-batch1-overhang"),
    pytest.param((3, 1, 7, 9), 3, 0, id="1ch-pad0"),
    pytest.param((2, 3, 6, 7), 1, 2, id="3ch-K1-pad2"),
    pytest.param((30, 5, 9, 9), 6, 1, id="two-blocks-of-images"),
    pytest.param((300, 2, 4, 4), 3, 1, id="two-blocks-4x4"),
]


def _grads_without_dx(x, w, b, pad, dy_seed):
    """dw and db as the step computes them for a first layer (no dx), and the dy used."""
    xt = mgpu.array(x, device=mgpu.cpu(0))
    wt = mgpu.array(w, device=mgpu.cpu(0)).requires_grad_()
    bt = mgpu.array(b, device=mgpu.cpu(0)).requires_grad_()
    y = mgpu.conv2d(xt, wt, bt, padding=pad)
    dy = np.random.default_rng(dy_seed).normal(size=y.shape).astype(np.float32)
    y.backward(mgpu.array(dy, device=mgpu.cpu(0)))
    return wt.grad.numpy(), bt.grad.numpy(), dy


@pytest.mark.parametrize("with_dx", [True, False])
@pytest.mark.parametrize("xshape, K, pad", DW_SHAPES)
def test_winograd_weight_gradient_matches_float64(monkeypatch, rng, xshape, K, pad, with_dx):
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    x, w, b = _inputs(rng, xshape, K)
    if with_dx:
        _, _, dw, db, dy = _run(x, w, b, pad, 6)
    else:
        dw, db, dy = _grads_without_dx(x, w, b, pad, 6)
    _, rdw, rdb = ref.conv2d_backward(x, w, dy, 1, pad)
    e_dw = float(np.abs(dw - rdw).max() / np.abs(rdw).max())
    e_db = float(np.abs(db - rdb).max() / np.abs(rdb).max())
    assert e_dw <= WINOGRAD_TOL, e_dw
    assert e_db <= DIRECT_TOL, e_db


def test_winograd_weight_gradient_same_bits_on_1_2_and_3_threads(monkeypatch, rng):
    """Two blocks of images and tile tails in both channel counts: every dU entry is summed in
    the same order whichever thread runs it."""
    monkeypatch.setenv("MGPU_CONV_ALGO", "winograd")
    x, w, b = _inputs(rng, (30, 17, 9, 9), 13)
    threads = mgpu._core.num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            mgpu._core.set_num_threads(n)
            outs.append(_grads_without_dx(x, w, b, 1, 7)[:2])
    finally:
        mgpu._core.set_num_threads(threads)
    for other in outs[1:]:
        for a, c in zip(outs[0], other):
            assert np.array_equal(a, c)
