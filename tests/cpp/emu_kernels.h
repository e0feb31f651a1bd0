// tests/cpp/emu_kernels.h -- the launchers of tests/cpp/emu_kernels.cu, the CUDA kernels the
// emulator's tests (emu_test_cuda_emulation.cpp, emu_test_strict.cpp) run against plain loops.
#pragma once

#include "cuda/runtime.cuh"
#include "emu_test_util.h"

namespace mgpu_test {
void matmul(const float* a, const float* b, float* c, int m, int n, int k, cudaStream_t stream);
void block_sums(const float* x, float* partial, int n, bool with_barrier, cudaStream_t stream);
void warp_reduce(const int* x, int n, int* block_total, unsigned* ballot, int* scan, int threads,
                 cudaStream_t stream);
void histogram(const int* values, int n, unsigned* bins, int num_bins, float* sum, int* max_value,
               cudaStream_t stream);
void saxpy(int n, float a, const float* x, float* y, int blocks, int threads, cudaStream_t stream);
void copy_span(const float* x, float* y, int n, cudaStream_t stream);
void scale_if(int n, const ScaleIf& f, cudaStream_t stream);
void reverse_chunks(const float* in, float* out, int n, int threads, cudaStream_t stream);
void divergent_barrier(float* out, cudaStream_t stream);
void barrier_shuffle_deadlock(float* out, cudaStream_t stream);
void gather(const float* x, const int* index, float* out, int n, int m, cudaStream_t stream);
void block_turns(int* turns, int* counter, int blocks, cudaStream_t stream);
}  // namespace mgpu_test
