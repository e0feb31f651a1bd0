// cpp/cuda/stream.h -- the CUDA stream type, declared exactly as the CUDA runtime and the emulator
// declare it, so host code (core/gpu.h, the ops' headers) names streams without the CUDA headers.
#pragma once

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
