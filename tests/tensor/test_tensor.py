"""The tensor API the chapter's code uses (D2L 12.5): construction and dtypes, NumPy and DLPack in
and out, repr, copies between devices, in-place assignment and row views, autograd bookkeeping,
seeded random draws, and the asynchronous semantics of the per-device queues."""

import gc

import numpy as np
import pytest

import mgpu

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)


def other_device(device):
    return C1 if device == C0 else C0


# ---------------------------------------------------------------------------------------------
# construction and description
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data, dtype", [
    ([1.5, -2.0, 3.25], np.float32),
    (np.array([[1.5, 2.0]], dtype=np.float64), np.float32),
    (np.array([1.5, 2.0], dtype=np.float16), np.float32),
    ([[1, 2, 3], [4, 5, 6]], np.int64),
    (np.array([7, 8], dtype=np.int16), np.int64),
    (np.array([True, False]), np.int64),
    (np.array([1, 2], dtype=np.int32), np.int32),
    (np.array([0, 255], dtype=np.uint8), np.uint8),
])
def test_array_default_dtypes(data, dtype):
    t = mgpu.array(data)
    expected = np.asarray(data)
    assert t.dtype == dtype
    assert t.shape == expected.shape
    assert t.device == C0
    np.testing.assert_array_equal(t.numpy(), expected.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64, np.uint8])
def test_array_explicit_dtype_is_honoured(dtype):
    t = mgpu.array([1, 2, 3], dtype=dtype, device=C1)
    assert t.dtype == dtype
    assert t.device == C1
    got = t.numpy()
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.array([1, 2, 3], dtype=dtype))


def test_array_from_a_tensor_copies_to_the_device():
    src = mgpu.array([1.0, 2.0], device=C1)
    t = mgpu.array(src, device=C0)
    assert t.device == C0
    t += 1
    np.testing.assert_array_equal(src.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(t.numpy(), [2.0, 3.0])
    assert mgpu.tensor([1, 2], device=C1).device == C1


def test_array_from_a_0d_value_keeps_shape():
    s = mgpu.array([1.0, 2.0]).sum()
    assert s.shape == ()
    assert mgpu.array(s.numpy()).shape == ()
    assert mgpu.array(3.0).shape == ()


def test_zeros_ones_full(device):
    z = mgpu.zeros((2, 3), device=device)
    o = mgpu.ones(4, device=device, dtype=np.int32)
    f = mgpu.full((3, 1), -2.5, device=device)
    for t, shape, dtype, value in [(z, (2, 3), np.float32, 0), (o, (4,), np.int32, 1),
                                   (f, (3, 1), np.float32, -2.5)]:
        assert t.shape == shape and t.dtype == dtype and t.device == device
        np.testing.assert_array_equal(t.numpy(), np.full(shape, value, dtype=dtype))
    like = mgpu.ones_like(f)
    assert like.shape == (3, 1) and like.device == device
    np.testing.assert_array_equal(like.numpy(), np.ones((3, 1), dtype=np.float32))
    np.testing.assert_array_equal(mgpu.zeros_like(o).numpy(), np.zeros(4, dtype=np.int32))


def test_arange_reshape_exact():
    t = mgpu.arange(20).reshape(4, 5)
    assert t.shape == (4, 5)
    assert t.dtype == np.float32
    np.testing.assert_array_equal(t.numpy(), np.arange(20, dtype=np.float32).reshape(4, 5))
    i = mgpu.arange(7, device=C1, dtype=np.int64)
    assert i.device == C1
    np.testing.assert_array_equal(i.numpy(), np.arange(7))


def test_description_attributes():
    t = mgpu.zeros((3, 4, 5), device=C1)
    assert t.shape == (3, 4, 5)
    assert t.ndim == 3
    assert len(t) == 3
    assert t.size == 60
    assert t.dtype == np.float32
    assert t.device == C1
    assert t.device != C0
    assert t.ctx == C1
    assert len(mgpu.zeros(7)) == 7


def test_numpy_round_trip_exact(rng):
    for a in [rng.normal(size=(3, 5)).astype(np.float32),
              rng.integers(-2**40, 2**40, size=(4,)),
              rng.integers(-2**31, 2**31 - 1, size=(2, 2)).astype(np.int32),
              rng.integers(0, 256, size=(2, 3, 2)).astype(np.uint8),
              np.array([np.finfo(np.float32).tiny, np.finfo(np.float32).max, -0.0],
                       dtype=np.float32)]:
        for dev in (C0, C1):
            got = mgpu.array(a, device=dev).numpy()
            assert got.dtype == a.dtype
            np.testing.assert_array_equal(got, a)
            assert got.tobytes() == a.tobytes()  # bit-exact, including -0.0


def test_numpy_returns_a_copy():
    t = mgpu.ones(3)
    a = t.numpy()
    a[0] = 9
    np.testing.assert_array_equal(t.numpy(), [1.0, 1.0, 1.0])


def test_np_asarray(rng):
    a = rng.normal(size=(2, 3)).astype(np.float32)
    t = mgpu.array(a, device=C1)
    np.testing.assert_array_equal(np.asarray(t), a)
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float64), a.astype(np.float64))
    assert t.tolist() == a.tolist()


