"""Gradient accumulation across processes: 2 ranks x 1 device take the fused step with
``accumulate=K``. Deterministic: bitwise the parameters of one process, one device, one batch
(K = 1); otherwise the step of one process with 2 devices and the same K, and the micro-batches
start no reduction across ranks (counted on every rank)."""
import numpy as np
import pytest

import dist_worker
import mgpu
from conftest import assert_close
from test_distributed import HAVE_MPI, load, mpirun

needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs mpirun and an mgpu built with MPI "
                               "(apt-get install openmpi-bin libopenmpi-dev, then reinstall)")
CPUS = [mgpu.cpu(0), mgpu.cpu(1)]


def arrays(npz):
    return [npz[f"arr_{i}"] for i in range(len(npz.files))]


@needs_mpi
def test_accumulation_under_mpirun(tmp_path):
    rc, out, err, _ = mpirun(2, "accumulated", tmp_path, 1, "8:2", "8:4", "0:1", "0:4",
                             timeout=120, limit=300)
    assert rc == 0, f"mpirun accumulated failed:\n{out}\n{err}"
    whole = dist_worker.accumulated_steps(CPUS[:1], 1, shards=8)
    nparams = len(list(dist_worker.bn_net().parameters()))
    for r in range(2):
        for k in (2, 4):
            got = arrays(load(tmp_path, f"acc_L1_8_{k}", r))
            for i in range(nparams):
                assert np.array_equal(got[i], whole[i]), \
                    f"rank {r}, accumulate={k}: parameter {i} is not the bits of one batch"
        ranks = arrays(load(tmp_path, "acc_L1_0_4", r))
        local = dist_worker.accumulated_steps(CPUS, 4)
        for i, (g, e) in enumerate(zip(ranks[:-2], local[:-2])):
            assert_close(g, e, "sum", f"rank {r}, accumulate=4: array {i} against 2 devices")
        one = arrays(load(tmp_path, "acc_L1_0_1", r))[-1]
        assert one[0] > 0
        assert np.array_equal(ranks[-1], one), \
            f"rank {r}: accumulate=4 started {ranks[-1]} reductions, one batch {one}"


@needs_mpi
def test_two_ranks_of_two_devices_accumulate_to_the_bits_of_one_device(tmp_path):
    """2 ranks x 2 devices, accumulate=4 over 8 shards (each micro-batch's 2 shards on 2 of the
    4 devices): parameters, running statistics and losses bitwise those of 1 device with the
    same accumulate; parameters those of one batch."""
    rc, out, err, _ = mpirun(2, "accumulated", tmp_path, 2, "8:4", timeout=120, limit=300)
    assert rc == 0, f"mpirun accumulated failed:\n{out}\n{err}"
    one = dist_worker.accumulated_steps(CPUS[:1], 4, shards=8)
    whole = dist_worker.accumulated_steps(CPUS[:1], 1, shards=8)
    nparams = len(list(dist_worker.bn_net().parameters()))
    got = arrays(load(tmp_path, "acc_L2_8_4", 0))
    for i, (g, e) in enumerate(zip(got[:-1], one[:-1])):
        assert np.array_equal(g, e), f"array {i} differs from 1 device with accumulate=4"
    for i in range(nparams):
        assert np.array_equal(got[i], whole[i]), f"parameter {i} differs from one batch"
