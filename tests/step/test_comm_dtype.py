"""Gradients all-reduced in bfloat16 (``comm_dtype="bf16"``) in the fused step: the reduced
gradient is the bfloat16 rounding of the float32 sum of the replicas' bfloat16-rounded gradients
(checked exactly against a NumPy reference on a network whose step shows its gradients), half the
bytes of float32 (counted), the same bits on 1, 2 and 3 CPU devices in deterministic mode, float32
by default unchanged, the plumbing (train_concise, checkpoints, the CLI) and clear errors. The
bucketed all-reduce's bfloat16 paths: test_comm_dtype_bucketed.py, test_comm_dtype_dist.py."""
import numpy as np
import pytest

import dist_worker
import mgpu
from mgpu import nn, optim
from mgpu.parallel import FusedModel
from test_accumulate import batches
from test_bfloat16 import reference_bits, widened
from test_deterministic import assert_bitwise
from test_optim import concise_run

CPUS = [mgpu.cpu(i) for i in range(3)]
LINEAR = [("flatten",), ("linear", {"transpose": True})]


def bf16(x):
    """float32 x rounded to bfloat16, as float32 (the reference rounding)."""
    x = np.asarray(x, np.float32)
    return widened(reference_bits(x)).reshape(x.shape)


def ranges(n, k):
    """shard_ranges(n, k): k contiguous row ranges, the first n % k one row longer."""
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    ends = np.cumsum([0] + sizes)
    return list(zip(ends[:-1], ends[1:]))


def linear_problem(n=12, features=30, classes=10, seed=3):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 1, 5, 6)).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    return X, y


def replica_grads(X, y, classes=10):
    """float64 gradients of the summed softmax cross-entropy of a zero linear layer (W (K, F),
    b (K,)): the softmax is uniform, so dz = 1/K - onehot(y)."""
    F = X[0].size
    dz = np.full((len(y), classes), 1.0 / classes)
    dz[np.arange(len(y)), y] -= 1.0
    return dz.T @ X.reshape(len(y), F).astype(np.float64), dz.sum(axis=0)


def linear_step(devices, comm_dtype, deterministic=False, lr=None):
    """One plain-SGD step of a zero linear layer on `devices`; returns -(p_after) / (lr / N):
    exactly the reduced gradient sum (lr / N a power of two)."""
    X, y = linear_problem()
    n = len(y)
    lr = lr if lr is not None else n / 64.0
    params = [np.zeros((10, X[0].size), np.float32), np.zeros(10, np.float32)]
    replicas = [[mgpu.array(a, device=d) for a in params] for d in devices]
    model = FusedModel(LINEAR, replicas, [[] for _ in devices], devices)
    model.train_step(mgpu.array(X), mgpu.array(y), lr=lr, deterministic=deterministic,
                     comm_dtype=comm_dtype)
    return [-p.numpy() * np.float32(64.0) for p in replicas[-1]], X, y


@pytest.mark.parametrize("k", [2, 3])
def test_shared_update_sums_rounded_gradients_and_rounds_the_sum(k):
    got, X, y = linear_step(CPUS[:k], "bf16")
    parts = [replica_grads(X[a:b], y[a:b]) for a, b in ranges(len(y), k)]  # replica d's rows
    for i in range(2):
        acc = np.zeros_like(parts[0][i], dtype=np.float32)
        for p in parts:  # device order, float32 sums of bfloat16 values
            acc = (acc + bf16(p[i].astype(np.float32))).astype(np.float32)
        want = bf16(acc)
        assert np.array_equal(got[i].view(np.uint32) & 0xffff, np.zeros_like(got[i], np.uint32)), \
            "the reduced gradient is not on the bfloat16 grid"
        # The replicas' float32 gradients differ from float64's in the last bits, which can move
        # a rounding to its neighbour: at most one bfloat16 step apart, almost all equal.
        step = np.abs(want) * 2.0**-7 + 1e-30
        assert (np.abs(got[i] - want) <= step).all()
        assert np.mean(got[i] == want) > 0.95, np.mean(got[i] == want)
    f32, _, _ = linear_step(CPUS[:k], "float32")
    assert not all(np.array_equal(a, b) for a, b in zip(got, f32))
    # Each part is off by at most half a bfloat16 step (2^-9 relative), the sum by one more.
    bound = [sum(np.abs(p[i]) for p in parts) * 2.0**-8 + np.abs(f32[i]) * 2.0**-8
             for i in range(2)]
    assert all((np.abs(got[i] - f32[i]) <= bound[i] + 1e-7).all() for i in range(2))


def test_deterministic_tree_rounds_every_node():
    """4 shards on 2 devices: leaves and partial sums rounded to bfloat16, the tree's additions
    in float32: ((s0 + s1) + (s2 + s3)), each node rounded."""
    got, X, y = linear_step(CPUS[:2], "bf16", deterministic=4)
    leaves = [[bf16(g.astype(np.float32)) for g in replica_grads(X[a:b], y[a:b])]
              for a, b in ranges(len(y), 4)]
    for i in range(2):
        left = bf16(leaves[0][i] + leaves[1][i])
        right = bf16(leaves[2][i] + leaves[3][i])
        want = bf16(left + right)
        step = np.abs(want) * 2.0**-7 + 1e-30
        assert (np.abs(got[i] - want) <= step).all() and np.mean(got[i] == want) > 0.95


