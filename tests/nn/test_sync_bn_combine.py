"""SyncBatchNorm's combine of the replicas' statistics, one op for the book's loop and the fused
step (_core.batch_norm_combine_stats, Chan et al.'s formula in double): against the float64
combine of the same per-replica statistics it is exact to float32's rounding, at least as
accurate as the float32 combine the book's loop used before, and the book's nn.SyncBatchNorm
takes its statistics from it bitwise."""
import numpy as np

import mgpu
from mgpu import nn
from test_data_parallel import shard_rows

f32 = np.float32
COUNTS = [2 * 5 * 3, 7 * 5 * 3, 1 * 5 * 3]  # values per channel of shards of 2, 7 and 1 rows


def shards(rng, C=4):
    """Three uneven shards (N_i, C, 5, 3) whose channels sit far from zero (means 300, 307 and
    314, std 1): the case where a float32 combine loses digits."""
    return [(300.0 + 7.0 * k + rng.normal(size=(n // 15, C, 5, 3))).astype(f32)
            for k, n in enumerate(COUNTS)]


def float64_combine(means, variances, counts):
    m = np.array(means, np.float64)
    v = np.array(variances, np.float64)
    n = np.array(counts, np.float64)[:, None]
    mean = (n * m).sum(0) / n.sum()
    return mean, (n * (v + (m - mean) ** 2)).sum(0) / n.sum()


def float32_combine(means, variances, counts):
    """The book's loop's former combine, in float32 operations in its order."""
    n = sum(counts)
    mean = means[0] * f32(counts[0] / n)
    for m, c in zip(means[1:], counts[1:]):
        mean = mean + m * f32(c / n)
    var = None
    for m, v, c in zip(means, variances, counts):
        d = m - mean
        term = (v + d * d) * f32(c / n)
        var = term if var is None else var + term
    return mean, var


def test_combine_is_float64s_rounded_and_no_worse_than_the_float32_combine():
    rng = np.random.default_rng(0)
    xs = shards(rng)
    stats = [mgpu._core.batch_norm_stats(mgpu.array(x)._t) for x in xs]
    means = [mgpu.Tensor(m).numpy() for m, _ in stats]
    variances = [mgpu.Tensor(v).numpy() for _, v in stats]
    mean, var = (mgpu.Tensor(t).numpy() for t in mgpu._core.batch_norm_combine_stats(
        [m for m, _ in stats], [v for _, v in stats], [float(c) for c in COUNTS], mgpu.cpu(0)))
    ref_mean, ref_var = float64_combine(means, variances, COUNTS)
    # Within one float32 rounding of the float64 combine of the same parts.
    np.testing.assert_allclose(mean, ref_mean, rtol=2 ** -24, atol=0)
    np.testing.assert_allclose(var, ref_var, rtol=2 ** -23, atol=0)
    old_mean, old_var = float32_combine(means, variances, COUNTS)
    new_err = np.abs(mean - ref_mean).max(), np.abs(var - ref_var).max()
    old_err = np.abs(old_mean - ref_mean).max(), np.abs(old_var - ref_var).max()
    assert new_err[0] <= old_err[0] and new_err[1] <= old_err[1], (new_err, old_err)
    assert new_err[1] < old_err[1], "the float32 combine should lose digits on this data"


def test_a_replica_without_examples_adds_nothing():
    rng = np.random.default_rng(1)
    xs = shards(rng)
    stats = [mgpu._core.batch_norm_stats(mgpu.array(x)._t) for x in xs]
    nan = mgpu.array(np.full(4, np.nan, f32))._t
    with_empty = mgpu._core.batch_norm_combine_stats(
        [stats[0][0], nan, stats[1][0]], [stats[0][1], nan, stats[1][1]],
        [float(COUNTS[0]), 0.0, float(COUNTS[1])], mgpu.cpu(0))
    without = mgpu._core.batch_norm_combine_stats(
        [stats[0][0], stats[1][0]], [stats[0][1], stats[1][1]],
        [float(COUNTS[0]), float(COUNTS[1])], mgpu.cpu(0))
    for a, b in zip(with_empty, without):
        np.testing.assert_array_equal(mgpu.Tensor(a).numpy(), mgpu.Tensor(b).numpy())


def test_books_sync_batch_norm_takes_the_combined_statistics_bitwise():
    """momentum 1: the running mean is the batch mean itself (running * 0 + mean * 1). Ten rows
    over three devices: shards of 4, 3 and 3 rows."""
    rng = np.random.default_rng(2)
    X = (300.0 + rng.normal(size=(10, 4, 5, 3))).astype(f32)
    rows = shard_rows(10, 3)
    xs = np.split(X, np.cumsum(rows)[:-1])
    devices = [mgpu.cpu(0), mgpu.cpu(1), mgpu.cpu(2)]
    net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4, momentum=1.0)))
    model = nn.DataParallel(net, device_ids=devices)
    model.train()
    model(mgpu.array(X))
    stats = [mgpu._core.batch_norm_stats(mgpu.array(x)._t) for x in xs]
    mean, _ = mgpu._core.batch_norm_combine_stats(
        [m for m, _ in stats], [v for _, v in stats], [float(r * 15) for r in rows], mgpu.cpu(0))
    np.testing.assert_array_equal(net[0].running_mean.numpy(), mgpu.Tensor(mean).numpy())
