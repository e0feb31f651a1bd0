"""The all-reduce's NCCL path on the emulated NCCL (cpp/cuda/emu/nccl_emu.h), the
GPU review's findings 5 (a failed NCCL collective: communicators never polled for asynchronous
errors, never aborted, the communication stream not joined back on the error path) and 7 (no time
limit on the in-process NCCL path), with the emulator's fault injection: MGPU_EMU_NCCL_FAIL,
MGPU_EMU_NCCL_STALL.

Each fault runs in a child process with a time limit, so a regression that hangs fails the test
instead of hanging the suite, and no error left on a device reaches the next test.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mgpu

pytestmark = pytest.mark.gpu

NUM_GPUS = mgpu.num_gpus()
EMULATED = bool(mgpu.build_info()["cuda_emulation"])
HERE = Path(__file__).resolve().parents[1]

emulated_only = pytest.mark.skipif(
    not EMULATED or NUM_GPUS < 1, reason="injects faults into the emulated NCCL")

# The child: one all-reduce under the fault (set after mgpu has started, as a fault would come),
# then, with the fault gone, all-reduces that must be exact. It prints what happened.
_CHILD = r"""
import os, sys, time
import numpy as np
import mgpu

k = mgpu.num_gpus()
fault = {name: value for name, value in (a.split("=", 1) for a in sys.argv[1:])}
rng = np.random.default_rng(5)

def run(values):
    ts = [mgpu.array(v, device=mgpu.gpu(d)) for d, v in enumerate(values)]
    mgpu.allreduce(ts)
    return [t.numpy() for t in ts]

def values():
    return [rng.normal(size=(1031,)).astype(np.float32) for _ in range(k)]

def rank_order_sum(vs):
    acc = vs[0].copy()
    for v in vs[1:]:
        acc = acc + v
    return acc

run(values())  # the communicators exist before the fault
os.environ.update(fault)
start = time.monotonic()
try:
    run(values())
    print("NO ERROR")
except RuntimeError as e:
    print("ERROR after %.1f s: %s" % (time.monotonic() - start, e))
for d in range(k):  # every device's part reports its failure once
    try:
        mgpu.waitall()
    except RuntimeError:
        pass
for name in fault:
    del os.environ[name]
for _ in range(2):
    vs = values()
    got = run(vs)
    for d in range(k):
        np.testing.assert_array_equal(got[d], rank_order_sum(vs))
