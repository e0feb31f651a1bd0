"""GPU devices: allocator, copies, all-reduce, the fused step, errors.

These run wherever ``mgpu.num_gpus() > 0``. In CI that is the emulated build (``.ci/test.sh`` runs
the tests marked ``gpu`` again with ``PYTHONPATH=build/cpp-tests/python``): gpu(0), gpu(1) are
mgpu's emulated GPUs, every kernel a real CUDA kernel run by cpp/cuda/emu. The tests marked
``real_gpu`` need NVIDIA's libraries (cuBLAS, cuDNN, NCCL), which cannot run emulated: they are
skipped here and are ready for a machine with GPUs. Every op test in the other files also runs on
gpu(0) through the ``device`` fixture, marked ``gpu`` there.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mgpu
from conftest import assert_close

pytestmark = pytest.mark.gpu

NUM_GPUS = mgpu.num_gpus()
EMULATED = bool(mgpu.build_info()["cuda_emulation"])


def needs_gpus(k):
    return pytest.mark.skipif(
        NUM_GPUS < k, reason=f"needs {k} GPU(s), mgpu.num_gpus() == {NUM_GPUS} (the emulated "
        "build of .ci/test.sh provides 2)")


real_gpu = pytest.mark.skipif(
    NUM_GPUS == 0 or EMULATED,
    reason="needs a real NVIDIA GPU: cuBLAS, cuDNN and NCCL cannot run on emulated GPUs")

G0 = mgpu.gpu(0) if NUM_GPUS > 0 else None
G1 = mgpu.gpu(1) if NUM_GPUS > 1 else None
C0, C1 = mgpu.cpu(0), mgpu.cpu(1)


def test_build_info_says_what_runs_gpus():
    info = mgpu.build_info()
    assert info["gpus"] == NUM_GPUS
    if EMULATED:
        assert info["cuda"].startswith("emulated")
        assert "emulated" in info["cudnn"]
        assert "emulated" in info["nccl"] and "peer-copy" in info["nccl"]
        assert info["gpu_gemm"].startswith("native")
    elif NUM_GPUS == 0:
        assert mgpu.try_gpu(0) == C0 and mgpu.try_all_gpus() == [C0]
        with pytest.raises(IndexError, match=r"gpu\(0\).*num_gpus\(\) == 0.*try_gpu"):
            mgpu.gpu(0)


@needs_gpus(1)
def test_try_gpu_gives_the_gpu():
    assert mgpu.try_gpu(0) == G0
    assert mgpu.try_all_gpus() == [mgpu.gpu(i) for i in range(NUM_GPUS)]
    with pytest.raises(IndexError, match=f"gpu\\({NUM_GPUS}\\)"):
        mgpu.gpu(NUM_GPUS)


@needs_gpus(1)
def test_caching_allocator_reaches_a_steady_state():
    """A step's outputs are allocated when the host issues its ops, and a temporary's block goes
    back to the cache when its last task has run: a worker behind the host (load, the strict
    emulator) keeps all three temporaries of a step (x * 2, + 1, - x) alive at once, where a
    prompt one needs two. The cache is first given three blocks at once, so no timing of the
    worker makes the steady state call cudaMalloc (it did, 5 == 4, in 2 of 5 runs of the strict
    stage on a loaded machine)."""
    x = mgpu.ones((4096,), device=G0)

    def step():
        return float(((x * 2.0 + 1.0) - x).sum().item())

    held = [x * 1.0 for _ in range(3)]
    mgpu.waitall()
    del held
    for _ in range(3):
        step()
    before = mgpu.gpu_memory_stats(G0)
    for _ in range(20):
        assert step() == 4096 * 2.0
    after = mgpu.gpu_memory_stats(G0)
    assert after["device_mallocs"] == before["device_mallocs"], "steady state called cudaMalloc"
    assert after["allocated"] >= 4096 * 4 and after["peak_allocated"] >= after["allocated"]
    x = None  # the last reference: its block goes back to the cache
    mgpu.empty_cache()
    assert mgpu.gpu_memory_stats(G0)["cached"] == 0


@needs_gpus(1)
def test_out_of_memory_is_a_memory_error_naming_device_and_size():
    huge = 1 << 40  # 4 TiB of float32: more than any GPU (an emulated one has 16 GiB)
    with pytest.raises(mgpu.OutOfMemoryError, match=r"gpu\(0\) is out of memory.*MiB.*"
                       r"empty_cache") as err:
        mgpu.zeros((huge,), device=G0)
    assert isinstance(err.value, MemoryError)
    # The device still works afterwards.
    np.testing.assert_array_equal(mgpu.full((3,), 2.0, device=G0).numpy(), [2.0, 2.0, 2.0])


@needs_gpus(2)
def test_copies_between_every_kind_of_device_keep_order():
    src = np.arange(10_000, dtype=np.float32)
    t = mgpu.array(src, device=C0)
    a = t.to(G0)            # host -> device (pinned staging)
    for _ in range(20):
        a += 1.0            # queued on gpu(0)
    b = a.to(G1)            # peer copy: sees all 20 updates
    a += 100.0              # must not reach b
    c = b.to(C1)            # device -> host
    b *= 0.0
    np.testing.assert_array_equal(c.numpy(), src + 20)
    np.testing.assert_array_equal(a.numpy(), src + 120)
    np.testing.assert_array_equal(b.numpy(), np.zeros_like(src))
    d = mgpu.zeros((10_000,), device=G0)
    d[:] = b.to(G0) + a     # same-device copy through setitem
    np.testing.assert_array_equal(d.numpy(), src + 120)


@needs_gpus(1)
def test_large_host_to_device_copy_crosses_staging_chunks(rng):
    src = rng.normal(size=(3, 1024, 1024)).astype(np.float32)  # 12 MiB > the 8 MiB staging
    t = mgpu.array(src, device=C0).to(G0)
    np.testing.assert_array_equal(t.numpy(), src)
    np.testing.assert_array_equal(mgpu.array(src, device=G0).numpy(), src)


def _allreduce_order_is_mgpus(k):
    """True where the GPUs' all-reduce adds in device order 0..k-1, as cpu(0..k-1) do: mgpu's
    peer-copy path (MGPU_ALLREDUCE=peer, or a build without NCCL) and the emulator's NCCL, which
    sums in rank order. Real NCCL adds in its own ring's or tree's order, chosen by its
    algorithm: with 3 or more GPUs its sums may differ from the CPU's in the last bits (with 2,
    a + b == b + a exactly)."""
    info = mgpu.build_info()
    nccl = info.get("nccl") == "built" and os.environ.get("MGPU_ALLREDUCE") != "peer"
    return EMULATED or not nccl or k <= 2


def assert_sum_of_k(got, expected, terms, k, what):
    """got and expected are float32 sums of the same k terms added in different orders: each is
    within (k - 1) * 2^-24 * sum|terms| of the exact sum (one rounding per addition, of a partial
    sum no larger than sum|terms|), so they differ by at most (k - 1) * 2^-23 * sum|terms|."""
    bound = (k - 1) * 2.0 ** -23 * sum(np.abs(t.astype(np.float64)) for t in terms)
    err = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    assert (err <= bound).all(), (f"{what}: differs by {err.max():.3g}, more than a sum of {k} "
                                  f"float32 terms in another order can ({bound.max():.3g})")


@needs_gpus(2)
@pytest.mark.parametrize("shapes", [[(7,)], [(3, 5), (1,), (129,), (2, 2, 2)], [(1,)]])
def test_allreduce_on_gpus_matches_the_cpu_devices(rng, shapes):
    """Bitwise the CPU devices' sums where mgpu decides the order (_allreduce_order_is_mgpus);
    with real NCCL on 3 or more GPUs, within what another order of the k additions can give."""
    k = NUM_GPUS  # every GPU: test_gpu_defects.py runs this on 3 and 4 emulated GPUs too
    values = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(k)]
    on_gpus = [[mgpu.array(v, device=mgpu.gpu(d)) for v in values[d]] for d in range(k)]
    on_cpus = [[mgpu.array(v, device=mgpu.cpu(d)) for v in values[d]] for d in range(k)]
    mgpu.allreduce(on_gpus)
    mgpu.allreduce(on_cpus)
    for j in range(len(shapes)):
        expected = sum(values[d][j].astype(np.float64) for d in range(k))
        for d in range(k):
            got = on_gpus[d][j].numpy()
            assert_close(got, expected, "elementwise", what=f"tensor {j}", device=mgpu.gpu(d))
            if _allreduce_order_is_mgpus(k):
                np.testing.assert_array_equal(got, on_cpus[d][j].numpy())
            else:
                assert_sum_of_k(got, on_cpus[d][j].numpy(), [v[j] for v in values], k,
                                f"tensor {j} on gpu({d})")


@needs_gpus(2)
def test_allreduce_refuses_to_mix_cpus_and_gpus():
    with pytest.raises(ValueError, match="mix CPU and GPU"):
        mgpu.allreduce([mgpu.ones((2,), device=C0), mgpu.ones((2,), device=G0)])


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    return mgpu.array(X), mgpu.array(y)


def _fused_steps(devices, X, y, steps, lr=0.2):
    params = mgpu.lenet_params(seed=3)
    replicas = [mgpu.get_params(params, d) for d in devices]
    losses = None
    for _ in range(steps):
        losses = mgpu.train_batch(X, y, replicas, devices, lr)
    return [[p.numpy() for p in r] for r in replicas], losses


def assert_same_update(got, ref, start, what, device=None):
    """Parameters after training steps, compared by what the steps changed (got - start against
    ref - start), not by the parameters themselves: LeNet's smallest updates (1e-7 to 1e-5 in
    W2 and W3 after a step) are below the "sum" tolerance of a parameter (atol 1e-5), so a GPU
    that skipped them would pass. rtol is the "sum" row's; atol is 0.5% of the tensor's largest
    update: the float32 rounding of the parameters themselves (a few ulps of |p| <= 1, measured
    <= 7.5e-9 between GPU and CPU) shows in the difference, and 0.5% is far below one update."""
    start = np.asarray(start, np.float64)
    expected = np.asarray(ref, np.float64) - start
    atol = 5e-3 * float(np.abs(expected).max()) + 1e-12
    got_update = np.asarray(got, np.float64) - start
    label = f"{what} on {device}" if device is not None else what
    err = np.abs(got_update - expected)
    bound = atol + 1e-4 * np.abs(expected)
    assert (err <= bound).all(), (
        f"{label}: update differs by up to {err.max():.3g} "
        f"(bound {bound.flat[np.argmax(err)]:.3g}, largest update {np.abs(expected).max():.3g})")


def _start():
    return [p.numpy() for p in mgpu.lenet_params(seed=3)]


@needs_gpus(2)
def test_fused_step_on_two_gpus_equals_one_cpu_device():
    X, y = _batch(8)
    cpu_params, _ = _fused_steps([C0], X, y, steps=2)
    gpu_params, losses = _fused_steps([G0, G1], X, y, steps=2)
    names = ["W1", "b1", "W2", "b2", "W3", "b3", "W4", "b4"]
    for name, ref, a, b, s in zip(names, cpu_params[0], gpu_params[0], gpu_params[1], _start()):
        assert_same_update(a, ref, s, what=name, device=G0)
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: the two GPU replicas differ")
    assert len(losses) == 2


@needs_gpus(2)
def test_fused_step_on_every_gpu_equals_one_cpu_device():
    """All of this process's GPUs (test_gpu_defects.py runs it on 3 and 4 emulated GPUs): the
    all-reduce's chunks and neighbours change with the count."""
    devices = [mgpu.gpu(i) for i in range(NUM_GPUS)]
    X, y = _batch(12, seed=8)
    cpu_params, _ = _fused_steps([C0], X, y, steps=2)
    gpu_params, _ = _fused_steps(devices, X, y, steps=2)
    start = _start()
    for i, ref in enumerate(cpu_params[0]):
        assert_same_update(gpu_params[0][i], ref, start[i], what=f"param {i}", device=G0)
        for d in range(1, NUM_GPUS):
            np.testing.assert_array_equal(gpu_params[d][i], gpu_params[0][i],
                                          err_msg=f"param {i}: gpu({d}) differs from gpu(0)")


