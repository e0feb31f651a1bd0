// cpp/cuda/emu/cuda_emulation.h -- what CUDA sources see when g++ compiles them with
// MGPU_CUDA_EMULATION: CUDA's keywords, built-ins, device functions and runtime slice, run on the
// CPU, each CUDA thread of a block a fiber. Test builds only; include it through cuda/runtime.cuh.
#pragma once

#if defined(__CUDACC__)
#error "cuda_emulation.h is for host compilers; nvcc uses <cuda_runtime.h> (see cuda/runtime.cuh)"
#endif

#include "cuda/emu/builtins.h"
#include "cuda/emu/device_functions.h"
#include "cuda/emu/launch.h"
#include "cuda/emu/runtime_api.h"

// Semantics worth knowing (details in fibers.cpp, launch.cpp, runtime_api.cpp):
// - Streams run their work synchronously, in the calling thread, when it is issued; events,
//   waits and synchronisation are therefore trivially ordered. A stream that is capturing records
//   instead, and cudaGraphLaunch replays the recording.
// - Device memory is host memory. Every cudaMalloc'ed range remembers its device, so copies with
//   a wrong kind or size, and kernels handed another device's (or pageable host) pointers, fail.
// - A kernel's failure (an exception, a failed assert, a barrier reached by only some threads, a
//   deadlock) fails its launch: cudaGetLastError() and the device's next synchronisation return
//   the error, and mgpu::emu::last_error_detail() says what happened, where.
// - Between barrier phases the fibers of a block run in a seeded pseudo-random order
//   (MGPU_EMU_SEED, default 1; 0 keeps ascending thread order), so a missing __syncthreads shows.
// Not emulated: __device__ / __constant__ variables (one host copy for all devices; no
// cudaMemcpyToSymbol), dynamic parallelism, cooperative groups, textures, __activemask, capture
// across streams (event fork/join), and blocks running concurrently (a block that spins waiting
// for another block fails as a livelock).