def test_item():
    assert mgpu.array([2.5]).item() == 2.5
    v = mgpu.array([[7]], device=C1).item()
    assert v == 7 and isinstance(v, int)
    s = (mgpu.arange(5) * 2.0).sum()
    assert s.item() == 20.0 and isinstance(s.item(), float)
    assert float(s) == 20.0
    with pytest.raises(ValueError, match=r"item\(\).*3 elements"):
        mgpu.zeros(3).item()


def test_repr_format():
    assert repr(mgpu.zeros(3)) == "[0. 0. 0.] @cpu(0)"
    assert repr(mgpu.ones((1, 2), device=C1)) == "[[1. 1.]] @cpu(1)"
    assert repr(mgpu.array([1, 2], dtype=np.int64, device=C1)) == "[1 2] @cpu(1)"
    assert str(mgpu.array([0.5, -1.0])) == "[ 0.5 -1. ] @cpu(0)"
    assert repr(C0) == "cpu(0)" and repr(C1) == "cpu(1)"


# ---------------------------------------------------------------------------------------------
# copies between devices, assignment, row views
# ---------------------------------------------------------------------------------------------

def test_to_other_device_is_a_real_copy(device):
    other = other_device(device)
    x = mgpu.array([1.0, 2.0, 3.0], device=device)
    y = x.to(other)
    assert y.device == other and x.device == device
    y += 10
    y[0] = -1.0
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(y.numpy(), [-1.0, 12.0, 13.0])
    assert x.to(f"cpu:{other.index}").device == other


@pytest.mark.parametrize("same", [True, False], ids=["same-device", "other-device"])
def test_copyto_device_is_a_real_copy(device, same):
    target = device if same else other_device(device)
    x = mgpu.array([[1.0, 2.0], [3.0, 4.0]], device=device)
    y = x.copyto(target)
    assert y.device == target
    y += 1
    x *= 2
    np.testing.assert_array_equal(x.numpy(), [[2.0, 4.0], [6.0, 8.0]])
    np.testing.assert_array_equal(y.numpy(), [[2.0, 3.0], [4.0, 5.0]])
    z = x.copy()
    z.zero_()
    np.testing.assert_array_equal(x.numpy(), [[2.0, 4.0], [6.0, 8.0]])


@pytest.mark.parametrize("dst_device", [C0, C1])
def test_copyto_existing_tensor(dst_device):
    src = mgpu.array([1.0, 2.0, 3.0], device=C0)
    dst = mgpu.zeros(3, device=dst_device)
    out = src.copyto(dst)
    assert out is dst
    assert dst.device == dst_device
    np.testing.assert_array_equal(dst.numpy(), [1.0, 2.0, 3.0])
    src += 1  # dst holds its own copy
    np.testing.assert_array_equal(dst.numpy(), [1.0, 2.0, 3.0])


