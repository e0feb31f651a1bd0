"""The chapter's printed examples (sec. 12.5.4 and 12.5.5), reproduced exactly."""
import numpy as np
import pytest

import mgpu
from mgpu import chapter


@pytest.mark.gpu  # try_gpu(i) is an emulated GPU in the emulated build
def test_get_params_b1_is_twenty_zeros_with_zero_grad():
    params = mgpu.lenet_params(scale=0.01, seed=0)
    new_params = mgpu.get_params(params, mgpu.try_gpu(0))
    b1 = new_params[1]
    assert b1.device == mgpu.try_gpu(0)
    assert repr(b1) == "[" + " ".join(["0."] * 20) + "] @" + str(mgpu.try_gpu(0))
    assert repr(b1.grad) == repr(b1)
    assert b1.grad.device == mgpu.try_gpu(0)
    # The copies are copies: changing the original leaves the device copy alone.
    params[0][:] += 1.0
    assert not np.allclose(new_params[0].numpy(), params[0].numpy())


def test_allreduce_of_ones_and_twos_leaves_threes_everywhere():
    for allreduce in (mgpu.allreduce, chapter.allreduce):
        data = [mgpu.ones((1, 2), device=mgpu.try_gpu(i)) * (i + 1) for i in range(2)]
        assert [repr(d) for d in data] == ["[[1. 1.]] @cpu(0)", "[[2. 2.]] @cpu(1)"]
        allreduce(data)
        assert [repr(d) for d in data] == ["[[3. 3.]] @cpu(0)", "[[3. 3.]] @cpu(1)"]
        assert [d.device for d in data] == [mgpu.cpu(0), mgpu.cpu(1)]


def test_split_batch_of_the_4x5_matrix():
    data = mgpu.arange(20).reshape(4, 5)
    devices = [mgpu.try_gpu(0), mgpu.try_gpu(1)]
    X_shards, y_shards = mgpu.split_batch(data, mgpu.arange(4), devices)
    assert [x.device for x in X_shards] == devices
    np.testing.assert_array_equal(X_shards[0].numpy(), [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(X_shards[1].numpy(), [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]])
    np.testing.assert_array_equal(y_shards[1].numpy(), [2, 3])
    assert repr(X_shards[1]) == "[[10. 11. 12. 13. 14.]\n [15. 16. 17. 18. 19.]] @cpu(1)"


def test_allreduce_k_devices_i_plus_one_sums_to_triangle_number():
    # Sizes 1, 7 and a prime that no device count divides.
    for k in (2, 3, 4):
        for n in (1, 7, 100_003):
            data = [mgpu.full((n,), i + 1, device=mgpu.cpu(i)) for i in range(k)]
            mgpu.allreduce(data)
            for d in data:
                a = d.numpy()
                assert a.min() == a.max() == k * (k + 1) / 2, (k, n)


def test_allreduce_random_data_against_numpy_sum_in_place():
    rng = np.random.default_rng(0)
    for k in (2, 3):
        arrays = [rng.standard_normal((37, 11)).astype(np.float32) for _ in range(k)]
        data = [mgpu.array(a, device=mgpu.cpu(i)) for i, a in enumerate(arrays)]
        ids = [id(d) for d in data]
        mgpu.allreduce(data)
        expected = np.sum(np.stack(arrays).astype(np.float64), axis=0)
        for d in data:
            np.testing.assert_allclose(d.numpy(), expected, rtol=1e-6, atol=1e-6)
        assert [id(d) for d in data] == ids
        # every device ends with bitwise the same values (one fixed summation order)
        assert all(np.array_equal(data[0].numpy(), d.numpy()) for d in data[1:])


def test_allreduce_list_per_device_is_one_flat_collective():
    grads = [[mgpu.full(s, i + 1.0, device=mgpu.cpu(i)) for s in [(3, 2), (5,), (1, 1, 4)]]
             for i in range(3)]
    mgpu.allreduce(grads)
    for per_device in grads:
        for g in per_device:
            assert np.all(g.numpy() == 6.0)


def test_split_batch_uneven_and_smaller_than_device_count():
    X = mgpu.arange(5 * 3).reshape(5, 3)
    y = mgpu.arange(5)
    devices = [mgpu.cpu(i) for i in range(3)]
    xs, ys = mgpu.split_batch(X, y, devices)
    assert [x.shape[0] for x in xs] == [2, 2, 1]
    np.testing.assert_array_equal(np.concatenate([x.numpy() for x in xs]), X.numpy())
    xs, ys = mgpu.split_batch(X[:2], y[:2], [mgpu.cpu(i) for i in range(4)])
    assert [x.shape for x in xs] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    assert [t.device for t in ys] == [mgpu.cpu(i) for i in range(4)]


@pytest.mark.gpu
def test_try_gpu_falls_back_to_virtual_cpu_devices():
    assert mgpu.num_gpus() == 0 or mgpu.try_gpu(0) == mgpu.gpu(0)
    if mgpu.num_gpus() == 0:
        assert mgpu.try_gpu(3) == mgpu.cpu(3)
        assert mgpu.try_all_gpus() == [mgpu.cpu(0)]
    assert str(mgpu.cpu(1)) == "cpu(1)" and repr(mgpu.cpu(1)) == "cpu(1)"
    assert mgpu.cpu(1) == mgpu.cpu(1) and mgpu.cpu(1) != mgpu.cpu(0)
    assert len({mgpu.cpu(0), mgpu.cpu(0), mgpu.cpu(1)}) == 2
