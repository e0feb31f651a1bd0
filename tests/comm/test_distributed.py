"""Beyond one process (mgpu.distributed): the same training as one process per device over MPI.

Each multi-process test starts `mpirun -np N` on tests/dist_worker.py with a timeout, so a hang is
a failure, never a stuck CI. Open MPI runs as root only when told (OMPI_ALLOW_RUN_AS_ROOT*) and
more ranks than cores only with --oversubscribe. Without mpirun or an MPI build these tests are
skipped -- except in CI (CI=true), where that is a failure: CI installs Open MPI.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close, requires_fashion_mnist
from mgpu import distributed as dist

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = shutil.which("mpirun")
HAVE_MPI = MPIRUN is not None and mgpu.build_info()["mpi"] == "built"
if not HAVE_MPI and os.environ.get("CI"):
    raise RuntimeError("CI must run the MPI tests: mpirun or the MPI build is missing "
                       "(.ci/setup.sh installs openmpi-bin and libopenmpi-dev)")
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and an mgpu built with MPI "
                               "(apt-get install openmpi-bin libopenmpi-dev, then reinstall)")


def mpirun(np_, mode, outdir, *args, timeout=60, env=None, limit=90):
    """Runs the worker on np_ ranks; returns (returncode, stdout, stderr, seconds)."""
    full_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    MGPU_DIST_CHECK="1", MGPU_DIST_TIMEOUT=str(timeout))
    full_env.pop("MGPU_NUM_THREADS", None)
    full_env.update(env or {})
    cmd = [MPIRUN, "-np", str(np_), "--oversubscribe", sys.executable,
           os.path.join(HERE, "dist_worker.py"), mode, str(outdir), *map(str, args)]
    return run_watched(cmd, full_env, limit, f"mpirun {mode}")


def run_watched(cmd, env, limit, what):
    """Runs cmd in its own session; a run past `limit` seconds is killed with its children and
    fails the test. Returns (returncode, stdout, stderr, seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} hung for {limit} s (it must fail or finish)\n{out}\n{err}")
    return proc.returncode, out, err, time.perf_counter() - t0


def load(outdir, name, rank):
    return np.load(os.path.join(outdir, f"{name}.rank{rank}.npz"))


def params_of(npz, count=8):
    return [npz[f"arr_{i}"] for i in range(count)]


# --- one process: the world of size 1 ---------------------------------------------------------

def test_single_process_world_is_clear_and_collectives_check_arguments():
    if dist.launched():
        pytest.skip("this pytest itself runs under mpirun")
    dist.init()
    got = (dist.rank(), dist.world_size(), dist.local_rank(), dist.backend())
    assert got == (0, 1, 0, "single")
    x = mgpu.array(np.arange(5, dtype=np.float32))
    dist.allreduce(x)
    dist.broadcast(x, root=0)
    dist.barrier()
    assert np.array_equal(x.numpy(), np.arange(5, dtype=np.float32))
    with pytest.raises(IndexError, match="root 1 is not a rank; the world has 1 process"):
        dist.broadcast(x, root=1)
    with pytest.raises(TypeError, match="allreduce"):
        dist.allreduce(mgpu.array(np.arange(3, dtype=np.int32)))
    with pytest.raises(TypeError, match="expected mgpu tensors"):
        dist.allreduce(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="one call reduces the tensors of one device"):
        dist.allreduce([mgpu.ones((2,), device=mgpu.cpu(0)), mgpu.ones((2,), device=mgpu.cpu(1))])
    with pytest.raises(ValueError, match="backend must be one of"):
        dist.init("gloo")
    # The engine itself refuses NCCL without MPI (and in a build without the NCCL world).
    with pytest.raises(mgpu.DeviceError, match="needs MPI and this build's NCCL world"):
        mgpu._core.dist_init(False, True)