def test_setitem_whole_tensor():
    t = mgpu.zeros((2, 3), device=C1)
    ident = id(t)
    t[:] = mgpu.array(np.arange(6.0).reshape(2, 3), device=C1)
    np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3))
    t[:] = 4.5
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 4.5))
    t[:] = np.ones((2, 3))
    np.testing.assert_array_equal(t.numpy(), np.ones((2, 3)))
    t[:] = mgpu.full((2, 3), 2.0, device=C0)  # a tensor from another device is copied across
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 2.0))
    assert id(t) == ident and t.device == C1


def test_inplace_add_keeps_identity(device):
    t = mgpu.array([[1.0, 2.0], [3.0, 4.0]], device=device)
    alias = t
    u = mgpu.array([[10.0, 20.0], [30.0, 40.0]], device=device)
    t[:] += u
    assert t is alias
    np.testing.assert_array_equal(alias.numpy(), [[11.0, 22.0], [33.0, 44.0]])
    t += 1
    t -= mgpu.ones((2, 2), device=device)
    t *= 2
    t /= 4
    assert t is alias
    np.testing.assert_array_equal(alias.numpy(), [[5.5, 11.0], [16.5, 22.0]])


def test_row_views_share_memory():
    t = mgpu.array(np.arange(12.0).reshape(4, 3))
    row = t[1]
    assert row.shape == (3,)
    np.testing.assert_array_equal(row.numpy(), [3.0, 4.0, 5.0])
    np.testing.assert_array_equal(t[-1].numpy(), [9.0, 10.0, 11.0])
    block = t[1:3]
    assert block.shape == (2, 3)
    np.testing.assert_array_equal(block.numpy(), [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    row[:] = -1.0
    block += 100
    t[3] = mgpu.array([7.0, 8.0, 9.0])
    t[0:1] = 0.5
    expected = np.arange(12.0).reshape(4, 3)
    expected[0] = 0.5
    expected[1] = -1.0 + 100
    expected[2] += 100
    expected[3] = [7.0, 8.0, 9.0]
    np.testing.assert_array_equal(t.numpy(), expected)
    with pytest.raises(IndexError, match="out of range"):
        t[4]


def test_zero_():
    t = mgpu.array([[1.0, -2.0]], device=C1)
    assert t.zero_() is t
    np.testing.assert_array_equal(t.numpy(), [[0.0, 0.0]])
    i = mgpu.array([5, 6])
    i.zero_()
    np.testing.assert_array_equal(i.numpy(), [0, 0])


# ---------------------------------------------------------------------------------------------
# autograd bookkeeping
# ---------------------------------------------------------------------------------------------

def test_requires_grad_leaves_grad_none_until_backward():
    x = mgpu.array([1.0, -2.0, 3.0]).requires_grad_()
    assert x.requires_grad
    assert x.grad is None
    y = (x * x).sum()
    assert x.grad is None  # recording computes nothing yet
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, -4.0, 6.0])


def test_attach_grad_gives_zeros(device):
    x = mgpu.ones((2, 3), device=device).attach_grad()
    assert x.requires_grad
    assert x.grad is not None and x.grad.shape == (2, 3) and x.grad.device == device
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros((2, 3)))
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full((2, 3), 3.0))


def test_backward_accumulates_across_calls(device):
    x = mgpu.array([1.0, 2.0], device=device).requires_grad_()
    (x * x).sum().backward()
    (x * 5.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0 + 5.0, 4.0 + 5.0])
    x.grad.zero_()
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0])


def test_grad_is_not_shared_between_inputs():
    """An add hands the same dy to both inputs; their .grad must be separate tensors."""
    a = mgpu.array([1.0, 2.0]).requires_grad_()
    b = mgpu.array([3.0, 4.0]).requires_grad_()
    (a + b).sum().backward()
    a.grad += 10
    np.testing.assert_array_equal(b.grad.numpy(), [1.0, 1.0])
    np.testing.assert_array_equal(a.grad.numpy(), [11.0, 11.0])


