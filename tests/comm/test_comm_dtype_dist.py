"""Gradients all-reduced in bfloat16 across mpirun's ranks: 2 ranks x 1 CPU device, the rank-
ordered reduce-scatter and all-gather carrying bfloat16 bits (MPI_UINT16_T), and MPI's own
MPI_Iallreduce with a user-defined bfloat16 sum. Checked exactly against NumPy: each rank's
gradients rounded to bfloat16, added in float32 in rank order, the sum rounded once; with 2
devices per rank, each rank's sum of its devices is rounded so before the ranks add them. One
emulated GPU per rank, on the NCCL transport and staged through host memory."""
import os
import sys

import numpy as np
import pytest

import mgpu
from comm_dtype_worker import dyadic_problem, exact_grads
from test_comm_dtype import ranges
from test_comm_dtype_bucketed import bf16, reference
from test_distributed import HERE, MPIRUN, needs_mpi, run_watched


def run_worker(outdir, *args, **extra_env):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MGPU_DIST_CHECK="1", MGPU_DIST_TIMEOUT="60", **extra_env)
    env.pop("MGPU_NUM_THREADS", None)
    cmd = [MPIRUN, "-np", "2", "--oversubscribe", sys.executable,
           os.path.join(HERE, "comm", "comm_dtype_worker.py"), str(outdir), *args]
    rc, out, err, _ = run_watched(cmd, env, 120, "mpirun comm_dtype_worker")
    assert rc == 0, f"mpirun comm_dtype_worker failed:\n{out}\n{err}"


@needs_mpi
def test_two_ranks_reduce_in_bf16(tmp_path):
    run_worker(tmp_path)
    want, exact = reference(2)
    for r in range(2):
        got = np.load(tmp_path / f"comm_dtype.rank{r}.npz")
        for name in ("bf16", "bf16_mpi"):
            np.testing.assert_array_equal(got[f"{name}_w"], want[0], err_msg=f"rank {r} {name}")
            np.testing.assert_array_equal(got[f"{name}_b"], want[1], err_msg=f"rank {r} {name}")
        np.testing.assert_array_equal(got["f32_w"], exact[0], err_msg=f"rank {r} float32")
        np.testing.assert_array_equal(got["f32_b"], exact[1], err_msg=f"rank {r} float32")
        assert not np.array_equal(got["bf16_w"], got["f32_w"])
        assert got["f32_bytes"] == 4 * (want[0].size + want[1].size)
        assert got["bf16_bytes"] * 2 == got["f32_bytes"] == got["bf16_mpi_bytes"] * 2
        for i, name in enumerate(("two_w", "two_b")):
            np.testing.assert_array_equal(got[name], two_levels()[i], err_msg=f"rank {r} {name}")


def two_levels():
    """2 ranks x 2 devices: replica d of rank r takes shard 2r + d of 4; each rank's two rounded
    gradients are added in float32 and rounded, then the ranks' sums likewise in rank order."""
    X, y = dyadic_problem()
    parts = [exact_grads(X[a:b], y[a:b]) for a, b in ranges(len(y), 4)]
    out = []
    for i in range(2):
        local = [bf16(bf16(parts[2 * r][i]) + bf16(parts[2 * r + 1][i])) for r in range(2)]
        out.append(bf16(local[0] + local[1]))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not mgpu.build_info()["cuda_emulation"],
                    reason="runs one emulated GPU per rank (the emulated build)")
@needs_mpi
@pytest.mark.parametrize("transport", ["nccl", "host"])
def test_one_gpu_per_rank_reduces_in_bf16(transport, tmp_path):
    """The NCCL transport across processes (the emulator's ncclBfloat16: rank order, rounded
    once; real NCCL's two-rank sum is one addition, the same bits) and MGPU_DIST_GPU=host's
    staging through the CPU's ordered all-reduce."""
    run_worker(tmp_path, "gpu", MGPU_EMULATED_GPUS="1", MGPU_DIST_GPU=transport)
    want, exact = reference(2)
    for r in range(2):
        got = np.load(tmp_path / f"gpu.rank{r}.npz")
        for i, name in enumerate(("w", "b")):
            np.testing.assert_array_equal(got[f"bf16_{name}"], want[i], err_msg=f"rank {r}")
            np.testing.assert_array_equal(got[f"f32_{name}"], exact[i], err_msg=f"rank {r}")
        assert not np.array_equal(got["bf16_w"], got["f32_w"])
        assert got["bf16_bytes"] * 2 == got["f32_bytes"] == 4 * (want[0].size + want[1].size)