@needs_gpus(2)
def test_chapter_op_by_op_step_on_gpus_equals_the_fused_step():
    """The book's train_batch (autograd, allreduce through gpu(0)) on two GPUs."""
    X, y = _batch(8, seed=6)
    devices = [G0, G1]
    params = mgpu.lenet_params(seed=0)
    book = [mgpu.get_params(params, d) for d in devices]
    fused = [mgpu.get_params(params, d) for d in devices]
    mgpu.chapter.train_batch(X, y, book, devices, 0.1)
    mgpu.train_batch(X, y, fused, devices, 0.1)
    for d in range(2):
        for i, (a, b, s) in enumerate(zip(book[d], fused[d], params)):
            assert_same_update(a.numpy(), b.numpy(), s.numpy(), f"param {i}", devices[d])


@needs_gpus(1)
def test_fused_step_on_one_gpu_equals_one_cpu_device():
    X, y = _batch(4, seed=1)
    (ref,), _ = _fused_steps([C0], X, y, steps=1)
    (got,), _ = _fused_steps([G0], X, y, steps=1)
    for i, (r, g, s) in enumerate(zip(ref, got, _start())):
        assert_same_update(g, r, s, f"param {i}", G0)


@needs_gpus(2)
def test_cuda_graph_replays_equal_the_step_without_graphs(monkeypatch):
    """The fused step on GPUs is captured once as a CUDA graph per replica and replayed; the
    replays must compute exactly what the plain launches compute, and each step's loss must stay
    its own (the graph's loss buffer is overwritten by the next replay)."""
    X, y = _batch(6, seed=2)
    devices = [G0, G1]

    def steps(graph):
        monkeypatch.setenv("MGPU_CUDA_GRAPH", "1" if graph else "0")
        params = mgpu.lenet_params(seed=5)
        replicas = [mgpu.get_params(params, d) for d in devices]
        losses = [mgpu.train_batch(X, y, replicas, devices, 0.1) for _ in range(3)]
        mallocs = mgpu.gpu_memory_stats(G0)["device_mallocs"]
        mgpu.train_batch(X, y, replicas, devices, 0.1)
        mgpu.waitall()
        steady = mgpu.gpu_memory_stats(G0)["device_mallocs"] == mallocs
        return ([p.numpy() for p in replicas[0]],
                [[float(v.item()) for v in step] for step in losses],
                steady)

    plain_params, plain_losses, _ = steps(graph=False)
    graph_params, graph_losses, steady = steps(graph=True)
    for a, b in zip(plain_params, graph_params):
        np.testing.assert_array_equal(a, b)
    assert graph_losses == plain_losses
    assert len({tuple(step) for step in graph_losses}) == 3, "every step's loss should differ"
    assert steady, "a replayed step called cudaMalloc"