def test_non_scalar_backward_back_propagates_the_sum():
    x = mgpu.array([1.0, -3.0, 0.5]).requires_grad_()
    (x * x * 2.0).backward()
    np.testing.assert_array_equal(x.grad.numpy(), [4.0, -12.0, 2.0])


def test_no_grad_disables_recording():
    x = mgpu.array([1.0, 2.0]).requires_grad_()
    with mgpu.no_grad():
        y = x * 2.0
        assert not mgpu.autograd.is_recording()
    assert mgpu.autograd.is_recording()
    assert not y.requires_grad
    np.testing.assert_array_equal(y.numpy(), [2.0, 4.0])
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    assert x.grad is None
    z = (x * 2.0).sum()  # recording is back on after the block
    z.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 2.0])


def test_no_grad_restores_state_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        with mgpu.no_grad():
            1 / 0
    assert mgpu.autograd.is_recording()


def test_autograd_record_context():
    x = mgpu.array([3.0, 4.0]).attach_grad()
    with mgpu.autograd.record():
        y = (x * x).sum()
    y.backward()
    np.testing.assert_array_equal(x.grad.numpy(), [6.0, 8.0])
    with mgpu.no_grad():
        with mgpu.autograd.record():
            assert (x * 1.0).requires_grad


def test_detach_cuts_the_graph():
    x = mgpu.array([1.0, 2.0]).requires_grad_()
    d = (x * 3.0).detach()
    assert not d.requires_grad
    np.testing.assert_array_equal(d.numpy(), [3.0, 6.0])


def test_integer_tensors_cannot_require_grad():
    with pytest.raises(TypeError, match="float32"):
        mgpu.array([1, 2]).requires_grad_()


# ---------------------------------------------------------------------------------------------
# DLPack
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.int64, np.uint8])
def test_numpy_from_dlpack_of_a_tensor(device, dtype):
    src = np.arange(12).reshape(3, 4).astype(dtype)
    t = mgpu.array(src, device=device)
    if str(device).startswith("gpu"):
        # GPU memory is exported as CUDA memory, which NumPy refuses (as for a torch CUDA tensor);
        # it comes back into mgpu without a copy, on its GPU.
        assert t.__dlpack_device__() == (2, device.index)
        with pytest.raises((RuntimeError, BufferError)):
            np.from_dlpack(t)
        back = mgpu.from_dlpack(t)
        assert back.device == device and back.dtype == dtype
        mine = mgpu.from_dlpack(t.__dlpack__(dl_device=(2, device.index)))
        assert mine.device == device
        with pytest.raises(BufferError, match="cannot be exported to DLPack device"):
            t.__dlpack__(dl_device=(2, device.index + 1))
        t[:] = mgpu.array(src + 1, device=device)
        np.testing.assert_array_equal(back.numpy(), src + 1)
        return
    a = np.from_dlpack(t)
    assert a.dtype == dtype and a.shape == (3, 4)
    np.testing.assert_array_equal(a, t.numpy())
    np.testing.assert_array_equal(a, src)


def test_dlpack_export_refuses_a_device_it_cannot_reach():
    t = mgpu.arange(3, device=C1)
    assert np.from_dlpack(t, device="cpu").tolist() == [0.0, 1.0, 2.0]  # asks for (1, 0)
    assert np.from_dlpack(mgpu.from_dlpack(t.__dlpack__(dl_device=(1, 0)))).tolist() == \
        [0.0, 1.0, 2.0]
    for where in [(2, 0), (2, 7), (13, 0)]:
        with pytest.raises(BufferError, match=rf"cpu\(1\) cannot be exported to DLPack device "
                           rf"\({where[0]}, {where[1]}\); only to \(1, 0\) or the CPU"):
            t.__dlpack__(dl_device=where)