@pytest.mark.parametrize("missing", ["mpi", "cuda", "nccl"])
def test_init_nccl_is_refused_naming_what_the_build_lacks(monkeypatch, missing):
    """init(backend="nccl") where the build cannot put GPU tensors on NCCL across processes: a
    DeviceError naming the missing part and how to get it, before anything starts. The build's
    answers are patched here (test_info.py runs it unpatched in whatever build runs the tests)."""
    C = mgpu._core
    info = dict(C.build_info(), mpi="built", cuda="built (CUDA runtime 13.0)", nccl="built",
                cuda_emulation=False)
    if missing == "mpi":
        info["mpi"] = "not built: no MPI was found at build time"
    elif missing == "cuda":
        info["cuda"] = "not built: nvcc was not found at build time"
        info["nccl"] = "not built (it needs the CUDA backend, which is not built)"
    else:
        info["nccl"] = "not built: nccl.h or libnccl was not found at build time"

    def started(*args):
        raise AssertionError("init went on to start the world")

    monkeypatch.setattr(C, "build_info", lambda: info)
    monkeypatch.setattr(C, "dist_built", lambda: missing != "mpi")
    monkeypatch.setattr(C, "dist_nccl_world_built", lambda: False)
    monkeypatch.setattr(C, "dist_init", started)
    want = {"mpi": r"build of mgpu has no MPI back end .*apt-get install openmpi-bin",
            "cuda": r"build of mgpu has no CUDA backend .*CUDA toolkit and NCCL.*backend='mpi'",
            "nccl": r"CUDA build of mgpu has no NCCL .*libnccl.*backend='mpi'"}[missing]
    with pytest.raises(mgpu.DeviceError, match=r"^init\(backend='nccl'\): this " + want):
        dist.init("nccl")


def test_init_nccl_with_mgpu_dist_gpu_host_is_a_value_error(monkeypatch):
    def started(*args):
        raise AssertionError("init went on to start the world")

    monkeypatch.setattr(mgpu._core, "dist_nccl_world_built", lambda: True)
    monkeypatch.setattr(mgpu._core, "dist_init", started)
    monkeypatch.setenv("MGPU_DIST_GPU", "host")
    with pytest.raises(ValueError, match="MGPU_DIST_GPU=host asks to stage them through host"):
        dist.init("nccl")


# --- collectives and one step across processes ------------------------------------------------

STEPS = ["1:13", "2:13", "1:2", "2:2"]  # L devices per rank : global batch (uneven; tiny)


@needs_mpi
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_and_one_step_match_one_process(world, tmp_path):
    rc, out, err, _ = mpirun(world, "basics", tmp_path, *STEPS)
    assert rc == 0, f"mpirun -np {world} failed:\n{out}\n{err}"
    for r in range(world):
        got = load(tmp_path, "basics", r)
        for n in (1, 7, 1009):  # rank r holds r + 1
            assert np.array_equal(got[f"known{n}"], np.full(n, world * (world + 1) / 2)), n
        assert_close(got["random"], got["random_expected"], "elementwise", f"rank {r} random")
        assert np.array_equal(got["list0"], np.full((2, 3), sum(range(world))))
        assert np.array_equal(got["list1"], np.full(5, 10.0 * sum(range(world))))
        for root in range(world):
            assert np.array_equal(got[f"bcast{root}_f"], np.arange(6) * (root + 1))
            assert np.array_equal(got[f"bcast{root}_i"], [root, 2 * root])
            assert got[f"bcast{root}_i"].dtype == np.int64
    for spec in STEPS:
        L, n = (int(v) for v in spec.split(":"))
        Xn, yn, params = dist_worker.problem(n)
        devices = [mgpu.cpu(i) for i in range(world * L)]
        replicas = [mgpu.get_params(params, d) for d in devices]
        losses = mgpu.train_batch(mgpu.array(Xn), mgpu.array(yn), replicas, devices, lr=0.2)
        expected = [p.numpy() for p in replicas[0]]
        ranks = [params_of(load(tmp_path, f"step_L{L}_n{n}", r), 8 * L + 1) for r in range(world)]
        for r, got in enumerate(ranks):
            for i in range(8 * L):  # every local replica of every rank
                what = f"param {i % 8} of replica {i // 8} on rank {r}, {world}x{L} devices, n={n}"
                if L == 1:
                    # W processes x 1 device sum in the order of 1 process x W devices: bitwise.
                    assert np.array_equal(got[i], expected[i % 8]), what
                else:
                    assert_close(got[i], expected[i % 8], "sum", what)
            assert_close(got[-1][0], sum(v.item() for v in losses), "sum", f"loss on rank {r}")