print("RECOVERED")
"""


def _child(count, *fault, timeout=300, extra_env=None):
    env = dict(os.environ, MGPU_EMULATED_GPUS=str(count), MGPU_NCCL_TIMEOUT_S="2")
    env.pop("MGPU_ALLREDUCE", None)
    env.update(extra_env or {})
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, *fault], cwd=HERE, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {timeout} s under {fault}: {e.stdout!r}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@emulated_only
@pytest.mark.parametrize("count", [2, 3])
def test_an_asynchronous_nccl_error_is_raised_and_the_next_allreduce_works(count):
    """Finding 5: a collective that fails on the devices (a peer died mid-collective) left the
    gradients unreduced without a word; now the communicators' asynchronous errors are polled,
    the failure is a DeviceError, the communicators are aborted and the next all-reduce makes
    new ones (the old ones keep their error: reused, every later all-reduce would fail)."""
    out = _child(count, "MGPU_EMU_NCCL_FAIL=async")
    assert "ERROR after" in out and "failed asynchronously" in out, out
    assert "remote process exited" in out and "RECOVERED" in out, out


@emulated_only
@pytest.mark.parametrize("call", ["allreduce", "allreduce:1"])
def test_a_failed_nccl_call_is_raised_and_the_next_allreduce_works(call):
    """A call refused at once (on every rank, or on rank 1 after rank 0's was queued in the
    group): a DeviceError naming the call; the group is closed and the next all-reduce works."""
    out = _child(2, f"MGPU_EMU_NCCL_FAIL={call}")
    assert "ERROR after" in out and "ncclAllReduce failed" in out, out
    assert "RECOVERED" in out, out


@emulated_only
@pytest.mark.parametrize("count,rank", [(2, 1), (3, 0)])
def test_a_collective_that_never_finishes_times_out_and_the_next_allreduce_works(count, rank):
    """Finding 7: a rank that never arrives hung every later wait on those GPUs for ever (the
    child ran into the test's time limit). Now a watchdog aborts the communicators after
    MGPU_NCCL_TIMEOUT_S (2 s here), the all-reduce raises a DeviceError saying so, and the next
    all-reduce builds new communicators."""
    out = _child(count, f"MGPU_EMU_NCCL_STALL={rank}", timeout=120)
    assert "ERROR after" in out and "did not finish within 2" in out, out
    assert "MGPU_NCCL_TIMEOUT_S" in out and "RECOVERED" in out, out


@emulated_only
def test_a_bad_nccl_timeout_is_a_value_error(monkeypatch):
    if NUM_GPUS < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.delenv("MGPU_ALLREDUCE", raising=False)
    monkeypatch.setenv("MGPU_NCCL_TIMEOUT_S", "soon")
    ts = [mgpu.ones((3,), device=mgpu.gpu(d)) for d in range(2)]
    with pytest.raises(ValueError, match="MGPU_NCCL_TIMEOUT_S.*'soon'"):
        mgpu.allreduce(ts)


@emulated_only
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_nccl_path_on_the_strict_emulator(seed):
    """Streams run behind the host in a seeded order (MGPU_EMU_STRICT=1): the compute stream must
    wait for the communication stream's reduction and unpacking before it reads the gradients,
    and the flat buffers may be reused only after. On 3 GPUs, so a wrong rank order in the sum
    changes bits. A planted missing wait of the communication stream for the compute stream's
    packing (allreduce_gpu.cpp, run_nccl) fails every seed: the emulated collective is work
    queued on the communication stream, so it read the packed buffer's poison (NaN).

    Seed 3 also runs the fused step (its overlapped buckets: several collectives queued on every
    communication stream at once). It deadlocked there (and under seed 1) before the fix: a thread
    that ran one rank's collective waited inside it while holding that rank's stream and, through
    the old progress rule, the other ranks' streams it had run into, which the other devices'
    workers needed (gdb: worker 2 held the streams of devices 0 and 1 while the workers of
    devices 0 and 1 waited for them). Now a collective never waits while its thread holds a stream
    (cpp/cuda/emu/state.cpp, block_stream)."""
    env = dict(os.environ, MGPU_EMULATED_GPUS="3", MGPU_EMU_STRICT="1", MGPU_EMU_SEED=str(seed))
    env.pop("MGPU_ALLREDUCE", None)
    select = "allreduce_on_gpus_matches or nccl_matches_the_peer"
    if seed == 3:
        select += " or fused_step_on_every_gpu"
    run = _run_with_limit(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "gpu/test_gpu.py",
         "-k", select], env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout


def _run_with_limit(cmd, env):
    """The child under the suite's child watchdog (py-spy stacks and the seed when it hangs)."""
    from test_gpu_defects import _run_with_watchdog
    return _run_with_watchdog(cmd, cwd=HERE, env=env,
                              limit=float(os.environ.get("MGPU_TEST_CHILD_LIMIT", "900")))


# The child of the group test: fused LeNet steps on every GPU (one grouped ncclAllReduce per
# gradient bucket, issued by gpu(0)'s worker for all ranks), one step with the last rank's call of
# every group refused, then fresh replicas trained from the start on the GPUs and on cpu(0).
_GROUP_CHILD = r"""
import os, sys
import numpy as np
import mgpu
import conftest  # puts every test folder on sys.path: test_gpu is in gpu/
from test_gpu import _batch, _start, assert_same_update

fault = sys.argv[1]
k = mgpu.num_gpus()
gpus = [mgpu.gpu(d) for d in range(k)]
X, y = _batch(12, seed=4)

def steps(devices, n):
    replicas = [mgpu.get_params(mgpu.lenet_params(seed=3), d) for d in devices]
    for _ in range(n):
        mgpu.train_batch(X, y, replicas, devices, 0.2)
    return [[p.numpy() for p in r] for r in replicas]

steps(gpus, 1)  # communicators and graphs exist before the fault
os.environ["MGPU_EMU_NCCL_FAIL"] = fault
try:
    steps(gpus, 1)
    print("NO ERROR")
except RuntimeError as e:
    print("ERROR:", e)
for _ in range(k):  # every device's part reports its failure once
    try:
        mgpu.waitall()
    except RuntimeError:
        pass
del os.environ["MGPU_EMU_NCCL_FAIL"]
got = steps(gpus, 2)
(ref,) = steps([mgpu.cpu(0)], 2)
for i, (r, s) in enumerate(zip(ref, _start())):
    for d in range(1, k):
        np.testing.assert_array_equal(
            got[d][i], got[0][i],
            err_msg=f"param {i}: gpu({d}) differs from gpu(0) after the failed group: its "
                    "all-reduce did not run (a group left open holds back every later call)")
    assert_same_update(got[0][i], r, s, f"param {i} after the failed group", gpus[0])
print("RECOVERED")
"""


@emulated_only
@pytest.mark.parametrize("count,strict", [(3, "0"), (4, "1")], ids=["3-gpus", "4-gpus-strict"])
def test_a_call_failing_inside_a_bucket_group_closes_the_group(count, strict):
    """Finding 6: a throw between ncclGroupStart and ncclGroupEnd (the last rank's ncclAllReduce of
    a bucket's group refused, after the other ranks' calls were queued in the group) left the group
    open on gpu(0)'s worker thread; every later group on that thread was then nested in it, so its
    ncclGroupEnd launched nothing: the next steps' gradients were never reduced, silently (the
    issue expected a hang; as every rank's call is held back in the same open group, nothing
    launches and nothing waits: the replicas drift apart). Now the group is ended on every throw
    path (allreduce_gpu.cpp, NcclGroup), the step raises a DeviceError naming the call, and the
    next steps are exact. A planted destructor that leaves the group open fails both cases (gpu(1)
    differs from gpu(0); no hang) and both cases of
    test_a_failed_nccl_call_is_raised_and_the_next_allreduce_works (the sums are not reduced)."""
    env = dict(os.environ, MGPU_EMULATED_GPUS=str(count), MGPU_NCCL_TIMEOUT_S="20",
               MGPU_EMU_STRICT=strict)
    env.pop("MGPU_ALLREDUCE", None)
    env.pop("MGPU_EMU_NCCL_FAIL", None)
    run = _run_with_limit([sys.executable, "-c", _GROUP_CHILD, f"allreduce:{count - 1}"], env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ERROR:" in run.stdout and "ncclAllReduce failed" in run.stdout, run.stdout
    assert "RECOVERED" in run.stdout, run.stdout


@emulated_only
@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_rank_that_never_arrives_across_processes_is_aborted_on_every_rank(strict, tmp_path):
    """NCCL across processes (NcclWorld, mgpu.distributed's GPU all-reduce): mpirun -np 2, rank
    1's collectives never arrive after a first all-reduce that works. Rank 0 (3 s limit) aborts
    the communicator at its deadline and raises saying it timed out; its abort ends rank 1's wait
    long before rank 1's own 60 s limit (the job's limit is 45 s); later all-reduces refuse to
    run on the broken world. On the lenient and the strict emulator (streams behind the host)."""
    import test_distributed as td
    if not td.HAVE_MPI:
        pytest.skip("needs mpirun and an mgpu built with MPI")
    if mgpu.distributed.launched():
        pytest.skip("this pytest itself runs under mpirun")
    env = {"PYTHONPATH": str(Path(mgpu.__file__).parent.parent), "MGPU_EMU_STRICT": strict}
    rc, out, err, _ = td.mpirun(2, "nccl_stall", tmp_path, timeout=60, env=env, limit=45)
    # Each rank's own file (mpirun's merged stdout may join two ranks' lines).
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("nccl_stall.rank*.txt")))
    lines = {line.split(": the ")[0] + " " + line.split(": the ")[1].split()[0]: line
             for line in logs.splitlines() if ": the " in line}
    assert rc != 0, "a broken world ends the job nonzero (no MPI_Finalize)"
    assert "rank 0: first all-reduce gave 3.0" in out and "rank 1: first all-reduce gave 3.0" in out
    stalled0, stalled1 = lines.get("rank 0 stalled", ""), lines.get("rank 1 stalled", "")
    assert "failed after" in stalled0 and "ncclAllReduce of 1000 float32 timed out" in stalled0
    assert "the communicator was aborted" in stalled0, out
    assert "failed after" in stalled1 and "timed out" not in stalled1, out
    assert "cannot run: an earlier collective failed" in lines.get("rank 0 next", ""), out
