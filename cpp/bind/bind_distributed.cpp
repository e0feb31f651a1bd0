// cpp/bind/bind_distributed.cpp -- the multi-process world (mgpu.distributed): MPI init, rank,
// collectives across processes. Every call that may wait for other ranks releases the GIL.
#include "bind/bind.h"
#include "comm/allreduce_mpi.h"

namespace py = pybind11;

namespace mgpu::bind {

void bind_distributed(py::module_& m) {
  namespace dist = comm::dist;
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("dist_built", &dist::built, "True when this build has the MPI back end.");
  m.def("dist_gpu_transport", &dist::gpu_transport,
        "How GPU tensors cross processes: 'nccl' (a communicator over every rank) or 'host'.");
  m.def("dist_launched", &dist::launched, "True when started by mpirun (or another MPI launcher).");
  m.def("dist_nccl_world_built", &dist::nccl_world_built,
        "True when this build can carry GPU tensors across processes on NCCL.");
  m.def("dist_init", &dist::init, nogil(), py::arg("use_mpi"), py::arg("nccl") = false,
        "Initialises the world (over MPI when use_mpi; GPU tensors on NCCL when nccl), once.");
  m.def("dist_initialized", &dist::initialized, "True after dist_init.");
  m.def("dist_finalized", &dist::finalized, "True after dist_finalize.");
  m.def("dist_uses_mpi", &dist::uses_mpi, "True when the world runs over MPI.");
  m.def("dist_rank", &dist::rank, "This process's rank.");
  m.def("dist_world_size", &dist::world_size, "Number of processes.");
  m.def("dist_local_rank", &dist::local_rank, "Rank among the processes on this machine.");
  m.def("dist_local_size", &dist::local_size, "Processes on this machine.");
  m.def("dist_set_timeout", &dist::set_timeout, "Seconds a collective may wait for its peers.");
  m.def("dist_timeout", &dist::timeout, "Seconds a collective may wait for its peers.");
  m.def("dist_set_check", &dist::set_check, "Compare every collective's fingerprint across ranks.");
  m.def("dist_check", &dist::check, "Whether collectives are compared across ranks first.");
  m.def("dist_set_algorithm", &dist::set_algorithm, "All-reduce algorithm: 'ordered' or 'mpi'.");
  m.def("dist_algorithm", &dist::algorithm, "All-reduce algorithm: 'ordered' or 'mpi'.");
  m.def("dist_allreduce", [](const std::vector<Tensor>& tensors) { dist::allreduce(tensors); },
        nogil(), "In-place sum across ranks of tensors on one device (enqueued).");
  m.def("dist_broadcast", &dist::broadcast, nogil(), py::arg("tensors"), py::arg("root"),
        "Root's tensors copied into every rank's (enqueued).");
  m.def("dist_barrier", &dist::barrier, nogil(), py::arg("device"),
        "Waits for the device's work, then for every rank.");
  m.def("dist_finalize", &dist::finalize, nogil(), py::arg("abort"),
        "Ends the world: MPI_Finalize, or MPI_Abort after an uncaught error.");
}

}  // namespace mgpu::bind
