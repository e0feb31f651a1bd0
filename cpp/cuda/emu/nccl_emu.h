// cpp/cuda/emu/nccl_emu.h -- the slice of nccl.h mgpu uses, on emulated GPUs (names, values and
// signatures as in NCCL 2.2x), implemented by nccl_emu.cpp. The emulated build includes it where
// a real build includes <nccl.h>, so the NCCL path of the all-reduce runs in tests.
//
// Semantics:
// - A collective is work enqueued on the given emulated stream, like a kernel. When the stream
//   runs it, it waits there for the same collective (the n-th of each rank of the communicator)
//   of every other rank; the last rank to arrive computes the result, summing in rank order
//   0..n-1, so the sums are deterministic and bitwise those of a sequential sum in that order.
//   On the strict emulator (streams run behind the host) the waiting never holds the stream:
//   the collective arrives, then blocks its stream (state.cpp, block_stream) while the thread
//   that ran it, holding no stream, runs the queued work of the ranks still missing; any thread
//   may run those, so no rank's wait can hold back another rank's collective. (A thread that
//   held its stream while it waited could hold, through the streams it ran meanwhile, the very
//   streams the missing ranks' collectives were queued on: the fused step deadlocked so.)
// - ncclGroupStart/End collect this thread's calls; ncclGroupEnd issues them, each on a thread of
//   its own, so one host thread can drive every rank of a communicator (as ncclCommInitAll users
//   do) although the emulator's lenient streams run work at once on the issuing thread.
// - ncclCommInitAll makes a clique of devices of this process. ncclCommInitRank joins the clique
//   named by the unique id: its ranks register in a shared-memory segment named by the id, and
//   once all have, the clique is in-process when they all run in this process (threads), or
//   spans processes of this machine, one rank per process (under mpirun: the id is broadcast
//   over MPI, as NCCL's is). A clique across processes exchanges data through that segment, as
//   NCCL's shared-memory transport does: each rank posts its part of a round (up to 1 MiB) in its
//   slot, every rank computes its result from all slots (sums in rank order 0..n-1, bitwise the
//   in-process sums), and a slot is rewritten only once every rank has read it. Its collectives
//   keep the stream semantics above; ncclCommAbort of one rank fails the others' waits too.
//   ncclCommInitRankConfig is ncclCommInitRank (blocking whatever the config says: it returns
//   once every rank has joined).
// - ncclCommAbort wakes every rank waiting in a collective of the communicator's clique: those
//   collectives fail (cudaErrorLaunchFailure on their stream) and the clique is unusable.
// - ncclCommAbort and ncclCommDestroy free the communicator, as NCCL does: any later call on the
//   handle, and a call another thread is still inside when it is freed, is a use after free. On
//   a GPU it reads freed memory; here the handle stays allocated but poisoned, the call returns
//   ncclInvalidUsage, and each such use is written to stderr and counted (nccl_freed_uses()). On
//   the strict emulator a collective call lasts 0.2 ms, so an abort from another thread (a
//   watchdog's) that races a launch lands inside it.
// - Strict emulator: a cycle of streams that wait for each other through collectives and events
//   (a rank's stream waits on an event recorded after another rank's part of the same collective,
//   say) is a deadlock, on a GPU a hang: the collective fails with a report naming the streams.
//
// Fault injection, read when a call is made:
//   MGPU_EMU_NCCL_FAIL=allreduce|broadcast|allgather|init (or NAME:RANK for one rank): the call
//     returns ncclUnhandledCudaError at once;
//   MGPU_EMU_NCCL_FAIL=async: collectives run but write nothing and leave ncclRemoteError as every
//     communicator's asynchronous error (a peer that died mid-collective);
//   MGPU_EMU_NCCL_STALL=RANK: that rank's collectives never arrive; its stream and every other
//     rank waiting for it hang until ncclCommAbort.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/emu/runtime_api.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 28
#define NCCL_PATCH 0
#define NCCL_VERSION_CODE 22800
#define NCCL_UNIQUE_ID_BYTES 128

typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

// The fields of NCCL's config that mgpu sets; the emulator reads none of them.
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION_CODE, 1}

const char* ncclGetErrorString(ncclResult_t result);
ncclResult_t ncclGetVersion(int* version);
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist);
// Nothing to flush: a collective is work on its stream, which mgpu has waited for by then.
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);

ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

// Only ncclSum of ncclFloat or ncclBfloat16 is emulated (what mgpu uses); other types or ops
// are ncclInvalidArgument. Broadcast and all-gather copy bytes, so they take any type.
// ncclBfloat16: each element is the sum of every rank's value widened to float32 (exact), added
// in float32 in rank order 0..n-1 and rounded to bfloat16 once, to nearest even (the emulated
// GPU's __float2bfloat16_rn, cuda/emu/bf16.h). Real NCCL rounds its partial sums to bfloat16 at
// every step of its ring or tree, in its own order: the same bits on two ranks (one addition),
// within one bfloat16 rounding per rank on more. Cliques across processes sum so too.
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);

namespace mgpu::emu {
// How many calls so far used a communicator after (or while) ncclCommAbort or ncclCommDestroy
// freed it; each is also written to stderr. Tests only.
uint64_t nccl_freed_uses();
}  // namespace mgpu::emu
