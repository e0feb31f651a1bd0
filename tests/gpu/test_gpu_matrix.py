"""Every GPU configuration the README documents, on emulated GPUs, and where each one is tested.

.ci/test.sh runs the tests marked ``gpu`` on the emulated build's package (the lenient emulator),
then the GPU files again on the strict emulator (``MGPU_EMU_STRICT=1``: streams run behind the
host in a seeded interleaving, freed memory is poisoned with NaN) under seed 2 (the emulated
NCCL; the 3- and 4-GPU children too) and seed 4 (``MGPU_ALLREDUCE=peer``: the peer-copy
all-reduce; no test whose id says ``more_gpus`` or ``nccl``). "Strict seeds" below are those
runs. Bitwise means ``np.array_equal``; otherwise the comparison is stated in the test.

The matrix: each row is a configuration and the strict seeds its tests run under, then the tests.

====================================================================================  =======
configuration / its tests                                                             seeds
====================================================================================  =======
1 GPU, the fused step (graphs) against one CPU device                                  2, 4
  test_gpu.py::test_fused_step_on_one_gpu_equals_one_cpu_device
1 GPU, replayed graphs and a bad label                                                 2, 4
  test_gpu.py::test_bad_label_inside_a_replayed_graph_is_an_index_error
2 GPUs in one process, the fused step against one CPU device                           2, 4
  test_gpu.py::test_fused_step_on_two_gpus_equals_one_cpu_device
2 GPUs, graphs on against graphs off (bitwise)                                         2, 4
  test_gpu.py::test_cuda_graph_replays_equal_the_step_without_graphs
2 GPUs, the book's loop (op by op, autograd) against the fused step                    2, 4
  test_gpu.py::test_chapter_op_by_op_step_on_gpus_equals_the_fused_step
2 GPUs, SyncBatchNorm in the fused step against float64                                2, 4
  test_concise_step.py::test_fused_sync_batch_norm_on_emulated_gpus[2]
2 GPUs without peer access, five SyncBatchNorm steps against them with it (bitwise)    2, 4
  test_gpu_without_peer_access.py::
  test_sync_batch_norm_steps_without_peer_access_equal_those_with_it
3 and 4 GPUs in one process, all-reduce and fused step (emulated NCCL, peer copies)    2
  test_gpu_defects.py::test_collectives_and_the_fused_step_on_more_gpus
  [3-gpus-nccl, 3-gpus-peer, 4-gpus-nccl, 4-gpus-peer]
3 GPUs against 4: LeNet (graphs on, off; deterministic bitwise), the residual BN net    2, 4
(deterministic, bitwise); the book's loop on 3 and on 4 GPUs against the fused step
  test_gpu_matrix.py::test_one_process_of_three_gpus_matches_one_of_four
  [lenet, lenet_plain, lenet_det, bn_det, book]
mpirun x 1 GPU per rank against 1 process x 2 GPUs (bitwise): NCCL across ranks,       2, 4
host staging (seed 4: [host] only, its ids say nccl)
  test_gpu.py::test_two_processes_on_gpus_equal_one_process_with_two_gpus[nccl, host]
mpirun x 1 GPU per rank, init(backend="nccl")                                          2
  test_gpu.py::test_init_backend_nccl_trains_like_one_process_and_like_host_staging
mpirun x 2 GPUs per rank against 1 process x 4 GPUs: LeNet graphs on, off; the         2, 4
residual BN net graphs on, off; SyncBatchNorm (within float tolerance); deterministic
LeNet and BN net (bitwise)
  test_gpu_matrix.py::test_two_ranks_of_two_gpus_match_one_process_of_four
  [lenet, lenet_plain, bn, bn_plain, sync_bn, lenet_det, bn_det]
mpirun x 2 GPUs per rank, mgpu.train against mgpu.train on 4 GPUs                      2, 4
  test_gpu_matrix.py::test_train_under_mpirun_with_two_gpus_per_rank
2 GPUs, a step failing mid-backward, graphs on and off                                 2, 4
  test_gpu_matrix.py::test_a_step_failing_mid_backward_leaves_nothing_running
  [graphs, plain]
====================================================================================  =======

Both networks here have 2 gradient buckets (LeNet: the dense layers, then the convolutions; the
residual net's is asserted), so every step overlaps a bucket's all-reduce with backward. The
deterministic step does not bucket: it sums logical shards in a fixed tree (test_deterministic.py),
which is why 2 x 2 and 1 x 4 agree bit for bit there. Elsewhere the sums associate differently
(2 x 2: (g0 + g1) + (g2 + g3); 1 x 4: ((g0 + g1) + g2) + g3), so the parameters agree to float32
rounding: compared by what the steps changed (test_gpu.assert_same_update).
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import mgpu
import test_distributed as td
from test_gpu import assert_same_update

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
EMULATED = bool(mgpu.build_info()["cuda_emulation"])
needs_emulator = pytest.mark.skipif(not EMULATED, reason="sets the emulated GPU count of child "
                                    "processes (the emulated build)")
needs_mpi = pytest.mark.skipif(not td.HAVE_MPI or mgpu.distributed.launched(),
                               reason="needs mpirun and an mgpu built with MPI, outside mpirun")

# Each child's time limit: a hang fails its test instead of the suite. MGPU_NCCL_TIMEOUT_S bounds
# every in-process GPU all-reduce part's wait for the others, MGPU_DIST_TIMEOUT every cross-rank
# wait: a deadlock becomes an mgpu.DeviceError naming the all-reduce well within the limit.
LIMIT = float(os.environ.get("MGPU_TEST_CHILD_LIMIT", "600"))
CHILD_ENV = {"PYTHONPATH": str(Path(mgpu.__file__).parent.parent), "MGPU_NCCL_TIMEOUT_S": "60",
             "MGPU_DIST_TIMEOUT": "120", "MGPU_DIST_CHECK": "1",
             "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

TOLERANT = ["lenet", "lenet_plain", "bn", "bn_plain", "sync_bn"]
BITWISE = ["lenet_det", "bn_det"]
# Not the residual net's ordinary step: its batch norm normalises each replica's shard, so 3 and
# 4 GPUs compute different steps (the deterministic step normalises fixed logical shards).
ONE_OF_THREE = ["lenet", "lenet_plain", "lenet_det", "bn_det", "book"]


def _run(cmd, gpus, what):
    """Runs a worker command with MGPU_EMULATED_GPUS=gpus; returns (returncode, output)."""
    env = dict(os.environ, MGPU_EMULATED_GPUS=str(gpus), **CHILD_ENV)
    env.pop("MGPU_NUM_THREADS", None)
    env.pop("MGPU_CUDA_GRAPH", None)
    rc, out, err, _ = td.run_watched(cmd, env, LIMIT, what)
    return rc, out + err


def _alone(out, gpus, cases):
    return _run([sys.executable, str(HERE / "gpu_matrix_worker.py"), str(out), str(gpus),
                 ",".join(cases)], gpus, f"1 process x {gpus} GPUs")


def _mpirun(out, ranks, local, cases, gpus=None):
    cmd = [td.MPIRUN, "-np", str(ranks), "--oversubscribe", sys.executable,
           str(HERE / "gpu_matrix_worker.py"), str(out), str(local), ",".join(cases)]
    return _run(cmd, gpus or local, f"mpirun -np {ranks} x {local} GPUs")


def _load(out, case, rank=0):
    npz = np.load(out / f"{case}.rank{rank}.npz")
    return [npz[f"arr_{i}"] for i in range(len(npz.files))]


def _parts(case, arrays):
    """(start, replica 0's state, last replica's parameters, losses) of a worker's arrays."""
    if case.startswith("lenet") or case == "book":
        return arrays[:8], arrays[8:16], arrays[16:24], arrays[24]
    # The residual net: start (P), master parameters (P), buffers (B), last replica's
    # parameters (P), losses, and the counts (buckets, P, B).
    buckets, p, b = (int(v) for v in arrays[-1])
    assert buckets >= 2, f"{case}: the residual net has {buckets} gradient bucket(s), expected 2"
    assert len(arrays) == 3 * p + b + 2, f"{case}: {len(arrays)} arrays"
    return arrays[:p], arrays[p:2 * p + b], arrays[2 * p + b:3 * p + b], arrays[-2]