@needs_gpus(1)
def test_bad_label_inside_a_replayed_graph_is_an_index_error(monkeypatch):
    monkeypatch.delenv("MGPU_CUDA_GRAPH", raising=False)
    X, y = _batch(4, seed=4)
    params = [mgpu.get_params(mgpu.lenet_params(seed=1), G0)]
    mgpu.train_batch(X, y, params, [G0], 0.1)  # captured here
    mgpu.waitall()
    # On the GPU, so the step cannot check them on the host first (that raises at the call).
    bad = mgpu.array(np.array([1, 2, 10, 3], dtype=np.int64), device=G0)
    mgpu.train_batch(X, bad, params, [G0], 0.1)  # replayed with a label out of range
    with pytest.raises(IndexError, match=r"label 10.*row 2"):
        mgpu.waitall()
    mgpu.train_batch(X, y, params, [G0], 0.1)  # the device recovers
    mgpu.waitall()


@needs_gpus(1)
def test_a_bad_label_survives_a_later_replay_before_the_wait(monkeypatch):
    """Every replay of a graph writes the same flag buffer: a clean replay must not erase the
    verdict of an earlier one that nobody has waited for yet (inputs already on the GPU, so no
    copy makes the host wait in between)."""
    monkeypatch.delenv("MGPU_CUDA_GRAPH", raising=False)
    params = mgpu.get_params(mgpu.lenet_params(seed=0), G0)
    rng = np.random.default_rng(0)
    X = mgpu.array(rng.random((4, 1, 28, 28), dtype=np.float32), device=G0)
    y = mgpu.array(np.array([1, 2, 3, 4], dtype=np.int64), device=G0)
    bad = mgpu.array(np.array([1, 2, 99, 4], dtype=np.int64), device=G0)
    mgpu.train_batch(X, y, [params], [G0], 0.1)  # captured
    mgpu.waitall()
    mgpu.train_batch(X, bad, [params], [G0], 0.1)
    mgpu.train_batch(X, y, [params], [G0], 0.1)
    with pytest.raises(IndexError, match=r"label 99 in row 2"):
        mgpu.waitall()


