// cpp/comm/allreduce_mpi.h -- the multi-process world: one process per device, launched by
// `mpirun`, on one machine or several (sec. 12.5 beyond one process). Rank r of W processes sums
// tensors with every other rank over MPI; outside `mpirun` the world is one process and every
// collective is a no-op after its checks. Collectives run on the tensors' device queue, in order
// with the compute around them, so the host never waits for the network unless it asks to.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mgpu::comm::dist {

// What a collective is, for the fingerprint that ranks compare (see check()).
enum class Op : int64_t { Allreduce = 1, Broadcast = 2, Barrier = 3, TrainStep = 4 };

// True when this build has the MPI back end (MGPU_BUILT_MPI).
bool built();
// True when this build can carry GPU tensors across processes on NCCL (MGPU_NCCL_WORLD: MPI plus
// the emulator's NCCL, or plus real CUDA with NCCL).
bool nccl_world_built();
// How allreduce() moves GPU tensors across processes: "nccl" (an NCCL communicator over every
// rank, one GPU each: where nccl_world_built(), unless MGPU_DIST_GPU=host and init was not asked
// for NCCL) or "host" (copied to cpu(0), reduced over MPI, copied back).
std::string gpu_transport();
// gpu_transport() and what it means in this build, for build_info() and `mgpu info`.
std::string gpu_transport_info();
// True when this process was started by an MPI launcher (mpirun / mpiexec / srun with PMI).
bool launched();
// Initialises the world once: over MPI when use_mpi (needs built(); singleton MPI outside
// mpirun), else the one-process world; `nccl` (needs use_mpi and nccl_world_built(), else
// DeviceError) makes GPU tensors cross processes on NCCL whatever MGPU_DIST_GPU says. Later calls
// must agree on use_mpi and nccl (ValueError if not).
// With MPI, the default CPU thread count becomes this process's share of the machine
// (cores / processes on this node) unless MGPU_NUM_THREADS is set.
void init(bool use_mpi, bool nccl = false);
bool initialized();
bool uses_mpi();
int rank();
int world_size();
int local_rank();  // rank among the processes on this machine (chooses the GPU)
int local_size();

// Seconds a collective may wait for its peers before it fails (env MGPU_DIST_TIMEOUT, 60).
void set_timeout(double seconds);
double timeout();
// When on, every collective first compares (op, size, dtype, root, sequence number, tag) across
// ranks and fails on all of them at once, naming each rank's call, when they disagree (env
// MGPU_DIST_CHECK=1). Off, a mismatch is found by the timeout (or a size check) instead.
void set_check(bool on);
bool check();
// "ordered" (default): reduce-scatter + all-gather over point-to-point messages, each element
// summed in rank order 0, 1, ..., W-1 -- exactly the order of the in-process all-reduce, so W
// processes x 1 device give bitwise the parameters of 1 process x W devices. "mpi": the MPI
// library's own MPI_Iallreduce (its algorithm, its summation order).
void set_algorithm(const std::string& name);
std::string algorithm();

// In-place sum across ranks of `tensors` (float32, all on one CPU device; reduced as one flat
// buffer). Enqueued on that device's queue; returns at once. `op` and `tag` only label the call
// in the fingerprint and in errors (train_batch passes TrainStep and its batch geometry).
// wire BF16 (a step's comm_dtype) sends half the bytes, bfloat16 bits as MPI_UINT16_T: each rank
// rounds its own values to bfloat16 (dtype.h's rounding) before they leave; "ordered" adds them,
// widened, in float32 in rank order and rounds each sum to bfloat16 once (the all-gather carries
// it), "mpi" runs MPI_Iallreduce with a user-defined sum that rounds every partial sum (the
// library's order); the tensors end with the sum widened to float32. GPU tensors: staged through
// host memory so, or on the NCCL transport rounded on the GPU and summed as ncclBfloat16 (NCCL's
// order, each partial sum rounded; the emulator: rank order, rounded once). The fingerprint
// carries wire.
void allreduce(const std::vector<Tensor>& tensors, Op op = Op::Allreduce, int64_t tag = 0,
               DType wire = DType::F32);
// Every rank's `tensors` become root's (any dtype, same shapes on every rank). Enqueued.
void broadcast(const std::vector<Tensor>& tensors, int root);
// Blocks the host until every rank has reached its barrier (after this rank's queued work on
// `device`), raising any error of that queue.
void barrier(Device device);
// Waits for queued work, checks that all ranks arrive (within the timeout), then MPI_Finalize.
// abort=true (after an uncaught error) calls MPI_Abort instead, so the launcher ends every rank
// now rather than letting peers wait for this one. If the world is broken (a collective timed
// out), MPI_Finalize is skipped: it could hang, and exiting without it makes mpirun end the job.
void finalize(bool abort);
bool finalized();

}  // namespace mgpu::comm::dist