@needs_mpi
def test_fused_model_with_batch_norm_under_mpirun_matches_one_process(tmp_path):
    """2 ranks x 2 devices take the step of 1 process x 4 devices (mgpu.parallel.FusedModel):
    the same parameters, and batch norm's running statistics (the first shard's) on every rank."""
    rc, out, err, _ = mpirun(2, "fused_model", tmp_path, 2, 9)
    assert rc == 0, f"mpirun fused_model failed:\n{out}\n{err}"
    expected = dist_worker.fused_model_steps([mgpu.cpu(i) for i in range(4)], 9)
    for r in range(2):
        got = load(tmp_path, "fused_model_L2_n9", r)
        for i, e in enumerate(expected):
            assert_close(got[f"arr_{i}"], e, "sum", f"state {i} of rank {r}'s last replica")


@needs_mpi
def test_synchronised_batch_norm_under_mpirun_matches_one_process(tmp_path):
    """SyncBatchNorm across processes: 2 ranks x 1 device take the steps of 1 process x 2 devices
    (the statistics of the whole batch, exchanged over MPI inside the fused step) and, within
    float32 tolerance, of 1 device on the whole batch; every rank ends with the same state."""
    rc, out, err, _ = mpirun(2, "sync_bn", tmp_path, 1)
    assert rc == 0, f"mpirun sync_bn failed:\n{out}\n{err}"
    two = dist_worker.sync_bn_steps([mgpu.cpu(0), mgpu.cpu(1)])
    one = dist_worker.sync_bn_steps([mgpu.cpu(0)])
    per_replica = dist_worker.sync_bn_steps([mgpu.cpu(0), mgpu.cpu(1)], sync=False)
    ranks = [load(tmp_path, "sync_bn_L1", r) for r in range(2)]
    for r, got in enumerate(ranks):
        assert len(got.files) == len(two)
        for i, e in enumerate(two[:-1]):  # parameters and running statistics
            assert_close(got[f"arr_{i}"], e, "sum", f"state {i} of rank {r} vs 1 process x 2")
            assert_close(got[f"arr_{i}"], one[i], "sum", f"state {i} of rank {r} vs 1 device")
    # Each rank's loss is its shards' part of the batch mean: the parts add up to the whole.
    last = f"arr_{len(two) - 1}"
    assert_close(ranks[0][last] + ranks[1][last], two[-1], "sum", "losses summed over ranks")
    # The test can fail: per-replica statistics (no sync) give other parameters.
    assert not np.allclose(two[0], per_replica[0], rtol=1e-4, atol=1e-6)


@needs_mpi
def test_a_few_hundred_steps_give_the_in_process_parameters(tmp_path):
    """300 shuffled steps: 2 processes equal 1 process x 2 devices bitwise and 1 device closely.

    One device adds each gradient in another order, and 300 steps amplify those roundings at
    some steps more than at others (on an AMD Zen 3: parameters within 2e-7 of the one-device
    run's, normwise, at step 200, a bias 5% off at step 300, while the whole vector stays within
    0.7% of the distance training moved it). So the one-device check is normwise, against that
    distance: a wrongly scaled or dropped gradient moves the run by a good part of it."""
    steps, batch = 300, 32
    rc, out, err, _ = mpirun(2, "train_steps", tmp_path, steps, batch, 1)
    assert rc == 0, f"{out}\n{err}"
    ranks = [params_of(load(tmp_path, "train_L1", r)) for r in range(2)]
    two, _ = dist_worker.fused_steps(steps, batch, 2)
    for r, got in enumerate(ranks):
        for i, p in enumerate(two[0]):
            assert np.array_equal(got[i], p.numpy()), f"param {i} on rank {r}"

    def flat(params):
        return np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in params])

    one, _ = dist_worker.fused_steps(steps, batch, 1)
    expected = flat(p.numpy() for p in one[0])
    moved = np.linalg.norm(expected - flat(p.numpy() for p in mgpu.lenet_params(seed=0)))
    assert moved > 0.01 * np.linalg.norm(expected), "training did not move the parameters"
    for r, got in enumerate(ranks):
        off = np.linalg.norm(flat(got) - expected)
        assert off <= 0.05 * moved, (f"rank {r}: {off:.3g} from the one-device run's parameters, "
                                     f"more than 5% of the {moved:.3g} training moved them")