def test_numpy_from_dlpack_waits_for_pending_work():
    """Export waits for the queue: the last of many queued updates is visible at once."""
    t = mgpu.zeros(100_000, device=C1)
    for _ in range(50):
        t += 1.0
    a = np.from_dlpack(t)
    np.testing.assert_array_equal(a, np.full(100_000, 50.0, dtype=np.float32))


def test_numpy_from_dlpack_shares_memory_and_keeps_it_alive():
    t = mgpu.arange(6, device=C1)
    a = np.from_dlpack(t)
    t += 1
    mgpu.waitall()
    np.testing.assert_array_equal(a, np.arange(1.0, 7.0))
    view = np.from_dlpack(t[2:4])
    np.testing.assert_array_equal(view, [3.0, 4.0])
    b = np.from_dlpack(mgpu.arange(5) + 100)  # the only reference to the storage is b's
    gc.collect()
    junk = [mgpu.full(5, -7.0) for _ in range(20)]  # would reuse freed memory
    mgpu.waitall()
    np.testing.assert_array_equal(b, np.arange(100.0, 105.0))
    del junk


def test_from_dlpack_numpy_shares_memory():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = mgpu.from_dlpack(a)
    assert t.shape == (2, 3) and t.dtype == np.float32 and t.device == C0
    a[1, 2] = 42.0
    np.testing.assert_array_equal(t.numpy(), [[0.0, 1.0, 2.0], [3.0, 4.0, 42.0]])
    t += 1
    mgpu.waitall()
    np.testing.assert_array_equal(a, [[1.0, 2.0, 3.0], [4.0, 5.0, 43.0]])
    i = np.array([3, 1, 2], dtype=np.int64)
    ti = mgpu.from_dlpack(i)
    assert ti.dtype == np.int64
    i[0] = -5
    np.testing.assert_array_equal(ti.numpy(), [-5, 1, 2])


def test_from_dlpack_survives_the_array_and_works_in_ops(rng):
    a = rng.normal(size=(4, 3)).astype(np.float32)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    expected = a.astype(np.float64) @ w.astype(np.float64)
    keep = a.copy()
    t = mgpu.from_dlpack(a)
    del a
    gc.collect()
    _ = [np.full((4, 3), -1.0, dtype=np.float32) for _ in range(10)]  # would reuse freed memory
    np.testing.assert_array_equal(t.numpy(), keep)
    out = mgpu.mm(t, mgpu.array(w))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(mgpu.relu(t).numpy(), np.maximum(keep, 0))
    moved = t.to(C1)
    assert moved.device == C1
    np.testing.assert_array_equal(moved.numpy(), keep)


def test_dlpack_round_trip_through_mgpu():
    a = np.arange(5, dtype=np.float32)
    b = np.from_dlpack(mgpu.from_dlpack(a))
    a[0] = 11.0
    assert b[0] == 11.0


