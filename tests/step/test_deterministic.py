"""Device-count-invariant training: ``deterministic=True`` cuts every batch into a fixed
set of logical shards and adds their gradients in one fixed tree, so 1, 2, 3, 4 CPU devices,
2 processes x 2 devices, and 1, 2, 3 emulated GPUs each give bitwise the same parameters."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dist_worker
import mgpu
import test_distributed as td
from conftest import assert_close
from mgpu import nn, optim
from mgpu.parallel import DEFAULT_SHARDS

CPUS = [mgpu.cpu(i) for i in range(4)]


def assert_bitwise(got, expected, what):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, f"{what}: array {i} has shape {g.shape}, expected {e.shape}"
        if not np.array_equal(g, e):
            diff = float(np.max(np.abs(g.astype(np.float64) - e)))
            pytest.fail(f"{what}: array {i} differs (max abs difference {diff:.3g})")


@pytest.fixture(scope="module")
def lenet_one_device():
    return dist_worker.deterministic_lenet(CPUS[:1])


@pytest.mark.parametrize("k", [2, 3, 4])
def test_lenet_50_steps_give_the_same_bits_on_k_cpu_devices(k, lenet_one_device):
    got = dist_worker.deterministic_lenet(CPUS[:k])
    assert_bitwise(got, lenet_one_device, f"LeNet, {k} devices against 1")
    assert not np.array_equal(got[4], mgpu.lenet_params(seed=0)[4].numpy()), "W3 never moved"


def test_lenet_replicas_agree_and_every_step_loss_is_whole(lenet_one_device):
    first, last, losses = lenet_one_device[:8], lenet_one_device[8:16], lenet_one_device[16]
    assert_bitwise(last, first, "replica 0 against the last replica")
    assert len(losses) == 51 and np.all(np.isfinite(losses))
    assert losses[-10:].mean() < losses[:10].mean(), "50 steps should lower the loss"


def test_deterministic_lenet_step_is_the_ordinary_step_up_to_rounding():
    """Same math, other summation order: one deterministic step on 2 devices against the
    default step (one shard per device), and the loss is the batch's whole summed loss."""
    Xn, yn, params = dist_worker.problem(37)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    a = [mgpu.get_params(params, d) for d in CPUS[:2]]
    b = [mgpu.get_params(params, d) for d in CPUS[:2]]
    la = mgpu.train_batch(X, y, a, CPUS[:2], lr=0.3)
    lb = mgpu.train_batch(X, y, b, CPUS[:2], lr=0.3, deterministic=True)
    for i, (p, q) in enumerate(zip(a[1], b[1])):
        assert_close(q.numpy(), p.numpy(), "sum", f"param {i}")
    assert lb[1].item() == 0.0
    assert lb[0].item() == pytest.approx(sum(v.item() for v in la), rel=1e-5)


def test_the_shard_count_matters_and_is_checked():
    Xn, yn, params = dist_worker.problem(37)
    X, y = mgpu.array(Xn), mgpu.array(yn)
    out = []
    for shards in (4, 8):
        reps = [mgpu.get_params(params, mgpu.cpu(0))]
        mgpu.train_batch(X, y, reps, [mgpu.cpu(0)], lr=0.3, deterministic=shards)
        out.append(reps[0][0].numpy())
    assert not np.array_equal(out[0], out[1]), "4 and 8 shards sum in different trees"
    reps = [mgpu.get_params(params, mgpu.cpu(0))]
    with pytest.raises(ValueError, match="logical shards >= 1"):
        mgpu.train_batch(X, y, reps, [mgpu.cpu(0)], lr=0.3, deterministic=0)
    with pytest.raises(TypeError, match="deterministic must be True, False or a number"):
        mgpu.train_batch(X, y, reps, [mgpu.cpu(0)], lr=0.3, deterministic="yes")
    assert DEFAULT_SHARDS == 8


def test_a_shard_count_that_is_no_power_of_two_is_invariant_too():
    """7 shards: the tree's right spine has uneven nodes ([4, 7) = [4, 6) + [6, 7))."""
    Xn, yn, params = dist_worker.problem(45)
    out = []
    for k in (1, 3, 4):
        reps = [mgpu.get_params(params, d) for d in CPUS[:k]]
        for n in (45, 45, 20, 6):
            mgpu.train_batch(mgpu.array(Xn[:n]), mgpu.array(yn[:n].astype(np.int32)), reps,
                             CPUS[:k], lr=0.3, deterministic=7)
        out.append([p.numpy() for p in reps[-1]])
    assert_bitwise(out[1], out[0], "7 shards, 3 devices against 1")
    assert_bitwise(out[2], out[0], "7 shards, 4 devices against 1")


@pytest.fixture(scope="module")
def bn_one_device():
    return dist_worker.deterministic_bn(CPUS[:1])


@pytest.mark.parametrize("k", [2, 3, 4])
def test_residual_net_with_batch_norm_same_bits_through_data_parallel(k, bn_one_device):
    got = dist_worker.deterministic_bn(CPUS[:k])
    assert_bitwise(got, bn_one_device, f"residual net, {k} devices against 1")


