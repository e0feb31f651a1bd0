"""GPU defects found in a review of the CUDA code, each with a test that fails on the code
before its fix.

Most run on the emulated GPUs (``.ci/test.sh`` runs the tests marked ``gpu`` against the emulated
build); the source checks run everywhere. Finding 9 (cuDNN) runs in the real CUDA build (the
installed package) on cuDNN's host-only calls; the NCCL findings are in test_nccl_emu.py.
"""
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dlpack_abi as dl
import mgpu

pytestmark = pytest.mark.gpu

NUM_GPUS = mgpu.num_gpus()
EMULATED = bool(mgpu.build_info()["cuda_emulation"])
CPP = Path(__file__).resolve().parents[2] / "cpp"


def needs_gpus(k):
    return pytest.mark.skipif(NUM_GPUS < k,
                              reason=f"needs {k} GPU(s), mgpu.num_gpus() == {NUM_GPUS}")


# A grid-stride loop: `for (T i = ...; i < n; i += ...gridDim... )` or `i += stride`, with the
# counter declared as T. The step is blockDim.x * gridDim.x (up to 2^31), so an int counter
# overflows once n is within one step of 2^31.
_GRID_STRIDE = re.compile(
    r"for\s*\(\s*(?P<type>[\w:]+(?:\s+int)?)\s+(?P<var>\w+)\s*=[^;]*;[^;]*;\s*(?P=var)\s*\+=\s*"
    r"(?P<step>[^)]*)\)")


def _grid_stride_loops():
    for path in sorted(CPP.rglob("*.cu")) + sorted(CPP.rglob("*.cuh")):
        text = path.read_text()
        for m in _GRID_STRIDE.finditer(text):
            step = m.group("step")
            if "gridDim" in step or "grid_stride" in step or step.strip() == "stride":
                line = text.count("\n", 0, m.start()) + 1
                yield f"{path.relative_to(CPP.parent)}:{line}", m.group("type"), m.group(0)


def test_every_grid_stride_loop_counts_in_64_bits():
    """Finding 10: `i += blockDim.x * gridDim.x` with an int i overflows near 2^31 elements."""
    if not CPP.is_dir():
        pytest.skip("needs the source tree (cpp/) next to tests/")
    loops = list(_grid_stride_loops())
    assert loops, "the pattern finds no grid-stride loop: it is out of date"
    narrow = [f"{where}: {code}" for where, type_, code in loops if type_ not in ("int64_t",)]
    assert not narrow, ("grid-stride loops with a counter narrower than 64 bits:\n"
                        + "\n".join(narrow))


@pytest.mark.skipif(EMULATED or mgpu.build_info()["cudnn"] != "built",
                    reason="needs a build that links cuDNN (a real CUDA build; no GPU needed)")
def test_cudnn_conv_of_an_empty_batch_builds_no_descriptor():
    """Finding 9: the cuDNN conv path asked for its workspace size first, building descriptors
    with N == 0, which cudnnSetTensor4dDescriptor refuses (CUDNN_STATUS_BAD_PARAM) before any
    N == 0 guard ran. cuDNN's descriptor calls are host-only, so this runs in the real CUDA build
    without a GPU (the installed package of .ci/test.sh): with no cuDNN handle, an empty batch or
    filter bank must return at the guard, while a non-empty shape gets its descriptors accepted
    and fails only at the first call that needs the handle. A planted guard that lets N == 0
    through fails here with "cudnnSetTensor4dDescriptor(x) failed: CUDNN_STATUS_BAD_PARAM". The
    backward's empty-batch branch needs a handle (its stream) and a GPU: it is not run here."""
    conv = mgpu._core._cudnn_conv_without_handle
    assert conv(0, 4) == 0  # empty batch
    assert conv(2, 0) == 0  # no filters
    with pytest.raises(mgpu.DeviceError, match="cudnnGetConvolutionForwardWorkspaceSize failed"):
        conv(2, 4)

def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    return mgpu.array(X), mgpu.array(y)


