"""Every user mistake the chapter's code can make (D2L 12.5) is a clear Python exception: the
expected type, and a message naming the problem. Errors raised inside a device queue surface at
the next wait. After any error the library keeps working: an autouse fixture runs a small op on
both devices after every test and checks its value."""

import os
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mgpu

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)


def assert_alive():
    """Both device queues still run work and give exact results, with no error left pending."""
    mgpu.waitall()
    for d in (C0, C1):
        t = mgpu.arange(5, device=d) * 2.0 + 1.0
        np.testing.assert_array_equal(t.numpy(), [1.0, 3.0, 5.0, 7.0, 9.0])
    moved = mgpu.full((3,), 4.0, device=C1).to(C0) - 1.0
    np.testing.assert_array_equal(moved.numpy(), [3.0, 3.0, 3.0])
    mgpu.waitall()


@pytest.fixture(autouse=True)
def still_works_afterwards():
    yield
    assert_alive()


def ones(shape, device=C0):
    return mgpu.ones(shape, device=device)


# ---------------------------------------------------------------------------------------------
# ops: shapes, dtypes, devices
# ---------------------------------------------------------------------------------------------

def test_conv2d_with_a_2d_image():
    with pytest.raises(ValueError, match=r"4 dims.*\(28, 28\).*reshape\(1, 1"):
        mgpu.conv2d(ones((28, 28)), ones((6, 1, 3, 3)))