def test_batch_norm_is_per_logical_shard():
    """With S shards on one device, batch norm sees what S devices see in the default step (one
    shard each): equal to float rounding, and running statistics from the first shard."""
    devices4 = CPUS[:4]
    results = []
    for devices, shards in ((CPUS[:1], 4), (devices4, False)):
        net = dist_worker.bn_net()
        dp = nn.DataParallel(net, device_ids=devices)
        trainer = optim.SGD(net.parameters(), lr=0.1)
        rng = np.random.default_rng(5)
        X = mgpu.array(rng.standard_normal((22, 1, 8, 8)).astype(np.float32))
        y = mgpu.array(rng.integers(0, 10, size=22).astype(np.int32))
        dp.train_step(X, y, nn.CrossEntropyLoss(), trainer, deterministic=shards)
        results.append([t.numpy() for t in list(net.parameters()) + list(net.buffers())])
    for i, (a, b) in enumerate(zip(*results)):
        assert_close(a, b, "sum", f"state {i}")


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_chapters_op_by_op_step_in_shard_order_gives_the_fused_bits(k):
    """chapter.train_batch_sharded (autograd, op by op, the same shards and tree) equals the fused
    deterministic step bit for bit on every device count, over steps with an uneven batch."""
    Xn, yn, params = dist_worker.problem(37)
    devices = CPUS[:k]
    a = [mgpu.get_params(params, d) for d in devices]
    b = [mgpu.get_params(params, d) for d in devices]
    for n in (37, 37, 11, 5, 37):
        X, y = mgpu.array(Xn[:n]), mgpu.array(yn[:n].astype(np.int32))
        mgpu.chapter.train_batch_sharded(X, y, a, devices, 0.3)
        mgpu.train_batch(X, y, b, devices, 0.3, deterministic=True)
    for d in range(k):
        assert_bitwise([p.numpy() for p in a[d]], [p.numpy() for p in b[d]],
                       f"op by op against fused, replica {d} of {k}")
    assert not np.array_equal(a[0][0].numpy(), params[0].numpy())


def test_train_results_are_device_count_invariant_fused_and_op_by_op():
    images, labels = dist_worker.synthetic(200)
    results = []
    for k, train in ((1, mgpu.train), (3, mgpu.train), (2, mgpu.train_op_by_op)):
        data = (mgpu.data.array_loader(images, labels, 32, shuffle=True, seed=5),
                mgpu.data.array_loader(images[:64], labels[:64], 64))
        params = mgpu.lenet_params(seed=4)
        r = train(k, 32, 0.3, num_epochs=2, params=params, data=data, progress=False,
                  deterministic=True)
        results.append((r.train_loss, r.test_acc))
    assert results[0] == results[1]
    assert results[2][1] == results[0][1]  # the chapter's step reports no loss
    with pytest.raises(ValueError, match="deterministic or step, not both"):
        mgpu.train(1, 32, 0.3, num_epochs=1, data=data, step=mgpu.chapter.train_batch,
                   deterministic=True)


# --- across processes and on emulated GPUs ----------------------------------------------------

@td.needs_mpi
@pytest.mark.parametrize("kind", ["lenet", "bn"])
def test_two_processes_of_two_devices_give_the_bits_of_one_of_four(kind, tmp_path):
    rc, out, err, _ = td.mpirun(2, "deterministic", tmp_path, kind, 2, timeout=120, limit=300)
    assert rc == 0, f"mpirun deterministic {kind} failed:\n{out}\n{err}"
    run = dist_worker.deterministic_lenet if kind == "lenet" else dist_worker.deterministic_bn
    expected = run(CPUS[:4])
    for r in range(2):
        got = [a for _, a in sorted(td.load(tmp_path, f"det_{kind}_L2", r).items(),
                                    key=lambda kv: int(kv[0].split("_")[1]))]
        # Rank 0 reports the whole loss, rank 1 reports 0 (so sums over ranks stay whole).
        assert_bitwise(got[:-1], expected[:-1], f"{kind}: rank {r} of 2x2 against 1x4")
        if r == 0:
            assert np.array_equal(got[-1], expected[-1]), "rank 0's losses"
        elif kind == "lenet":
            assert not got[-1].any(), "rank 1 reports no loss"


def _gpu_runs(kind, counts, tmp_path, steps=None):
    """Runs the deterministic problem on 1..max(counts) emulated GPUs, each in a fresh process
    with MGPU_EMULATED_GPUS = that count; returns {count: arrays}."""
    env = dict(os.environ, MGPU_TEST_ON_GPUS="1", MGPU_DIST_CHECK="0",
               PYTHONPATH=str(Path(mgpu.__file__).parent.parent))
    out = {}
    for k in counts:
        env["MGPU_EMULATED_GPUS"] = str(k)
        r = subprocess.run([sys.executable, os.path.join(td.HERE, "dist_worker.py"),
                            "deterministic", str(tmp_path), kind, str(k)]
                           + ([str(steps)] if steps else []), env=env, cwd=td.HERE,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        npz = np.load(tmp_path / f"det_{kind}_L{k}.rank0.npz")
        out[k] = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not mgpu.build_info().get("cuda_emulation"), reason="needs the emulated GPUs")
def test_one_two_and_three_emulated_gpus_give_the_same_bits(tmp_path):
    runs = _gpu_runs("bn", (1, 2, 3), tmp_path)
    for k in (2, 3):
        assert_bitwise(runs[k], runs[1], f"residual net, {k} emulated GPUs against 1")
    runs = _gpu_runs("lenet", (1, 2, 3), tmp_path, steps=3)  # then a batch of 5 < 8 shards
    for k in (2, 3):
        assert_bitwise(runs[k], runs[1], f"LeNet, {k} emulated GPUs against 1")
