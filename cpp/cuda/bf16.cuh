// cpp/cuda/bf16.cuh -- CUDA's bfloat16 types and conversions (__nv_bfloat16, __nv_bfloat162,
// __float2bfloat16_rn, __bfloat162float, ...): <cuda_bf16.h> under nvcc, the emulator's slice of
// it (cuda/emu/bf16.h, the same numbers) with MGPU_CUDA_EMULATION. Include after cuda/runtime.cuh.
#pragma once

#if defined(MGPU_CUDA_EMULATION)
#include "cuda/emu/bf16.h"
#else
#include <cuda_bf16.h>
#endif