def test_conv2d_channel_mismatch():
    with pytest.raises(ValueError, match=r"2 channels.*expects 3"):
        mgpu.conv2d(ones((1, 2, 5, 5)), ones((4, 3, 3, 3)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(stride=0), "stride must be >= 1"),
    (dict(padding=-1), "padding must be >= 0"),
    (dict(stride=(1, 2)), "stride must be the same on both axes"),
])
def test_conv2d_bad_stride_or_padding(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mgpu.conv2d(ones((1, 1, 5, 5)), ones((1, 1, 3, 3)), **kwargs)


def test_conv2d_bad_bias_and_kernel_larger_than_image():
    with pytest.raises(ValueError, match=r"b must have shape \(2,\)"):
        mgpu.conv2d(ones((1, 1, 5, 5)), ones((2, 1, 3, 3)), ones((3,)))
    with pytest.raises(ValueError, match="larger than the padded"):
        mgpu.conv2d(ones((1, 1, 2, 2)), ones((1, 1, 3, 3)))


def test_avg_pool2d_errors():
    with pytest.raises(ValueError, match="4 dims"):
        mgpu.avg_pool2d(ones((4, 4)), 2)
    with pytest.raises(ValueError, match="larger than the 2x2 input"):
        mgpu.avg_pool2d(ones((1, 1, 2, 2)), 3)


def test_mm_inner_dims_differ():
    with pytest.raises(ValueError, match=r"inner dimensions differ.*\(2, 3\).*\(4, 5\)"):
        mgpu.mm(ones((2, 3)), ones((4, 5)))


def test_mm_with_a_3d_tensor():
    with pytest.raises(ValueError, match=r"matrices \(2 dims\).*\(2, 3, 4\).*reshape"):
        mgpu.mm(ones((2, 3, 4)), ones((4, 5)))


def test_float_only_ops_reject_integer_tensors():
    ints = mgpu.array([[1, 2]])
    with pytest.raises(TypeError, match="float32.*int64"):
        mgpu.relu(ints)
    with pytest.raises(TypeError, match="float32.*int64"):
        mgpu.mm(ints, mgpu.array([[1], [2]]))
    with pytest.raises(TypeError, match="float32"):
        ints.requires_grad_()


def test_cross_entropy_float_labels():
    with pytest.raises(TypeError, match="int32 or int64.*float32"):
        mgpu.cross_entropy(ones((2, 3)), mgpu.array([0.0, 1.0]))


def test_cross_entropy_labels_of_wrong_length():
    with pytest.raises(ValueError, match=r"shape \(2,\).*got \(3,\)"):
        mgpu.cross_entropy(ones((2, 3)), mgpu.array([0, 1, 2]))


def test_cross_entropy_1d_logits():
    with pytest.raises(ValueError, match="2 dims"):
        mgpu.cross_entropy(ones((3,)), mgpu.array([0]))


@pytest.mark.parametrize("device", [C0, C1], ids=str)
@pytest.mark.parametrize("bad", [7, -1])
def test_out_of_range_label_surfaces_at_the_next_wait(device, bad):
    losses = mgpu.cross_entropy(ones((2, 3), device), mgpu.array([0, bad], device=device))
    where = re.escape(str(device))
    with pytest.raises(IndexError, match=rf"cross_entropy on {where} failed.*label {bad} in row 1 "
                                         r"is out of range for 3 classes"):
        losses.numpy()
    mgpu.waitall()  # the error was reported once; the queue is clean again


def test_out_of_range_label_surfaces_in_waitall_and_in_backward():
    mgpu.cross_entropy(ones((2, 3), C1), mgpu.array([5, 0], device=C1))
    with pytest.raises(IndexError, match="label 5"):
        mgpu.waitall()
    z = ones((2, 4)).requires_grad_()
    mgpu.cross_entropy(z, mgpu.array([0, 4])).sum().backward()
    with pytest.raises(IndexError, match="label 4"):
        z.grad.numpy()


def test_out_of_range_label_then_dependent_ops_on_the_same_device():
    losses = mgpu.cross_entropy(ones((2, 3)), mgpu.array([3, 0]))
    total = losses.sum() * 2.0
    with pytest.raises(IndexError, match="label 3"):
        total.item()


def test_out_of_range_label_on_one_device_reaches_a_result_on_another():
    bad = mgpu.cross_entropy(ones((2, 3), C1), mgpu.array([0, 5], device=C1))
    x = bad.to(C0) + 1.0
    try:
        with pytest.raises(IndexError, match="label 5"):
            x.numpy()
    finally:
        try:
            mgpu.waitall()
        except IndexError:
            pass


@pytest.mark.parametrize("op", [
    lambda a, b: a + b,
    lambda a, b: a * b,
    lambda a, b: mgpu.mm(a, b),
    lambda a, b: mgpu.conv2d(a.reshape(1, 1, 3, 3), b.reshape(1, 1, 3, 3)),
], ids=["add", "mul", "mm", "conv2d"])
def test_ops_mixing_devices(op):
    with pytest.raises(ValueError, match=r"one device.*cpu\(0\).*cpu\(1\)"):
        op(ones((3, 3), C0), ones((3, 3), C1))


def test_cross_entropy_labels_on_another_device_and_inplace_mixing():
    with pytest.raises(ValueError, match="one device"):
        mgpu.cross_entropy(ones((2, 3), C0), mgpu.array([0, 1], device=C1))
    t = ones((3,), C0)
    with pytest.raises(ValueError, match="one device"):
        t += ones((3,), C1)
    np.testing.assert_array_equal(t.numpy(), [1.0, 1.0, 1.0])  # unchanged by the failed op


@pytest.mark.parametrize("a, b", [((3, 4), (4, 3)), ((3, 4), (3,)), ((2, 3), (6,))])
def test_binary_ops_with_incompatible_shapes(a, b):
    with pytest.raises(ValueError, match=r"shapes .* do not match"):
        ones(a) + ones(b)
    with pytest.raises(ValueError, match=r"shapes .* do not match"):
        ones(a) / ones(b)


def test_inplace_op_with_incompatible_shape():
    t = ones((2, 3))
    with pytest.raises(ValueError, match=r"shape \(3, 2\) must equal the target's shape \(2, 3\)"):
        t += ones((3, 2))


def test_mixed_dtypes():
    with pytest.raises(TypeError, match="float32.*int32"):
        ones((2,)) + mgpu.array([1, 2], dtype=np.int32)


def test_argmax_other_axis():
    with pytest.raises(ValueError, match="only the last axis"):
        mgpu.argmax(ones((2, 3)), axis=0)


def test_cross_entropy_loss_bad_reduction():
    with pytest.raises(ValueError, match="reduction must be"):
        mgpu.CrossEntropyLoss(reduction="avg")


# ---------------------------------------------------------------------------------------------
# allreduce, split_batch, train_batch, sgd
# ---------------------------------------------------------------------------------------------

def test_allreduce_different_shapes():
    with pytest.raises(ValueError, match="equal shapes"):
        mgpu.allreduce([ones((3,), C0), ones((4,), C1)])


def test_allreduce_two_tensors_on_one_device():
    a, b = ones((3,), C0), ones((3,), C0)
    with pytest.raises(ValueError, match=r"two tensors are on cpu\(0\)"):
        mgpu.allreduce([a, b])
    np.testing.assert_array_equal(a.numpy(), [1.0, 1.0, 1.0])


def test_allreduce_grad_that_is_none():
    p = ones((3,), C0).requires_grad_()  # no backward yet, so p.grad is None
    q = ones((3,), C1).attach_grad()
    with pytest.raises(TypeError, match="None"):
        mgpu.allreduce([p.grad, q.grad])


def test_allreduce_empty_and_integer():
    with pytest.raises(ValueError, match="non-empty list"):
        mgpu.allreduce([])
    with pytest.raises(TypeError, match="float32"):
        mgpu.allreduce([ones((3,), C0), mgpu.array([1, 2, 3], device=C1)])


def test_split_batch_lengths_differ():
    with pytest.raises(ValueError, match=r"same number of examples.*\(4, 2\).*\(3,\)"):
        mgpu.split_batch(ones((4, 2)), mgpu.array([0, 1, 2]), [C0, C1])


def test_split_batch_without_devices():
    with pytest.raises(ValueError, match="list of devices is empty"):
        mgpu.split_batch(ones((4, 2)), mgpu.array([0, 1, 2, 3]), [])


def test_train_batch_replicas_and_devices_differ():
    params = mgpu.lenet_params(seed=0)
    X, y = ones((4, 1, 28, 28)), mgpu.array([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"1 parameter replicas for 2 devices"):
        mgpu.train_batch(X, y, [params], [C0, C1], 0.1)
    with pytest.raises(ValueError, match="list of devices is empty"):
        mgpu.train_batch(X, y, [], [], 0.1)


def test_lenet_with_missing_parameters():
    with pytest.raises(ValueError, match="8 param"):
        mgpu.lenet(ones((1, 1, 28, 28)), mgpu.lenet_params(seed=0)[:7])


def test_sgd_without_gradients():
    with pytest.raises(ValueError, match="no gradient"):
        mgpu.sgd([ones((2,))], 0.1, 1)


# ---------------------------------------------------------------------------------------------
# devices, tensors, autograd
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(mgpu.num_gpus() > 0, reason="this machine has a GPU")
def test_unknown_gpu():
    with pytest.raises(IndexError, match=r"gpu\(0\).*num_gpus.*try_gpu"):
        mgpu.gpu(0)
    with pytest.raises(IndexError, match="num_gpus"):
        mgpu.ones(2, device="gpu:0")
    assert mgpu.try_gpu(0) == C0
    assert mgpu.try_all_gpus() == [C0]


@pytest.mark.parametrize("index", [-1, 64, 1000])
def test_unknown_cpu(index):
    with pytest.raises(IndexError, match=rf"cpu\({index}\) does not exist"):
        mgpu.cpu(index)


def test_bad_device_arguments():
    with pytest.raises(TypeError, match="expected a device"):
        mgpu.ones(2, device="tpu")
    with pytest.raises(IndexError, match=r"cpu\(99\)"):
        ones((2,)).to("cpu:99")


def test_reshape_incompatible():
    t = mgpu.arange(6)
    with pytest.raises(ValueError, match=r"cannot view shape \(6,\).*\(4, 2\)"):
        t.reshape(4, 2)
    with pytest.raises(ValueError, match="only one dimension may be -1"):
        t.reshape(-1, -1)
    with pytest.raises(ValueError, match="cannot view"):
        t.reshape(-1, 4)
    assert t.shape == (6,)


def test_item_on_many_elements():
    with pytest.raises(ValueError, match=r"item\(\).*6 elements.*\(2, 3\)"):
        ones((2, 3)).item()


def test_unsupported_indexing():
    t = ones((4, 2))
    with pytest.raises(IndexError, match="step-1"):
        t[::2]
    with pytest.raises(IndexError, match="axis 0"):
        t[:, 1]
    with pytest.raises(IndexError, match="out of range"):
        t[-5]


def test_unsupported_dtypes():
    with pytest.raises(TypeError, match="complex128"):
        mgpu.array(np.ones(2, dtype=complex))
    with pytest.raises(TypeError, match="float64"):
        mgpu.array([1.0], dtype=np.float64)
    with pytest.raises(ValueError, match="negative dimension"):
        mgpu.zeros((2, -1))


def test_copy_mismatches():
    with pytest.raises(ValueError,
                       match=r"target has shape \(4,\) but this tensor has shape \(3,\)"):
        ones((3,)).copyto(mgpu.zeros(4))
    with pytest.raises(TypeError, match="dtypes differ"):
        ones((3,)).copyto(mgpu.zeros(3, dtype=np.int64))


def test_setitem_with_a_different_shape():
    t = mgpu.zeros((2, 3))
    with pytest.raises(ValueError, match="shape"):
        t[:] = mgpu.arange(6).reshape(3, 2)


def test_backward_of_a_tensor_without_grad():
    with pytest.raises(RuntimeError, match="does not require grad"):
        ones((3,)).sum().backward()


def test_backward_with_a_gradient_of_the_wrong_shape():
    x = ones((3,)).requires_grad_()
    try:
        with pytest.raises(ValueError, match="shape"):
            (x * 2.0).backward(ones((4,)))
    finally:
        assert x.grad is None or x.grad.shape == (3,), f"x.grad has shape {x.grad.shape}"


def test_from_dlpack_errors():
    with pytest.raises(ValueError, match="not contiguous"):
        mgpu.from_dlpack(np.ones((4, 4), dtype=np.float32)[:, ::2])
    # A refused element type is named as users know it, with what to do instead.
    for dtype, name in [(np.float64, "float64"), (np.float16, "float16"), (np.int8, "int8"),
                        (np.uint16, "uint16"), (np.bool_, "bool"), (np.complex64, "complex64")]:
        with pytest.raises(TypeError, match=f"unsupported element type {name}; mgpu holds "
                           "float32, bfloat16, int32, int64 or uint8 \\(convert first"):
            mgpu.from_dlpack(np.ones(3, dtype=dtype))
    readonly = np.ones(3, dtype=np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="refused to export"):
        mgpu.from_dlpack(readonly)


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST files
# ---------------------------------------------------------------------------------------------

FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


def write_idx(path, array):
    a = np.asarray(array, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(bytes([0, 0, 0x08, a.ndim]))
        f.write(struct.pack(">" + "i" * a.ndim, *a.shape))
        f.write(a.tobytes())


def write_dataset(directory, n=6, seed=0):
    rng = np.random.default_rng(seed)
    for name in FILES:
        shape = (n, 28, 28) if "images" in name else (n,)
        write_idx(os.path.join(directory, name), rng.integers(0, 10 if "labels" in name else 256,
                                                              size=shape))


def test_fashion_mnist_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"(?s)not found.*dataset-fashion-mnist"):
        mgpu.load_data_fashion_mnist(256, data_dir=str(tmp_path))


def test_a_valid_tiny_dataset_loads(tmp_path):
    """The control for the tests below: the files they damage load when intact."""
    write_dataset(tmp_path)
    train_iter, test_iter = mgpu.load_data_fashion_mnist(4, data_dir=str(tmp_path))
    shapes = [(X.shape, y.shape, y.dtype) for X, y in train_iter]
    assert shapes == [((4, 1, 28, 28), (4,), np.int64), ((2, 1, 28, 28), (2,), np.int64)]
    assert len(test_iter) == 2


@pytest.mark.parametrize("victim", FILES)
def test_fashion_mnist_corrupt_file(tmp_path, victim):
    write_dataset(tmp_path)
    with open(tmp_path / victim, "wb") as f:
        f.write(b"\x12\x34\x56\x78 this is not an IDX file")
    with pytest.raises(ValueError, match=rf"{victim}.*not an IDX file"):
        mgpu.load_data_fashion_mnist(4, data_dir=str(tmp_path))


@pytest.mark.parametrize("keep, match", [(-100, "truncated: its header promises"),
                                         (6, "truncated inside its header")],
                         ids=["data", "header"])
def test_fashion_mnist_truncated_file(tmp_path, keep, match):
    write_dataset(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match=rf"t10k-images-idx3-ubyte.*{match}"):
        mgpu.load_data_fashion_mnist(4, data_dir=str(tmp_path))


def test_fashion_mnist_images_and_labels_disagree(tmp_path):
    write_dataset(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(5))
    with pytest.raises(ValueError, match=r"6 images.*train-labels-idx1-ubyte.*5 labels"):
        mgpu.load_data_fashion_mnist(4, data_dir=str(tmp_path))


def test_fashion_mnist_resize_is_refused(tmp_path):
    with pytest.raises(ValueError, match="resize is not supported"):
        mgpu.load_data_fashion_mnist(4, resize=32, data_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# the interpreter survives: queued work and pending errors at exit
# ---------------------------------------------------------------------------------------------

def run_python(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)


def test_exit_with_a_pending_error_and_queued_elementwise_work():
    r = run_python("""
        import mgpu
        mgpu.cross_entropy(mgpu.ones((2, 3), device=mgpu.cpu(1)),
                           mgpu.array([0, 5], device=mgpu.cpu(1)))
        xs = [mgpu.ones((1 << 18,), device=mgpu.cpu(d)) for d in (0, 1)]
        for _ in range(100):
            xs = [x * 1.0 + 0.0 for x in xs]
        print("done")
    """)
    assert r.returncode == 0, f"exit code {r.returncode}, stderr: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "done"


def test_exit_with_queued_matrix_products():
    # The crash is a race, so try a few times (each run fails with probability ~0.4 here) and
    # stop at the first crash.
    code = """
        import mgpu
        x = mgpu.ones((256, 256))
        w = mgpu.full((256, 256), 1.0 / 256)
        for _ in range(200):
            x = mgpu.mm(x, w)
        print("done")
    """
    for _ in range(16):
        r = run_python(code)
        assert r.returncode == 0, f"exit code {r.returncode}, stderr: {r.stderr[-2000:]}"
        assert r.stdout.strip() == "done"