def _assert_bitwise(got, expected, what):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        if not np.array_equal(g, e):
            diff = float(np.max(np.abs(g.astype(np.float64) - e)))
            pytest.fail(f"{what}: array {i} differs (max abs difference {diff:.3g})")


def _assert_same_steps(case, got, ref, what, buffers=True):
    """Parameters within float32 rounding of the reference's (by update), replicas bitwise equal
    among themselves, and (buffers) the running statistics close."""
    start, mine, last, _ = _parts(case, got)
    _, theirs, _, _ = _parts(case, ref)
    params = len(start)
    for i in range(params):
        assert_same_update(mine[i], theirs[i], start[i], what=f"{what}: param {i}")
        np.testing.assert_array_equal(last[i], mine[i],
                                      err_msg=f"{what}: param {i}, the replicas drifted apart")
    for i in range(params, len(mine) if buffers else params):
        np.testing.assert_allclose(mine[i], theirs[i], rtol=1e-4, atol=1e-6,
                                   err_msg=f"{what}: buffer {i - params}")


# ---- mpirun x 2 GPUs per rank against 1 process x 4 GPUs ----------------------------------------

@pytest.fixture(scope="module")
def one_process_of_four(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_of_four")
    rc, log = _alone(out, 4, TOLERANT + BITWISE + ["book"])
    return out, rc, log


@pytest.fixture(scope="module")
def two_ranks_of_two(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_of_two")
    rc, log = _mpirun(out, 2, 2, TOLERANT + BITWISE)
    return out, rc, log


@needs_emulator
@needs_mpi
@pytest.mark.parametrize("case", TOLERANT + BITWISE)
def test_two_ranks_of_two_gpus_match_one_process_of_four(case, two_ranks_of_two,
                                                         one_process_of_four):
    """mpirun -np 2, 2 emulated GPUs each: each bucket is summed over the rank's GPUs (NCCL or
    peer copies), then across ranks on device 0's compute stream, then copied to the other GPU.
    Every rank and every replica must end with the parameters of one process stepping on 4 GPUs
    (bitwise in deterministic mode)."""
    ref_dir, rc, log = one_process_of_four
    assert rc == 0, f"1 process x 4 GPUs failed:\n{log[-4000:]}"
    out, rc, log = two_ranks_of_two
    assert rc == 0, f"mpirun -np 2 x 2 GPUs failed:\n{log[-4000:]}"
    ref = _load(ref_dir, case)
    for r in range(2):
        got = _load(out, case, r)
        what = f"{case}, rank {r} of 2 x 2 GPUs against 1 x 4"
        if case in BITWISE:
            _, mine, last, losses = _parts(case, got)
            _, theirs, _, ref_losses = _parts(case, ref)
            _assert_bitwise(mine, theirs, what)
            _assert_bitwise(last[:len(theirs)], theirs[:len(last)], what + " (last replica)")
            if r == 0:  # the whole loss is reported by rank 0's first replica
                np.testing.assert_array_equal(losses, ref_losses)
        else:
            # Plain batch norm keeps each rank's first replica's statistics (rank 1's: the third
            # shard's, not the first's); synchronised ones are the whole batch's on every rank.
            _assert_same_steps(case, got, ref, what, buffers=r == 0 or case == "sync_bn")
    if case.startswith("lenet"):  # each rank reports its replicas' summed losses
        total = _parts(case, _load(out, case, 0))[3] + _parts(case, _load(out, case, 1))[3]
        np.testing.assert_allclose(total, _parts(case, ref)[3], rtol=1e-5)


# ---- 1 process x 3 GPUs against 1 x 4 --------------------------------------------------------

@pytest.fixture(scope="module")
def one_process_of_three(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_of_three")
    rc, log = _alone(out, 3, ONE_OF_THREE)
    return out, rc, log


@needs_emulator
@pytest.mark.parametrize("case", ONE_OF_THREE)
def test_one_process_of_three_gpus_matches_one_of_four(case, one_process_of_three,
                                                      one_process_of_four):
    """3 GPUs (every bucket's chunks uneven) against 4; the deterministic steps bitwise. `book`:
    the chapter's op-by-op train_batch (autograd, its allreduce through gpu(0)) on 3 and on 4
    GPUs, each against the fused step (lenet_plain) of its own process."""
    ref_dir, rc, log = one_process_of_four
    assert rc == 0, f"1 process x 4 GPUs failed:\n{log[-4000:]}"
    out, rc, log = one_process_of_three
    assert rc == 0, f"1 process x 3 GPUs failed:\n{log[-4000:]}"
    if case == "book":
        for d, k in ((out, 3), (ref_dir, 4)):
            _assert_same_steps("lenet", _load(d, "book"), _load(d, "lenet_plain"),
                               f"the book's loop on {k} GPUs against the fused step")
        return
    got, ref = _load(out, case), _load(ref_dir, case)
    what = f"{case}, 3 GPUs against 4"
    if case in BITWISE:
        _assert_bitwise(_parts(case, got)[1], _parts(case, ref)[1], what)
    else:
        _assert_same_steps(case, got, ref, what)


# ---- mgpu.train under mpirun with 2 GPUs per rank --------------------------------------------

@needs_emulator
@needs_mpi
def test_train_under_mpirun_with_two_gpus_per_rank(tmp_path):
    """mgpu.train(2, ...) on each of 2 ranks (4 emulated GPUs per process; rank r takes
    gpu(2r), gpu(2r + 1)) against mgpu.train(4, ...) in one process: the training loss within
    float32 rounding, the test accuracy within one example of 64. This run hung for ever before
    (both ranks idle, a GPU's worker inside the all-reduce): a bucket's cross-rank copy made one
    GPU's queue wait for the other's while that one's part of the next bucket waited for it."""
    two = tmp_path / "two"
    two.mkdir()
    rc, log = _mpirun(two, 2, 2, ["train"], gpus=4)
    assert rc == 0, f"mpirun -np 2 x mgpu.train(2, ...) failed:\n{log[-4000:]}"
    one = tmp_path / "one"
    one.mkdir()
    rc, log = _alone(one, 4, ["train"])
    assert rc == 0, f"mgpu.train(4, ...) failed:\n{log[-4000:]}"
    ref = _load(one, "train")
    assert list(ref[2]) == ["gpu(0)", "gpu(1)", "gpu(2)", "gpu(3)"]
    for r in range(2):
        loss, acc, devices = _load(two, "train", r)
        assert list(devices) == [f"gpu({2 * r})", f"gpu({2 * r + 1})"], devices
        np.testing.assert_allclose(loss, ref[0], rtol=1e-5, err_msg=f"rank {r}: training loss")
        assert abs(float(acc[0]) - float(ref[1][0])) <= 1 / 64 + 1e-9, (acc, ref[1])
        assert np.isfinite(loss).all()


# ---- a step that fails mid-backward --------------------------------------------------------

def _two_bucket_net():
    """Convolution, then a dense head of 80,410 floats: 2 gradient buckets, no batch norm (a
    failed step leaves the parameters as they were, and nothing else)."""
    from mgpu import nn
    mgpu.random.seed(3)
    return nn.Sequential(nn.Conv2d(1, 4, kernel_size=3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(256, 300), nn.ReLU(), nn.Linear(300, 10))


@pytest.mark.skipif(mgpu.num_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("graphs", ["1", "0"], ids=["graphs", "plain"])
def test_a_step_failing_mid_backward_leaves_nothing_running(monkeypatch, graphs):
    """A step that raises after its first bucket's all-reduce was started (an OutOfMemoryError
    in the next layer's backward, injected here) must not leave that reduction behind: with
    NCCL it runs on the communication streams, where nothing else would wait for it, so it could
    still read its flat buffers after they went back to the cache (the next step's buffers, or
    NaN: the strict emulator poisons freed memory) and unpack into the gradients the next step
    writes. Without graphs the gradient buffers are the model's: once every stream is done
    (waitall), bucket 0 must hold the failed step's sum on both GPUs. Then the caller goes on, as
    a batch-size probe does; every later step must give the bits of a model that never failed
    (so the failed step changed nothing either)."""
    from mgpu import nn, optim
    monkeypatch.setenv("MGPU_CUDA_GRAPH", graphs)
    devices = [mgpu.gpu(0), mgpu.gpu(1)]
    rng = np.random.default_rng(17)
    models = []
    for _ in range(2):
        net = _two_bucket_net()
        models.append((net, nn.DataParallel(net, device_ids=devices),
                       optim.SGD(net.parameters(), lr=0.1, momentum=0.9)))
    assert len(models[0][1]._fused_model().model._model.buckets) == 2
    loss = nn.CrossEntropyLoss()

    def batch():
        return (mgpu.array(rng.standard_normal((8, 1, 8, 8)).astype(np.float32)),
                mgpu.array(rng.integers(0, 10, 8).astype(np.int32)))

    X, y = batch()
    for _, dp, trainer in models:
        dp.train_step(X, y, loss, trainer)
    probed, clean = models
    X, y = batch()
    mgpu._core._fail_next_step_after_bucket(0)
    with pytest.raises(mgpu.OutOfMemoryError, match="after bucket 0.*injected"):
        probed[1].train_step(X, y, loss, probed[2])
    if graphs == "0":  # the gradients are the model's own buffers (not the graphs')
        # Every stream is done: bucket 0 holds the failed step's sum, the same on both GPUs.
        mgpu.waitall()
        model = probed[1]._fused.model._model
        lo, hi = model.buckets[0]
        sums = [mgpu.Tensor(model.grads(d)).numpy()[lo:hi] for d in range(2)]
        assert np.isfinite(sums[0]).all(), "bucket 0 of gpu(0)'s gradients holds NaN (poison)"
        np.testing.assert_array_equal(sums[1], sums[0], err_msg="bucket 0 differs between GPUs")
    for _ in range(3):
        X, y = batch()
        for _, dp, trainer in models:
            dp.train_step(X, y, loss, trainer)
    mgpu.waitall()
    for i, (a, b) in enumerate(zip(probed[0].parameters(), clean[0].parameters())):
        got, expected = a.numpy(), b.numpy()
        assert np.isfinite(got).all(), f"param {i}: NaN after a failed step"
        np.testing.assert_array_equal(got, expected, err_msg=f"param {i} after a failed step")


def test_the_failure_hook_is_off_by_default_and_checked():
    with pytest.raises(ValueError, match="bucket must be >= 0"):
        mgpu._core._fail_next_step_after_bucket(-2)
    mgpu._core._fail_next_step_after_bucket(-1)
