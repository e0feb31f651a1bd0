"""Bad input to the fused step and its helpers: each is a clear Python exception, and nothing
is half-applied (the fused step's replicas are unchanged after a refused call)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dist_worker
import mgpu
import test_distributed as td

C0, C1 = mgpu.cpu(0), mgpu.cpu(1)
PYPATH = str(Path(mgpu.__file__).parent.parent)


def lenet_replicas(devices):
    return [mgpu.get_params(mgpu.lenet_params(seed=0), d) for d in devices]


def snapshot(replicas):
    return [p.numpy().copy() for ps in replicas for p in ps]


def unchanged(replicas, before):
    return all(np.array_equal(p.numpy(), b) for p, b in
               zip([p for ps in replicas for p in ps], before))


def good_batch(n=6):
    Xn, yn, _ = dist_worker.problem(n)
    return mgpu.array(Xn), mgpu.array(yn.astype(np.int32))


# --- the CPU fused train_batch ----------------------------------------------------------------

@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bad", [10, -1])
def test_out_of_range_label_in_the_cpu_fused_step_raises_and_changes_nothing(bad, deterministic):
    devices = [C0, C1]
    replicas = lenet_replicas(devices)
    before = snapshot(replicas)
    X, _ = good_batch()
    y = mgpu.array(np.array([0, 1, bad, 2, 3, 4], np.int32))
    with pytest.raises(IndexError, match=rf"label {bad} .*out of range for 10 classes"):
        mgpu.train_batch(X, y, replicas, devices, 0.1, deterministic=deterministic)
        mgpu.waitall()
    mgpu.waitall()
    assert unchanged(replicas, before), "a refused step changed the parameters"


@pytest.mark.parametrize("shape, kind, match", [
    ((6, 28, 28), ValueError, r"X must have 4 dims \(N, 1, 28, 28\), got shape \(6, 28, 28\)"),
    ((6, 3, 28, 28), ValueError, "channels|C"),
    ((6, 1, 20, 20), ValueError, "shape|features"),
])
def test_wrong_shape_x_in_the_fused_step(shape, kind, match):
    replicas = lenet_replicas([C0])
    before = snapshot(replicas)
    X = mgpu.array(np.zeros(shape, np.float32))
    y = mgpu.array(np.zeros(6, np.int32))
    with pytest.raises(kind, match=match):
        mgpu.train_batch(X, y, replicas, [C0], 0.1)
        mgpu.waitall()
    assert unchanged(replicas, before)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8])
def test_wrong_dtype_x_in_the_fused_step(dtype):
    replicas = lenet_replicas([C0])
    X = mgpu.array(np.zeros((6, 1, 28, 28), dtype))
    with pytest.raises(TypeError, match="X must be float32"):
        mgpu.train_batch(X, mgpu.array(np.zeros(6, np.int32)), replicas, [C0], 0.1)


def test_float_labels_and_mismatched_lengths_in_the_fused_step():
    replicas = lenet_replicas([C0])
    X, _ = good_batch()
    with pytest.raises(TypeError, match="int32 or int64"):
        mgpu.train_batch(X, mgpu.array(np.zeros(6, np.float32)), replicas, [C0], 0.1)
    with pytest.raises(ValueError, match="same number of examples"):
        mgpu.train_batch(X, mgpu.array(np.zeros(5, np.int32)), replicas, [C0], 0.1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_empty_batch_is_refused(deterministic):
    replicas = lenet_replicas([C0, C1])
    X = mgpu.array(np.zeros((0, 1, 28, 28), np.float32))
    with pytest.raises(ValueError, match="the minibatch is empty"):
        mgpu.train_batch(X, mgpu.array(np.zeros(0, np.int32)), replicas, [C0, C1], 0.1,
                         deterministic=deterministic)


def test_a_replica_on_the_wrong_device_is_refused():
    replicas = lenet_replicas([C1, C0])
    before = snapshot(replicas)
    X, y = good_batch()
    with pytest.raises(ValueError, match=r"replica 0 lives on cpu\(1\) but devices\[0\] is "
                                         r"cpu\(0\)"):
        mgpu.train_batch(X, y, replicas, [C0, C1], 0.1)
    mixed = lenet_replicas([C0])[0][:4] + lenet_replicas([C1])[0][4:]
    with pytest.raises(ValueError, match="keep one device's copy together"):
        mgpu.train_batch(X, y, [mixed], [C0], 0.1)
    assert unchanged(replicas, before)


def test_nan_in_the_logits_gives_nan_losses_and_train_stops_naming_the_step():
    logits = mgpu.array(np.array([[0.0, np.nan, 1.0], [1.0, 2.0, 3.0]], np.float32))
    losses = mgpu.cross_entropy(logits, mgpu.array(np.array([0, 2], np.int32))).numpy()
    assert np.isnan(losses[0]) and np.isfinite(losses[1]), losses
    # NaN inputs make NaN logits in the fused step; train stops at that step.
    images, labels = dist_worker.synthetic(64)
    params = mgpu.lenet_params(seed=0)
    params[0] = mgpu.array(np.full(params[0].shape, np.nan, np.float32))
    data = (mgpu.data.array_loader(images, labels, 32),
            mgpu.data.array_loader(images, labels, 32))
    with pytest.raises(FloatingPointError, match="epoch 1, step 1"):
        mgpu.train(1, 32, 0.1, num_epochs=1, params=params, data=data, progress=False)


@pytest.mark.parametrize("kw, match", [
    (dict(num_gpus=0), "num_gpus must be >= 1, got 0"),
    (dict(num_gpus=-2), "num_gpus must be >= 1, got -2"),
    (dict(num_epochs=0), "num_epochs must be >= 1, got 0"),
])
def test_train_refuses_fewer_than_one_device_or_epoch(kw, match):
    images, labels = dist_worker.synthetic(32)
    data = (mgpu.data.array_loader(images, labels, 32), mgpu.data.array_loader(images, labels, 32))
    args = dict(num_gpus=1, batch_size=32, lr=0.1, num_epochs=1)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        mgpu.train(**args, data=data, progress=False)


@pytest.mark.parametrize("n", [0, -1])
def test_data_loader_refuses_batch_size_below_one(n):
    images, labels = dist_worker.synthetic(8)
    with pytest.raises(ValueError, match=f"batch_size must be >= 1, got {n}"):
        mgpu.data.array_loader(images, labels, n)
    with pytest.raises(TypeError, match="batch_size"):
        mgpu.data.array_loader(images, labels, 2.5)


# --- the distributed world --------------------------------------------------------------------

def _python(code, env=None):
    full = dict(os.environ, PYTHONPATH=PYPATH)
    for k in [k for k in full if k.startswith(("OMPI_", "PMI", "PMIX"))]:
        del full[k]
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=120, cwd=td.HERE)


@pytest.mark.parametrize("name, value, match", [
    ("MGPU_DIST_TIMEOUT", "soon", "MGPU_DIST_TIMEOUT='soon' is not a number of seconds"),
    ("MGPU_DIST_TIMEOUT", "-5", "must be a finite number > 0"),
    ("MGPU_DIST_TIMEOUT", "nan", "must be a finite number > 0"),
    ("MGPU_DIST_TIMEOUT", "inf", "must be a finite number > 0"),
    ("MGPU_DIST_CHECK", "maybe", "MGPU_DIST_CHECK='maybe': use 1 or 0"),
    ("MGPU_DIST_ALGORITHM", "fastest", "fastest"),
])
def test_nonsense_dist_environment_is_refused_naming_the_variable(name, value, match):
    code = ("import mgpu\nfrom mgpu import distributed as dist\n"
            "before = (mgpu._core.dist_timeout(), mgpu._core.dist_check(), "
            "mgpu._core.dist_algorithm())\n"
            "try:\n    dist.init()\nexcept ValueError as e:\n    print('ValueError:', e)\n"
            "after = (mgpu._core.dist_timeout(), mgpu._core.dist_check(), "
            "mgpu._core.dist_algorithm())\nprint('unchanged' if before == after else 'changed')\n")
    env = {"MGPU_DIST_TIMEOUT": "7", "MGPU_DIST_CHECK": "1", "MGPU_DIST_ALGORITHM": "ordered"}
    env[name] = value
    r = _python(code, env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("ValueError:") and name in lines[0], r.stdout
    assert pytest.importorskip("re").search(match, lines[0]), lines[0]
    assert lines[-1] == "unchanged", "a refused environment half-applied its other settings"


@pytest.mark.skipif(not td.HAVE_MPI, reason="needs an mgpu built with MPI")
def test_a_collective_after_finalize_raises():
    code = ("import numpy as np, mgpu\nfrom mgpu import distributed as dist\n"
            "dist.init('mpi')\nx = mgpu.array(np.ones(3, np.float32))\ndist.finalize()\n"
            "for name, call in (('allreduce', lambda: dist.allreduce(x)),\n"
            "                   ('broadcast', lambda: dist.broadcast(x, root=0)),\n"
            "                   ('barrier', dist.barrier)):\n"
            "    try:\n        call()\n        print(name, 'returned')\n"
            "    except Exception as e:\n        print(name, type(e).__name__, e)\n")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3, r.stdout
    for line in lines:
        assert "returned" not in line and "finalize" in line, line


@td.needs_mpi
@pytest.mark.parametrize("kind, words", [
    ("dtype", ["rank 0 called broadcast of 16 bytes from root 0, float32",
               "rank 1 called broadcast of 16 bytes from root 0, int32"]),
    ("bcast_size", ["rank 0 called broadcast of 16 bytes from root 0, float32",
                    "rank 1 called broadcast of 20 bytes from root 0, float32"]),
])
def test_ranks_that_disagree_on_dtype_or_broadcast_size_fail_naming_both(kind, words, tmp_path):
    rc, out, err, secs = td.mpirun(2, "mismatch", tmp_path, kind, timeout=60)
    assert rc != 0 and "returned" not in out, out
    assert secs < 30, f"took {secs:.1f} s: the fingerprint check should fail at once"
    for w in words:
        assert w in err, err


@td.needs_mpi
@pytest.mark.parametrize("kind, words", [
    ("dtype", "rank 1: timed out after 3 s in the transfer of broadcast of 16 bytes from root 0, "
              "int32"),
    ("bcast_size", "rank 1: ranks disagree on broadcast of 20 bytes from root 0, float32 "
                   "(collective #1): rank 0 sent 16 elements where this rank expects 20"),
])
def test_without_the_check_disagreeing_broadcasts_still_fail(kind, words, tmp_path):
    """Without the fingerprints the receiver still fails (the root's sends may complete): a size
    mismatch at once, a dtype mismatch (the same bytes) at the timeout, never reinterpreted."""
    rc, out, err, secs = td.mpirun(2, "mismatch", tmp_path, kind, timeout=3,
                                   env={"MGPU_DIST_CHECK": "0"})
    assert rc != 0 and "rank 1: the mismatched collective returned" not in out, out + err
    assert words in err, err
    assert secs < 25, f"took {secs:.1f} s with a 3 s timeout"


@td.needs_mpi
@pytest.mark.parametrize("world", [2, 3])
def test_the_mpi_algorithm_sums(world, tmp_path):
    """MGPU_DIST_ALGORITHM=mpi (MPI_Iallreduce): the known sums, and one step across processes
    within float tolerance of one process (its summation order is the library's)."""
    rc, out, err, _ = td.mpirun(world, "basics", tmp_path, "1:13", "2:13",
                                env={"MGPU_DIST_ALGORITHM": "mpi"})
    assert rc == 0, f"{out}\n{err}"
    for r in range(world):
        got = td.load(tmp_path, "basics", r)
        for n in (1, 7, 1009):  # rank r holds r + 1
            assert np.array_equal(got[f"known{n}"], np.full(n, world * (world + 1) / 2)), n
        td.assert_close(got["random"], got["random_expected"], "elementwise", f"rank {r}")
        assert np.array_equal(got["list0"], np.full((2, 3), sum(range(world))))
