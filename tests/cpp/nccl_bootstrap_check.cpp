// tests/cpp/nccl_bootstrap_check.cpp -- proves the NCCL-over-MPI bootstrap compiles and links
// (CI has no GPU, so ctest runs only `--version`). On a machine with GPUs,
// `mpirun -np 2 nccl_bootstrap_check` bootstraps NCCL over MPI and all-reduces rank + 1.
#include <cstdio>
#include <cstring>
#include <vector>

#include "comm/nccl_bootstrap.h"
#include "core/error.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--version") == 0) {
    int gpus = 0;
    cudaError_t e = cudaGetDeviceCount(&gpus);
    std::printf("NCCL %d linked; %d GPU(s) (%s)\n", mgpu::comm::nccl_version(),
                e == cudaSuccess ? gpus : 0, e == cudaSuccess ? "ok" : cudaGetErrorString(e));
    return mgpu::comm::nccl_version() > 0 ? 0 : 1;
  }
  MPI_Init(&argc, &argv);
  int status = 0;
  try {
    int local = 0;
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    mgpu::comm::NcclWorld world(MPI_COMM_WORLD, local, 60.0);
    const size_t n = 1 << 20;
    std::vector<float> host(n, static_cast<float>(world.rank() + 1));
    float* dev = nullptr;
    cudaMalloc(&dev, n * sizeof(float));
    cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    world.allreduce_sum(dev, n, nullptr);
    cudaMemcpy(host.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(dev);
    const float want = world.size() * (world.size() + 1) / 2.0f;
    status = host[0] == want && host[n - 1] == want ? 0 : 1;
    std::printf("rank %d: %g (want %g)\n", world.rank(), host[0], want);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    status = 1;
  }
  if (status) MPI_Abort(MPI_COMM_WORLD, status);
  MPI_Finalize();
  return status;
}