@needs_gpus(1)
@pytest.mark.skipif(not EMULATED, reason="injects a launch failure into the emulator")
def test_a_step_whose_capture_failed_is_captured_again_not_replayed(monkeypatch):
    """Finding 3: an op failing while the step is captured leaves graphs without its work. The
    error is raised once; later steps must not replay those graphs (they would compute something
    else silently) but capture the step anew."""
    g0 = mgpu.gpu(0)
    monkeypatch.delenv("MGPU_CUDA_GRAPH", raising=False)
    X, y = _batch(4, seed=11)
    params = [mgpu.get_params(mgpu.lenet_params(seed=2), g0)]
    monkeypatch.setenv("MGPU_EMU_FAIL_CAPTURED_KERNEL", "avg_pool2d_forward")
    mgpu.train_batch(X, y, params, [g0], 0.1)  # captured here, and the capture fails
    with pytest.raises(RuntimeError, match="avg_pool2d_forward.*on purpose"):
        mgpu.waitall()
    monkeypatch.delenv("MGPU_EMU_FAIL_CAPTURED_KERNEL")
    # The failed step left garbage in the parameters: back to the start, in place (the captured
    # step is cached for these very tensors).
    start = [p.numpy().copy() for p in mgpu.lenet_params(seed=2)]
    for p, a in zip(params[0], start):
        p[:] = mgpu.array(a, device=g0)

    def two_steps(replicas):
        losses = [float(mgpu.train_batch(X, y, replicas, [g0], 0.1)[0].item()) for _ in range(2)]
        mgpu.waitall()
        return [p.numpy() for p in replicas[0]], losses

    graph_params, graph_losses = two_steps(params)  # the same replicas: the same cache entry
    monkeypatch.setenv("MGPU_CUDA_GRAPH", "0")
    plain = [mgpu.get_params([mgpu.array(a) for a in start], g0)]
    plain_params, plain_losses = two_steps(plain)
    assert graph_losses == plain_losses
    for a, b in zip(graph_params, plain_params):
        np.testing.assert_array_equal(a, b)


# ---- DLPack import from a producer on one of our GPUs (findings 1 and 2) ----------------------
class _GpuProducer:
    """A foreign DLPack producer of float32 memory on gpu(i), as PyTorch or CuPy would be: the
    memory is an mgpu tensor's (kept alive here), exported under the producer's own deleter,
    which poisons the memory with NaN -- as a caching allocator reusing it would overwrite it."""

    def __init__(self, values, gpu_index):
        self.owner = mgpu.array(values, device=mgpu.gpu(gpu_index))
        mgpu.waitall()
        self._own_capsule = self.owner._t.to_dlpack()
        managed = ctypes.cast(dl.capsule_pointer(self._own_capsule, b"dltensor"),
                              ctypes.POINTER(dl.DLManagedTensor)).contents
        self.data = managed.dl_tensor.data
        self.n = values.size
        self.gpu_index = gpu_index
        self.streams = []
        self.released = False
        self._shape = (ctypes.c_int64 * 1)(self.n)
        self._deleter = dl.DELETER(self._release)
        self._managed = dl.DLManagedTensor(
            dl.DLTensor(self.data, dl.DLDevice(2, gpu_index), 1, dl.DLDataType(2, 32, 1),
                        self._shape, None, 0), None, self._deleter)

    def _release(self, _):
        ctypes.memmove(self.data, np.full(self.n, np.nan, np.float32).ctypes.data, 4 * self.n)
        self.released = True

    def __dlpack_device__(self):
        return (2, self.gpu_index)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        return dl.capsule_new(ctypes.addressof(self._managed), b"dltensor", None)


