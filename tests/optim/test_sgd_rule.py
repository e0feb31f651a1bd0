"""The SGD rule, written once (ops::SgdStep): the book's optim.SGD, the chapter's sgd and the
fused step's update all run it. The book's optimizer and the chapter's sgd are checked bitwise
against the rule written out in NumPy (each float32 fused multiply-add formed in float64 and
rounded once), and the book's optimizer against PyTorch's rule in float64 over several steps, in
every form (momentum, dampening, Nesterov, weight decay), on a CPU device and an emulated GPU.
(The fused step's own tests hold its update to float64 and its shared and per-replica forms to
each other's bits.)"""
import numpy as np
import pytest

import mgpu
from mgpu.parallel import sgd

f32 = np.float32


def fma(a, b, c):
    """float32 fmaf(a, b, c): a * b is exact in float64 (two 24-bit significands), the sum is
    rounded to float64 and then to float32 (a double rounding that these seeds never hit)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64)
            + np.asarray(c, np.float64)).astype(f32)


def rule(p, g, buf, lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False, batch=1.0):
    """One step of the documented rule in float32 operations; returns (p, buf)."""
    lr, momentum, dampening, wd = f32(lr), f32(momentum), f32(dampening), f32(wd)
    g = (g / f32(batch)).astype(f32)
    if wd != 0:
        g = fma(p, wd, g)
    if momentum != 0:
        b = g.copy() if buf is None else fma(buf, momentum,
                                            (f32(1) - dampening) * g if dampening else g)
        g = fma(momentum, b, g) if nesterov else b
        buf = b
    return fma(-lr, g, p), buf


def torch_rule64(p, grads, lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False):
    """PyTorch's SGD in float64, every step."""
    p, buf = p.astype(np.float64), None
    for g in grads:
        g = g.astype(np.float64) + wd * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


FORMS = {
    "plain": {},
    "weight decay": {"wd": 1e-2},
    "momentum, weight decay": {"momentum": 0.9, "wd": 1e-2},
    "dampening": {"momentum": 0.9, "dampening": 0.3, "wd": 1e-3},
    "nesterov": {"momentum": 0.9, "nesterov": True, "wd": 1e-3},
}


def book_steps(device, form, p0, grads, lr=0.05):
    """optim.SGD over the given gradients; (p, momentum buffer or None) as NumPy arrays."""
    p = mgpu.array(p0, device=device)
    p.requires_grad_()
    opt = mgpu.optim.SGD([p], lr=lr, momentum=form.get("momentum", 0.0),
                         dampening=form.get("dampening", 0.0), weight_decay=form.get("wd", 0.0),
                         nesterov=form.get("nesterov", False))
    for g in grads:
        p.grad = mgpu.array(g, device=device)
        opt.step()
    buf = opt.state.get(0, {}).get("momentum_buffer")
    return p.numpy(), None if buf is None else buf.numpy()


def check_book(device, rng):
    p0 = rng.normal(size=(37, 5)).astype(f32)
    grads = [rng.normal(size=(37, 5)).astype(f32) for _ in range(4)]
    for name, form in FORMS.items():
        got, got_buf = book_steps(device, form, p0, grads)
        want, buf = p0, None
        for g in grads:
            want, buf = rule(want, g, buf, 0.05, **form)
        np.testing.assert_array_equal(got, want, err_msg=f"{name}: parameters")
        if buf is not None:
            np.testing.assert_array_equal(got_buf, buf, err_msg=f"{name}: momentum buffer")
        np.testing.assert_allclose(got, torch_rule64(p0, grads, 0.05, **form), rtol=1e-5,
                                   atol=1e-6, err_msg=f"{name}: against float64")


def test_books_sgd_is_the_rule_bitwise_and_pytorchs_in_float64():
    check_book(mgpu.cpu(0), np.random.default_rng(0))


def test_chapters_sgd_is_the_rule_bitwise():
    """p -= lr / N * g: the rule over batch 1 with lr / N formed in float32."""
    rng = np.random.default_rng(1)
    p0, g = rng.normal(size=40001).astype(f32), rng.normal(size=40001).astype(f32)
    p = mgpu.array(p0)
    p.attach_grad()
    p.grad = mgpu.array(g)
    sgd([p], 0.1, 32)
    want, _ = rule(p0, g, None, f32(0.1) / f32(32))
    np.testing.assert_array_equal(p.numpy(), want)


@pytest.mark.gpu
def test_books_sgd_on_an_emulated_gpu_is_the_rule_bitwise():
    if mgpu.num_gpus() < 1:
        pytest.skip("needs an emulated GPU (the MGPU_CUDA_EMULATION build)")
    check_book(mgpu.gpu(0), np.random.default_rng(0))
