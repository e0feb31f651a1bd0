"""One rank of the advisor's MPI measurement: ``python -m mgpu.advisor --mpi-worker JOB_JSON``
(under mpirun, started by ``python -m mgpu advise --validate --ranks``)."""
import json
import sys

from .measure import mpi_worker

if __name__ == "__main__":
    # One rank of measure_mpi: python -m mgpu.advisor --mpi-worker JOB_JSON (under mpirun).
    if len(sys.argv) == 3 and sys.argv[1] == "--mpi-worker":
        mpi_worker(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: mpirun ... python -m mgpu.advisor --mpi-worker JOB_JSON "
                 "(what `python -m mgpu advise --validate --ranks` starts)")