def test_torch_interop():
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = mgpu.from_dlpack(x)
    x[0, 0] = 9.0
    np.testing.assert_array_equal(t.numpy(), [[9.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    back = torch.from_dlpack(mgpu.arange(4, device=C1))
    assert back.tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------
# random
# ---------------------------------------------------------------------------------------------

def test_seed_makes_normal_reproducible():
    mgpu.random.seed(42)
    a = mgpu.random.normal(size=(3, 4)).numpy()
    b = mgpu.random.normal(size=(3, 4), device=C1).numpy()
    mgpu.random.seed(42)
    a2 = mgpu.random.normal(size=(3, 4)).numpy()
    b2 = mgpu.random.normal(size=(3, 4), device=C1).numpy()
    np.testing.assert_array_equal(a, a2)
    np.testing.assert_array_equal(b, b2)
    assert not np.array_equal(a, b)  # the stream moves on between draws
    mgpu.random.seed(43)
    assert not np.array_equal(mgpu.random.normal(size=(3, 4)).numpy(), a)
    mgpu.random.seed(7)
    r = mgpu.randn(2, 5)
    mgpu.random.seed(7)
    np.testing.assert_array_equal(mgpu.randn((2, 5)).numpy(), r.numpy())
    assert r.shape == (2, 5) and r.dtype == np.float32


def test_a_fresh_process_draws_the_same_initial_weights():
    # Without a seed call, a new interpreter starts from PyTorch's default seed: two runs of a
    # script build the same network (the CLI and the chapter's train() agree on one epoch).
    import subprocess
    import sys
    code = ("import numpy as np, mgpu\n"
            "net = mgpu.nn.Linear(6, 3)\n"
            "w = mgpu.random.normal(size=(4,)).numpy()\n"
            "v = [net.weight.numpy().ravel(), net.bias.numpy().ravel(), w]\n"
            "print(np.concatenate(v).tobytes().hex())\n")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=True).stdout.strip() for _ in range(2)]
    assert runs[0] and runs[0] == runs[1]
    assert mgpu.random.DEFAULT_SEED == 67280421310721


def test_normal_statistics():
    mgpu.random.seed(0)
    x = mgpu.random.normal(size=(100_000,)).numpy().astype(np.float64)
    # Standard errors are 0.0032 (mean) and 0.0022 (std): these bounds are > 6 of them.
    assert abs(x.mean()) < 0.02
    assert abs(x.std() - 1.0) < 0.015
    y = mgpu.random.normal(loc=3.0, scale=0.5, size=(100_000,), device=C1).numpy()
    assert abs(y.mean() - 3.0) < 0.01
    assert abs(y.std() - 0.5) < 0.0075


# ---------------------------------------------------------------------------------------------
# asynchronous queues
# ---------------------------------------------------------------------------------------------

def test_interleaved_chains_on_two_devices():
    n = 50_000
    a = mgpu.zeros(n, device=C0)
    b = mgpu.ones(n, device=C1)
    ea = np.zeros(n, dtype=np.float64)
    eb = np.ones(n, dtype=np.float64)
    for i in range(1, 121):
        a += 1.0
        b = b * 2.0 - 1.0  # b stays 1; exercises fresh allocations on cpu(1)
        b += 1.0
        ea += 1.0
        eb = eb * 2.0 - 1.0 + 1.0
        if i % 10 == 0:
            a += b.to(C0)  # cross-device read in the middle of both chains
            ea += eb
            b[:] = 1.0
            eb[:] = 1.0
    mgpu.waitall()
    np.testing.assert_array_equal(a.numpy(), ea)
    np.testing.assert_array_equal(b.numpy(), eb)


def test_bouncing_between_devices_keeps_order():
    """cpu(0) -> cpu(1) -> cpu(0) ... with +1 each hop: every hop must see the previous one."""
    t = mgpu.zeros(100_000, device=C0)
    for _ in range(200):
        t = t.to(C1 if t.device == C0 else C0) + 1.0
    assert t.device == C0
    np.testing.assert_array_equal(t.numpy(), np.full(100_000, 200.0, dtype=np.float32))


def test_ping_pong_copyto_existing_buffers():
    """Copies into live buffers must wait for pending writes and reads on both queues."""
    a = mgpu.zeros(100_000, device=C0)
    b = mgpu.zeros(100_000, device=C1)
    for _ in range(200):
        a += 1.0
        a.copyto(b)
        b += 1.0
        b.copyto(a)
    np.testing.assert_array_equal(a.numpy(), np.full(100_000, 400.0, dtype=np.float32))
    np.testing.assert_array_equal(b.numpy(), np.full(100_000, 400.0, dtype=np.float32))


def test_chain_of_matmuls_then_waitall():
    x = mgpu.ones((64, 64), device=C1)
    for _ in range(30):
        x = mgpu.mm(x, mgpu.full((64, 64), 1.0 / 64, device=C1))
    mgpu.waitall()
    np.testing.assert_allclose(x.numpy(), np.ones((64, 64)), rtol=1e-5)