_BATCH_ON_GPU = """
import os, sys, numpy as np, mgpu
os.environ["MGPU_CUDA_GRAPH"] = sys.argv[1]
G0, G1 = mgpu.gpu(0), mgpu.gpu(1)
rng = np.random.default_rng(8)
X = mgpu.array(rng.random((4, 1, 28, 28), dtype=np.float32), device=G0)
y = mgpu.array(rng.integers(0, 10, 4).astype(np.int64), device=G0)
replicas = [mgpu.get_params(mgpu.lenet_params(seed=0), d) for d in (G0, G1)]
losses = mgpu.train_batch(X, y, replicas, [G0, G1], 0.1)
print(repr([float(l.item()) for l in losses] + [float(replicas[1][0].numpy().sum())]))
"""


@needs_gpus(2)
def test_fused_step_with_the_batch_already_on_a_gpu(tmp_path):
    """X and y on gpu(0): gpu(1)'s shard is copied from gpu(0)'s queue, which must not wait
    behind gpu(0)'s part of the all-reduce (that part waits for gpu(1): a deadlock). Run in a
    subprocess with a time limit, so a regression fails instead of hanging the suite."""
    env = dict(os.environ, PYTHONPATH=str(Path(mgpu.__file__).parent.parent))
    outs = []
    for graph in ("0", "1"):
        try:
            r = subprocess.run([sys.executable, "-c", _BATCH_ON_GPU, graph], env=env,
                               capture_output=True, text=True, timeout=300, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            pytest.fail(f"train_batch with X on gpu(0) hung (MGPU_CUDA_GRAPH={graph})")
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip().splitlines()[-1])
    assert outs[0] == outs[1]