def _counted_steps(devices, comm_dtype, deterministic=False, monkeypatch=None):
    net = dist_worker.bn_net()
    dp = nn.DataParallel(net, device_ids=devices)
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss = nn.CrossEntropyLoss()
    data = batches(3)
    dp.train_step(mgpu.array(data[0][0]), mgpu.array(data[0][1]), loss, trainer,
                  deterministic=deterministic, comm_dtype=comm_dtype)  # warm
    mgpu.waitall()
    c0 = mgpu._core._collective_counts()
    for Xn, yn in data[1:]:
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), loss, trainer, deterministic=deterministic,
                      comm_dtype=comm_dtype)
    mgpu.waitall()
    c1 = mgpu._core._collective_counts()
    return (c1[0] - c0[0], c1[1] - c0[1]), [p.numpy() for p in net.parameters()]


@pytest.mark.parametrize("deterministic", [False, 8], ids=["shared", "deterministic"])
def test_bf16_halves_the_bytes_of_every_reduction(deterministic):
    (calls32, bytes32), p32 = _counted_steps(CPUS[:2], "float32", deterministic)
    (calls16, bytes16), p16 = _counted_steps(CPUS[:2], "bf16", deterministic)
    assert calls16 == calls32 >= 2 and bytes32 > 0
    assert bytes16 * 2 == bytes32, (bytes16, bytes32)
    assert any(not np.array_equal(a, b) for a, b in zip(p16, p32))


def test_float32_stays_the_default_bit_for_bit():
    (_, _), default = _counted_steps(CPUS[:2], "float32")
    net = dist_worker.bn_net()
    dp = nn.DataParallel(net, device_ids=CPUS[:2])
    trainer = optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for Xn, yn in batches(3):
        dp.train_step(mgpu.array(Xn), mgpu.array(yn), nn.CrossEntropyLoss(), trainer)
    assert_bitwise([p.numpy() for p in net.parameters()], default, "default comm_dtype")


def test_deterministic_bf16_gives_the_same_bits_on_1_2_3_devices():
    runs = [_counted_steps(CPUS[:k], "bf16", deterministic=8)[1] for k in (1, 2, 3)]
    assert_bitwise(runs[1], runs[0], "2 devices against 1")
    assert_bitwise(runs[2], runs[0], "3 devices against 1")
    f32 = _counted_steps(CPUS[:1], "float32", deterministic=8)[1]
    assert any(not np.array_equal(a, b) for a, b in zip(runs[0], f32))


@pytest.mark.gpu
@pytest.mark.skipif(mgpu.num_gpus() < 1, reason="needs a GPU (the emulated build has them)")
def test_gpus_deterministic_bf16_keep_their_bits():
    """GPUs run the rounding and the tree's partial sums (bfloat16 between GPUs) as CPU devices
    do; the GPUs' bits are their own kernels' (as in float32), the same on 1 and 2 GPUs. (The
    GPUs' bucketed all-reduce in bfloat16: test_comm_dtype_bucketed.py.)"""
    gpus = [mgpu.gpu(i) for i in range(min(2, mgpu.num_gpus()))]
    (calls, nbytes), one = _counted_steps(gpus[:1], "bf16", deterministic=8)
    f32 = _counted_steps(gpus[:1], "float32", deterministic=8)[1]
    assert any(not np.array_equal(a, b) for a, b in zip(one, f32))
    if len(gpus) > 1:
        (c16, b16), two = _counted_steps(gpus, "bf16", deterministic=8)
        (c32, b32), _ = _counted_steps(gpus, "float32", deterministic=8)
        assert_bitwise(two, one, "2 GPUs against 1")
        assert c16 == c32 >= 2 and b16 * 2 == b32


def test_bad_comm_dtype_and_unsupported_paths_are_refused():
    with pytest.raises(ValueError, match="comm_dtype must be 'float32' or 'bf16'.*'float16'"):
        _counted_steps(CPUS[:2], "float16")
    with pytest.raises(ValueError, match="comm_dtype='bf16' needs fused=True"):
        concise_run(None, None, comm_dtype="bf16")


def test_train_concise_records_comm_dtype_and_refuses_a_resume_with_another(tmp_path):
    got = concise_run(tmp_path, "c", fused=True, comm_dtype="bf16")
    again = concise_run(tmp_path, "c", fused=True, comm_dtype="bf16")  # resumes a finished run
    for k in got:
        np.testing.assert_array_equal(again[k], got[k], err_msg=k)
    state = mgpu.load(sorted((tmp_path / "c").glob("*.mgpu"))[-1])
    assert state["config"]["comm_dtype"] == "bf16"
    from mgpu.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match="comm_dtype='bf16'.*--comm-dtype"):
        concise_run(tmp_path, "c", fused=True)


def test_cli_passes_comm_dtype_and_refuses_it_for_lenet(monkeypatch, capsys):
    from mgpu.cli import main
    seen = {}
    monkeypatch.setattr(mgpu.chapter, "train_concise", lambda *a, **kw: seen.update(kw))
    assert main(["train", "--model", "resnet18", "--fused", "--comm-dtype", "bf16",
                 "--epochs", "1"]) == 0
    assert seen["comm_dtype"] == "bf16" and seen["fused"]
    assert main(["train", "--comm-dtype", "bf16", "--epochs", "1"]) == 2
    assert "--comm-dtype bf16 needs --model resnet18 --fused" in capsys.readouterr().err