@needs_mpi
def test_train_api_broadcasts_rank0_params_sums_accuracy_and_prints_once(tmp_path):
    rc, out, err, _ = mpirun(2, "train_api", tmp_path, 2, 32)
    assert rc == 0, f"{out}\n{err}"
    lines = [s for s in out.splitlines() if s.startswith("test acc:")]
    assert len(lines) == 1 and lines[0].endswith("on [cpu(0)] x 2 processes"), out
    got = [json.loads((tmp_path / f"train_api.rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and got[0]["world_size"] == 2
    # One process with 2 devices, starting from what rank 0 had, sees the same numbers.
    images, labels = dist_worker.synthetic(640)
    test_images, test_labels = dist_worker.synthetic(300, seed=2)
    data = (mgpu.data.array_loader(images, labels, 32, shuffle=True, seed=5),
            mgpu.data.array_loader(test_images, test_labels, 64))
    ref = mgpu.train(2, 32, 0.3, num_epochs=2, params=mgpu.lenet_params(seed=7), data=data,
                     progress=False)
    assert got[0]["test_acc"] == pytest.approx(ref.test_acc, abs=1e-9)
    assert got[0]["train_loss"] == pytest.approx(ref.train_loss, rel=1e-5)
    assert ref.train_loss[-1] < ref.train_loss[0], "two epochs should lower the loss"


@needs_mpi
@requires_fashion_mnist
def test_cli_train_under_mpirun_prints_once_like_one_process(tmp_path):
    args = ["train", "--batch-size", "128", "--lr", "0.2", "--epochs", "1", "--limit-batches", "8"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    single = subprocess.run([sys.executable, "-m", "mgpu", *args, "--num-gpus", "2"], cwd=HERE,
                            env=env, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    multi = subprocess.run([MPIRUN, "-np", "2", "--oversubscribe", sys.executable, "-m", "mgpu",
                            *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=120)
    assert multi.returncode == 0, multi.stderr
    lines = [s for s in multi.stdout.splitlines() if s.startswith("test acc:")]
    assert len(lines) == 1, multi.stdout
    assert lines[0].split(",")[0] == single.stdout.strip().split(",")[0], (lines, single.stdout)


# --- failures are loud and fast ----------------------------------------------------------------

@needs_mpi
@pytest.mark.parametrize("kind", ["size", "op"])
def test_mismatched_collectives_fail_on_every_rank_naming_them(kind, tmp_path):
    rc, out, err, secs = mpirun(2, "mismatch", tmp_path, kind, timeout=60)
    assert rc != 0 and "returned" not in out
    assert secs < 30, f"took {secs:.1f} s: the fingerprint check should fail at once"
    assert "the ranks called different collectives" in err, err
    if kind == "size":
        assert "rank 0 called allreduce of 4 float32" in err
        assert "rank 1 called allreduce of 5 float32" in err
    else:
        assert "rank 1 called broadcast of 16 bytes from root 0" in err


@needs_mpi
def test_without_the_check_a_mismatch_times_out_naming_rank_and_op(tmp_path):
    rc, out, err, secs = mpirun(2, "mismatch", tmp_path, "op", timeout=2,
                                env={"MGPU_DIST_CHECK": "0"})
    assert rc != 0 and "returned" not in out
    assert secs < 25, f"took {secs:.1f} s with a 2 s timeout"
    assert "timed out after 2 s" in err and "still waiting for rank" in err, err
    assert "allreduce of 4 float32" in err or "broadcast of 16 bytes" in err


@needs_mpi
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_dead_or_hung_rank_ends_the_job_nonzero_within_the_timeout(how, tmp_path):
    rc, out, err, secs = mpirun(2, "die", tmp_path, how, timeout=3)
    assert rc != 0
    assert secs < 25, f"took {secs:.1f} s with a 3 s timeout"
    if how == "hang":
        assert "rank 0: timed out after 3 s" in err and "still waiting for rank 1" in err, err