@needs_gpus(1)
def test_bad_label_on_a_gpu_is_an_index_error_at_the_next_wait():
    logits = mgpu.zeros((3, 4), device=G0)
    labels = mgpu.array(np.array([0, 7, 1], dtype=np.int64), device=G0)
    loss = mgpu.cross_entropy(logits, labels)  # enqueued: the check happens on the device
    with pytest.raises(IndexError, match=r"label 7.*row 1"):
        loss.numpy()
    good = mgpu.array(np.array([0, 3, 1], dtype=np.int64), device=G0)
    assert_close(mgpu.cross_entropy(logits, good).numpy(), np.full(3, np.log(4.0)))


@pytest.mark.skipif(not EMULATED, reason="checks the emulated build's refusals")
@pytest.mark.parametrize("var,value", [("MGPU_CONV", "cudnn"), ("MGPU_GEMM", "cublas"),
                                       ("MGPU_CONV", "fast"), ("MGPU_GEMM", "mkl")])
def test_vendor_paths_are_refused_by_the_emulated_build(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    x = mgpu.ones((1, 1, 4, 4), device=G0)
    w = mgpu.ones((1, 1, 3, 3), device=G0)
    with pytest.raises(ValueError, match=f"{var}={value}"):
        if var == "MGPU_CONV":
            mgpu.conv2d(x, w)
        else:
            mgpu.mm(x.reshape(4, 4), x.reshape(4, 4))


@needs_gpus(2)
def test_the_main_command_trains_on_two_gpus(tmp_path):
    """`python -m mgpu train --num-gpus 2` on (emulated) GPUs, a short run on the real data."""
    data = Path("/usr/share/datasets/fashion-mnist")
    if not data.exists() and not os.environ.get("MGPU_DATA"):
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(mgpu.__file__).parent.parent)
    out = subprocess.run(
        [sys.executable, "-m", "mgpu", "train", "--num-gpus", "2", "--batch-size", "16",
         "--limit-batches", "2", "--epochs", "1", "--lr", "0.2"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "on [gpu(0), gpu(1)]" in out.stdout and "test acc:" in out.stdout, out.stdout


@needs_gpus(2)
@pytest.mark.parametrize("transport", ["nccl", "host"])
def test_two_processes_on_gpus_equal_one_process_with_two_gpus(tmp_path, monkeypatch, transport):
    """mpirun -np 2, one GPU each: bitwise the parameters of one process stepping on two GPUs.
    The gradients cross processes on an NCCL communicator over both ranks (its unique id
    broadcast over MPI; on the emulator's NCCL, whose ranks in two processes meet in shared
    memory and sum in rank order), or through host memory over MPI (MGPU_DIST_GPU=host)."""
    import dist_worker
    import test_distributed as td
    if not td.HAVE_MPI:
        pytest.skip("needs mpirun and an mgpu built with MPI")
    if mgpu.distributed.launched():
        pytest.skip("this pytest itself runs under mpirun")
    if transport == "nccl" and not EMULATED:
        pytest.skip("NCCL across processes runs on the emulated build only (not yet on GPUs)")
    steps, batch = 2, 8
    env = {"MGPU_TEST_ON_GPUS": "1", "PYTHONPATH": str(Path(mgpu.__file__).parent.parent),
           "MGPU_DIST_GPU": transport}
    rc, out, err, _ = td.mpirun(2, "train_steps", tmp_path, steps, batch, 1, env=env,
                                timeout=300, limit=600)
    assert rc == 0, f"{out}\n{err}"
    for r in range(2):
        assert f"rank {r}: GPU transport {transport}" in out, out
    monkeypatch.setenv("MGPU_TEST_ON_GPUS", "1")
    replicas, _ = dist_worker.fused_steps(steps, batch, 2)
    for r in range(2):
        got = td.params_of(td.load(tmp_path, "train_L1", r))
        for i, p in enumerate(replicas[0]):
            np.testing.assert_array_equal(got[i], p.numpy(), err_msg=f"param {i} on rank {r}")


@needs_gpus(2)
def test_init_backend_nccl_trains_like_one_process_and_like_host_staging(tmp_path, monkeypatch):
    """mpirun -np 2, one emulated GPU each, init(backend="nccl"): the fused steps' gradients
    cross processes on the NCCL communicator over both ranks (the emulator's NCCL; compiled and
    linked only in the real CUDA build), giving bitwise the parameters of one process stepping on
    two GPUs and of backend "mpi" with MGPU_DIST_GPU=host (through host memory over MPI)."""
    import dist_worker
    import test_distributed as td
    if not td.HAVE_MPI:
        pytest.skip("needs mpirun and an mgpu built with MPI")
    if mgpu.distributed.launched():
        pytest.skip("this pytest itself runs under mpirun")
    if not EMULATED:
        pytest.skip("NCCL across processes runs on the emulated build only (not yet on GPUs)")
    monkeypatch.delenv("MGPU_DIST_GPU", raising=False)
    steps, batch = 3, 8
    base = {"MGPU_TEST_ON_GPUS": "1", "PYTHONPATH": str(Path(mgpu.__file__).parent.parent)}
    runs = {}
    for transport, backend, extra in (("nccl", "nccl", {}),
                                      ("host", "mpi", {"MGPU_DIST_GPU": "host"})):
        out_dir = tmp_path / transport
        out_dir.mkdir()
        env = dict(base, MGPU_TEST_BACKEND=backend, **extra)
        rc, out, err, _ = td.mpirun(2, "train_steps", out_dir, steps, batch, 1, env=env,
                                    timeout=300, limit=600)
        assert rc == 0, f"{out}\n{err}"
        for r in range(2):
            assert f"rank {r}: GPU transport {transport}, backend {backend}" in out, out
        runs[transport] = [td.params_of(td.load(out_dir, "train_L1", r)) for r in range(2)]
    monkeypatch.setenv("MGPU_TEST_ON_GPUS", "1")
    replicas, _ = dist_worker.fused_steps(steps, batch, 2)
    for r in range(2):
        for i, p in enumerate(replicas[0]):
            np.testing.assert_array_equal(runs["nccl"][r][i], p.numpy(),
                                          err_msg=f"param {i} on rank {r} vs 1 process x 2 GPUs")
            np.testing.assert_array_equal(runs["nccl"][r][i], runs["host"][r][i],
                                          err_msg=f"param {i} on rank {r} vs MGPU_DIST_GPU=host")
    assert not np.array_equal(runs["nccl"][0][4], mgpu.lenet_params(seed=0)[4].numpy()), \
        "training did not move W3"


# ---- real GPUs only: the vendor libraries against our kernels ---------------------------------

@real_gpu
def test_cublas_matches_our_gemm_kernel(monkeypatch, rng):
    a = rng.normal(size=(67, 45)).astype(np.float32)
    b = rng.normal(size=(45, 33)).astype(np.float32)
    monkeypatch.setenv("MGPU_GEMM", "cublas")
    vendor = mgpu.mm(mgpu.array(a, device=G0), mgpu.array(b, device=G0)).numpy()
    monkeypatch.setenv("MGPU_GEMM", "native")
    ours = mgpu.mm(mgpu.array(a, device=G0), mgpu.array(b, device=G0)).numpy()
    assert_close(vendor, ours)
    assert_close(ours, a.astype(np.float64) @ b.astype(np.float64))


@real_gpu
@pytest.mark.skipif("built" != mgpu.build_info()["cudnn"], reason="this build has no cuDNN")
def test_cudnn_conv_matches_our_kernels(monkeypatch, rng):
    x = mgpu.array(rng.normal(size=(4, 20, 13, 13)).astype(np.float32), device=G0)
    w = mgpu.array(rng.normal(size=(50, 20, 5, 5)).astype(np.float32), device=G0)
    b = mgpu.array(rng.normal(size=(50,)).astype(np.float32), device=G0)
    results = {}
    for path in ("cudnn", "native"):
        monkeypatch.setenv("MGPU_CONV", path)
        xs, ws, bs = (t.copyto(G0) for t in (x, w, b))
        for t in (xs, ws, bs):
            t.attach_grad()
        with mgpu.autograd.record():
            out = mgpu.conv2d(xs, ws, bs, padding=1)
        out.backward()
        results[path] = [out.numpy(), xs.grad.numpy(), ws.grad.numpy(), bs.grad.numpy()]
    for v, o in zip(results["cudnn"], results["native"]):
        assert_close(v, o)


@needs_gpus(2)
def test_nccl_matches_the_peer_copy_allreduce(monkeypatch, rng):
    """Every GPU of the process (test_gpu_defects.py runs it on 3 and 4 emulated GPUs). The
    emulated NCCL sums in rank order as the peer-copy path does: bitwise equal there (and with 2
    GPUs anywhere); real NCCL within what another order of the k additions can give."""
    k = NUM_GPUS
    values = [rng.normal(size=(1000, 3)).astype(np.float32) for _ in range(k)]
    out = {}
    for algo in ("peer", "nccl"):
        if algo == "peer":
            monkeypatch.setenv("MGPU_ALLREDUCE", "peer")
        else:
            monkeypatch.delenv("MGPU_ALLREDUCE", raising=False)
        ts = [mgpu.array(v, device=mgpu.gpu(d)) for d, v in enumerate(values)]
        mgpu.allreduce(ts)
        out[algo] = [t.numpy() for t in ts]
    expected = sum(v.astype(np.float64) for v in values)
    for d, (a, b) in enumerate(zip(out["peer"], out["nccl"])):
        assert_close(b, expected, what="nccl", device=mgpu.gpu(d))  # a sum of k float32 terms
        if EMULATED or k <= 2:
            np.testing.assert_array_equal(a, b, err_msg=f"gpu({d}): nccl differs from peer")
        else:  # real NCCL's ring or tree order against the peer path's device order
            assert_sum_of_k(b, a, values, k, f"gpu({d}): nccl against peer")
