// cpp/comm/dist_info.cpp -- what mgpu.distributed's all-reduce of GPU tensors across processes
// runs on in this build (gpu_transport_info, for build_info() and `mgpu info`); the collectives
// are in allreduce_mpi.cpp.
#include <string>

#include "comm/allreduce_mpi.h"
#include "core/error.h"

#if MGPU_BUILT_MPI && MGPU_NCCL_WORLD
#include "comm/nccl_bootstrap.h"
#endif

namespace mgpu::comm::dist {

std::string gpu_transport_info() {
  if (!MGPU_BUILT_MPI) return "none: no MPI back end, one process only (see the MPI line)";
  const std::string staged = "GPU tensors are copied to cpu(0), summed over MPI and copied back";
#if MGPU_BUILT_MPI && MGPU_NCCL_WORLD
  std::string transport;
  try {
    transport = gpu_transport();
  } catch (const ValueError& e) {
    return std::string("unknown: ") + e.what();
  }
  if (transport == "host")
    return "host (MGPU_DIST_GPU=host): " + staged + "; without it, an NCCL communicator over "
           "every rank carries them";
  const std::string nccl = "nccl: an NCCL communicator over every rank (one GPU each), its unique "
                           "id broadcast over MPI, ";
  const std::string host = "; MGPU_DIST_GPU=host stages them through host memory instead";
  if (MGPU_CUDA_EMULATION_BUILD)
    return nccl + "on the emulator's NCCL (ranks in several processes meet in shared memory)" +
           host;
  const int v = nccl_version();
  return nccl + "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " (compiled and linked; mgpu's tests run this path on the "
         "emulator only, never on a real GPU)" + host;
#else
  const char* why = !MGPU_GPU_BUILD ? "no GPU backend in this build"
                    : MGPU_BUILT_CUDA ? "this CUDA build has no NCCL (see the NCCL line)"
                                      : "no NCCL in this build";
  return "host: " + staged + " (no NCCL across processes: " + why + ")";
#endif
}

}  // namespace mgpu::comm::dist
