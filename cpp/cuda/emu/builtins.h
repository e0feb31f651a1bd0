// cpp/cuda/emu/builtins.h -- the CUDA keywords, the vector types and the built-in variables
// (threadIdx, blockIdx, blockDim, gridDim, warpSize) as the emulator defines them for g++.
#pragma once

// ---- Keywords ----------------------------------------------------------------------------------
// (No __noinline__: libstdc++ spells its own attribute that way, so the macro would break it.)
// __shared__ storage is static thread_local: one copy per OS thread, so all fibers of the block
// running on that thread share it, and blocks running at the same time on other threads (another
// emulated device's worker) do not. Like real shared memory it is not initialised per block.
#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
#define __CUDA_ARCH_EMULATED__ 800

// ---- Vector types and built-in variables --------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// Set by the scheduler before it switches to a fiber; meaningless on the host side.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;