@needs_gpus(1)
@pytest.mark.skipif(not EMULATED, reason="emulated device memory is host memory the test can read")
def test_dlpack_import_asks_the_producer_to_order_its_work_before_mgpus_stream():
    """Finding 1: the consumer passes `stream`, so the producer's pending kernels come first."""
    producer = _GpuProducer(np.arange(5, dtype=np.float32), 0)
    t = mgpu.from_dlpack(producer)
    assert producer.streams == [mgpu._core._dlpack_stream(0)]
    assert producer.streams[0] not in (None, 0, 1, 2), "a real stream of mgpu's, not a default one"
    np.testing.assert_array_equal((t * 2).numpy(), np.arange(5, dtype=np.float32) * 2)


@needs_gpus(1)
@pytest.mark.skipif(not EMULATED, reason="emulated device memory is host memory the test can read")
def test_dlpack_import_gives_memory_back_only_after_mgpus_work_on_it():
    """Finding 2: the producer's deleter (here: poisoning the memory) runs only once mgpu's queued
    kernels on it are finished, not when the last handle goes. Shows on the strict emulator
    (MGPU_EMU_STRICT=1: streams run behind the host); on the lenient one kernels finish as they
    are launched."""
    values = np.linspace(-1, 1, 4096, dtype=np.float32)
    producer = _GpuProducer(values, 0)
    t = mgpu.from_dlpack(producer)
    out = [t * 3, t + 1]
    del t  # the last handle: the tasks above hold the memory until they have launched
    mgpu.waitall()
    assert producer.released
    np.testing.assert_array_equal(out[0].numpy(), values * 3)
    np.testing.assert_array_equal(out[1].numpy(), values + 1)


# ---- More GPUs: the all-reduce and the fused step on 3 and 4 emulated GPUs --------------------
@needs_gpus(1)
@pytest.mark.skipif(not EMULATED, reason="sets the emulated GPU count of a child process")
@pytest.mark.parametrize("count,peer,path", [(3, "1", "nccl"), (3, "1", "peer"), (4, "1", "nccl"),
                                              (4, "1", "peer"), (2, "0", "peer")],
                         ids=["3-gpus-nccl", "3-gpus-peer", "4-gpus-nccl", "4-gpus-peer",
                              "2-gpus-without-peer-access"])
def test_collectives_and_the_fused_step_on_more_gpus(count, peer, path):
    """The tests that use every GPU of the process, in a child with MGPU_EMULATED_GPUS=count
    (the chunks each device reduces, and whom it fetches them from, change with the count), on
    the emulated NCCL (the default) and on the peer-copy path (MGPU_ALLREDUCE=peer); and on GPUs
    without peer access (MGPU_EMU_PEER_ACCESS=0), where a kernel reading another device's memory
    is an illegal address: data crosses devices only by peer copies."""
    env = dict(os.environ, MGPU_EMULATED_GPUS=str(count), MGPU_EMU_PEER_ACCESS=peer)
    env.pop("MGPU_ALLREDUCE", None)
    if path == "peer":
        env["MGPU_ALLREDUCE"] = "peer"
    here = Path(__file__).resolve().parents[1]
    run = _run_with_watchdog(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "gpu/test_gpu.py", "-k",
         "allreduce_on_gpus_matches or fused_step_on_every_gpu or nccl_matches_the_peer"],
        cwd=here, env=env, limit=float(os.environ.get("MGPU_TEST_CHILD_LIMIT", "600")))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout


def _run_with_watchdog(cmd, cwd, env, limit):
    """Runs a child test process; past `limit` seconds it is a failure that shows where the child
    waits (py-spy's native stacks of every thread, when py-spy is installed) and the strict
    emulator's seed to replay it, instead of a hang of the whole suite."""
    import shutil
    child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(timeout=limit)
        return subprocess.CompletedProcess(cmd, child.returncode, out, err)
    except subprocess.TimeoutExpired:
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        stacks = "(py-spy not installed: no stacks)"
        if os.path.exists(spy):
            dump = subprocess.run([spy, "dump", "--native", "--pid", str(child.pid)],
                                  capture_output=True, text=True, timeout=120)
            stacks = dump.stdout[-12000:] + dump.stderr[-2000:]
        child.kill()
        out, err = child.communicate()
        seed = (f"MGPU_EMU_STRICT={env.get('MGPU_EMU_STRICT', '0')} "
                f"MGPU_EMU_SEED={env.get('MGPU_EMU_SEED', '1')}")
        pytest.fail(f"child still running after {limit:.0f} s ({seed}); its stacks:\n{stacks}\n"
                    f"its output:\n{out[-3000:]}\n{err[-2000:]}")


