"""nn.Dropout in the fused step under mpirun: 2 ranks x 1 device, deterministic, give bitwise
the parameters of one process on one device (every rank masks its rows as rows of the global
batch, and every rank draws the same step seeds from its identically seeded mgpu.random); the
bucketed step is within float tolerance of one process with 2 devices."""
import numpy as np

import dist_worker
import mgpu
from conftest import assert_close
from test_distributed import load, mpirun, needs_mpi


def saved(tmp_path, name, rank):
    npz = load(tmp_path, name, rank)
    return [npz[f"arr_{i}"] for i in range(len(npz.files))]


@needs_mpi
def test_dropout_under_mpirun(tmp_path):
    rc, out, err, _ = mpirun(2, "dropout", tmp_path, 1, 8, 1, timeout=120, limit=300)
    assert rc == 0, f"mpirun dropout failed:\n{out}\n{err}"
    rc, out, err, _ = mpirun(2, "dropout", tmp_path, 1, 0, 1, timeout=120, limit=300)
    assert rc == 0, f"mpirun dropout failed:\n{out}\n{err}"
    one = dist_worker.dropout_steps([mgpu.cpu(0)], 8)
    local = dist_worker.dropout_steps([mgpu.cpu(0), mgpu.cpu(1)], False)
    nparams = len(list(dist_worker.dropout_net().parameters()))
    for r in range(2):
        got = saved(tmp_path, "dropout_L1_8_1", r)
        for i in range(nparams):
            assert np.array_equal(got[i], one[i]), f"rank {r}: parameter {i} is not 1 device's"
        ranks = saved(tmp_path, "dropout_L1_0_1", r)
        for i, (g, e) in enumerate(zip(ranks[:nparams], local[:nparams])):
            assert_close(g, e, "sum", f"rank {r}: parameter {i} against 2 devices")
