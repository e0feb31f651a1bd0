"""Fashion-MNIST loading from Python (sec. 12.5.6's load_data_fashion_mnist), on small IDX files
written by the test and, when installed, on the real data set."""
import gzip
import struct

import numpy as np
import pytest

import mgpu
from conftest import requires_fashion_mnist


def write_idx(path, array, compress):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


@pytest.fixture
def tiny_dataset(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (37, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 37),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (11, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, 11),
    }
    for i, (name, a) in enumerate(arrays.items()):
        write_idx(tmp_path / name, a, compress=i % 2 == 0)  # a mix of gzip and raw
    return tmp_path, arrays


def collect(loader):
    xs, ys = zip(*[(X.numpy(), y.numpy()) for X, y in loader])
    return np.concatenate(xs), np.concatenate(ys)


def test_loader_batches_values_and_shapes(tiny_dataset):
    data_dir, arrays = tiny_dataset
    train_iter, test_iter = mgpu.load_data_fashion_mnist(8, data_dir=str(data_dir))
    assert len(train_iter) == 5 and len(test_iter) == 2
    shapes = [(X.shape, X.dtype, y.shape, y.dtype, X.device) for X, y in test_iter]
    assert shapes[0] == ((8, 1, 28, 28), np.float32, (8,), np.int64, mgpu.cpu(0))
    assert shapes[1][0] == (3, 1, 28, 28)
    X, y = collect(test_iter)  # the test set is not shuffled
    images = arrays["t10k-images-idx3-ubyte"][:, None]
    np.testing.assert_array_equal(X, images.astype(np.float32) / np.float32(255))
    np.testing.assert_array_equal(y, arrays["t10k-labels-idx1-ubyte"])


def test_training_set_is_reshuffled_every_epoch_reproducibly(tiny_dataset):
    data_dir, arrays = tiny_dataset
    a, _ = mgpu.load_data_fashion_mnist(8, data_dir=str(data_dir), seed=3)
    b, _ = mgpu.load_data_fashion_mnist(8, data_dir=str(data_dir), seed=3)
    epochs_a = [collect(a) for _ in range(2)]
    epochs_b = [collect(b) for _ in range(2)]
    labels = arrays["train-labels-idx1-ubyte"]
    for X, y in epochs_a:  # every example exactly once per epoch
        assert sorted(y.tolist()) == sorted(labels.tolist())
        assert X.shape == (37, 1, 28, 28)
    assert not np.array_equal(epochs_a[0][1], epochs_a[1][1]) or \
        not np.array_equal(epochs_a[0][0], epochs_a[1][0]), "epochs 0 and 1 in the same order"
    for (Xa, ya), (Xb, yb) in zip(epochs_a, epochs_b):
        np.testing.assert_array_equal(Xa, Xb)
        np.testing.assert_array_equal(ya, yb)


def test_limit_batches_and_mgpu_data_environment(tiny_dataset, monkeypatch):
    data_dir, _ = tiny_dataset
    monkeypatch.setenv("MGPU_DATA", str(data_dir))
    train_iter, _ = mgpu.load_data_fashion_mnist(8, limit_batches=2)
    assert mgpu.data.find_data_dir() == str(data_dir)
    assert len(train_iter) == 2 and sum(1 for _ in train_iter) == 2


def test_missing_data_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        mgpu.load_data_fashion_mnist(8, data_dir=str(tmp_path))


def test_batches_train_end_to_end_on_two_devices(tiny_dataset):
    data_dir, _ = tiny_dataset
    data = mgpu.load_data_fashion_mnist(8, data_dir=str(data_dir))
    result = mgpu.train(2, 8, 0.1, num_epochs=2, data=data, progress=False)
    assert len(result.test_acc) == 2 and 0.0 <= result.test_acc[-1] <= 1.0
    assert np.isfinite(result.train_loss).all()


@requires_fashion_mnist
def test_real_fashion_mnist_shapes_and_labels():
    train_images, train_labels, test_images, test_labels = mgpu.data.load_fashion_mnist_arrays()
    assert train_images.shape == (60000, 28, 28) and test_images.shape == (10000, 28, 28)
    assert np.bincount(train_labels, minlength=10).tolist() == [6000] * 10
    assert set(np.unique(test_labels).tolist()) == set(range(10))
    train_iter, test_iter = mgpu.load_data_fashion_mnist(256)
    assert len(train_iter) == 235 and len(test_iter) == 40


def test_fused_and_op_by_op_training_reach_the_same_accuracy(tiny_dataset):
    """The same seed, data and steps: the fused and the chapter's op-by-op step train alike."""
    data_dir, _ = tiny_dataset
    runs = []
    for fn in (mgpu.train, mgpu.train_op_by_op):
        data = mgpu.load_data_fashion_mnist(8, data_dir=str(data_dir), seed=1)
        runs.append(fn(2, 8, 0.5, num_epochs=2, data=data, progress=False,
                       params=mgpu.lenet_params(scale=0.3, seed=1)))
    fused, op_by_op = runs
    assert fused.test_acc == op_by_op.test_acc
    assert np.isfinite(fused.train_loss).all() and np.isnan(op_by_op.train_loss).all()