@needs_gpus(1)
def test_host_to_device_copies_reuse_staging_buffers_only_after_their_copies(rng):
    """Two pinned staging buffers take turns: one is refilled only once its previous copy has
    left it. Three chunks per copy and two copies back to back reuse both; on the strict
    emulator (copies run behind the host) a missing wait shows as wrong data."""
    g0 = mgpu.gpu(0)
    first = rng.normal(size=(5, 1024, 1024)).astype(np.float32)  # 20 MiB: 8 + 8 + 4 MiB
    second = rng.normal(size=(5, 1024, 1024)).astype(np.float32)
    a = mgpu.array(first, device=g0)
    b = mgpu.array(second, device=g0)
    np.testing.assert_array_equal(a.numpy(), first)
    np.testing.assert_array_equal(b.numpy(), second)


# The capture of a fused step on gpu(0) in thread A is held open: the byte budget of a queue's
# run-ahead is one byte, and gpu(0)'s worker is first kept busy by matrix products, so A waits
# inside the capture (after its first task) for them. Meanwhile this thread copies to gpu(0).
_COPY_DURING_CAPTURE = """
import os, sys, threading, time, numpy as np, mgpu
assert os.environ["MGPU_QUEUE_MAX_BYTES"] == "1"
g0 = mgpu.gpu(0)
rng = np.random.default_rng(3)
X = mgpu.array(rng.random((4, 1, 28, 28), dtype=np.float32))
y = mgpu.array(rng.integers(0, 10, 4).astype(np.int64))
params = [mgpu.get_params(mgpu.lenet_params(seed=1), g0)]
a = mgpu.array(np.full((128, 128), 0.01, np.float32), device=g0)
mgpu.waitall()
base = mgpu.gpu_memory_stats(g0)["allocated"]
busy = [mgpu.mm(a, a) for _ in range(int(sys.argv[1]))]
flat = sum(int(np.prod(p.shape)) for p in params[0]) * 4
out = {}
step = threading.Thread(
    target=lambda: out.setdefault("loss", mgpu.train_batch(X, y, params, [g0], 0.1)))
step.start()
# The capture allocates its gradient buffer just before its first task.
while mgpu.gpu_memory_stats(g0)["allocated"] < base + len(busy) * 128 * 128 * 4 + flat:
    time.sleep(0.01)
time.sleep(0.3)
values = rng.normal(size=3000).astype(np.float32)
t = mgpu.array(values, device=g0)
again = mgpu.array(values + 1, device=g0)  # its staging buffer was last used by the copy above
step.join()
mgpu.waitall()
assert np.array_equal(t.numpy(), values), t.numpy()[:4]
assert np.array_equal(again.numpy(), values + 1)
print("copies ok, loss", float(out["loss"][0].item()))
"""


@needs_gpus(1)
def test_another_threads_ops_do_not_land_in_a_capture():
    """Finding 8: while one thread captures the fused step as CUDA graphs, another thread's ops
    on the same GPU must run (after the capture), not be recorded into the graph. Recorded, a
    host-to-device copy never fills its tensor, its staging event becomes a captured event (the
    next copy's cudaEventSynchronize fails with cudaErrorCapturedEvent) and every replay of the
    step would copy again from the other thread's long-gone host buffer. In a child process:
    the queue's byte budget is read once per process."""
    env = dict(os.environ, MGPU_QUEUE_MAX_BYTES="1", MGPU_CUDA_GRAPH="1",
               PYTHONPATH=str(Path(mgpu.__file__).parent.parent))
    run = subprocess.run([sys.executable, "-c", _COPY_DURING_CAPTURE, "3"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "copies ok" in run.stdout
