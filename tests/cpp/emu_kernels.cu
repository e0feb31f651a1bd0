// tests/cpp/emu_kernels.cu -- kernels in real CUDA syntax that prove the CUDA emulator: tiled
// matmul, block and warp reductions, an atomic histogram, a grid-stride kernel, dynamic shared
// memory, and kernels that misuse barriers on purpose. Compiled by nvcc (the compile check) and by
// g++ with -DMGPU_CUDA_EMULATION. Each launcher only launches: tests read cudaGetLastError().
#include <cassert>  // before cuda/runtime.cuh, whose emulated assert() fails the launch instead
#include <climits>
#include <cstdint>

#include "cuda/runtime.cuh"
#include "cuda/bf16.cuh"
#include "emu_test_util.h"

namespace mgpu_test {

// ---- C (m x n) = A (m x k) B (k x n), row-major, 16 x 16 shared-memory tiles --------------------
constexpr int kTile = 16;

__global__ void matmul_tiled(const float* __restrict__ a, const float* __restrict__ b,
                             float* __restrict__ c, int m, int n, int k) {
  __shared__ float a_tile[kTile][kTile];
  __shared__ float b_tile[kTile][kTile];
  const int row = blockIdx.y * kTile + threadIdx.y;
  const int col = blockIdx.x * kTile + threadIdx.x;
  float acc = 0.0f;
  for (int t = 0; t < (k + kTile - 1) / kTile; ++t) {
    const int a_col = t * kTile + threadIdx.x;
    const int b_row = t * kTile + threadIdx.y;
    a_tile[threadIdx.y][threadIdx.x] = row < m && a_col < k ? a[row * k + a_col] : 0.0f;
    b_tile[threadIdx.y][threadIdx.x] = b_row < k && col < n ? b[b_row * n + col] : 0.0f;
    __syncthreads();  // the tiles are complete
    for (int i = 0; i < kTile; ++i) acc += a_tile[threadIdx.y][i] * b_tile[i][threadIdx.x];
    __syncthreads();  // everyone is done with the tiles before they are overwritten
  }
  if (row < m && col < n) c[row * n + col] = acc;
}

void matmul(const float* a, const float* b, float* c, int m, int n, int k, cudaStream_t stream) {
  const dim3 grid((n + kTile - 1) / kTile, (m + kTile - 1) / kTile);
  MGPU_LAUNCH(matmul_tiled, grid, dim3(kTile, kTile), 0, stream)(a, b, c, m, n, k);
}

// ---- partial[b] = sum of block b's slice of x: a shared-memory tree, blockDim.x = 256 -----------
// kSync = false drops the barrier inside the tree: the test-only broken variant.
constexpr int kSumThreads = 256;

template <bool kSync>
__global__ void block_sum(const float* __restrict__ x, float* __restrict__ partial, int n) {
  __shared__ float s[kSumThreads];
  const int tid = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + tid;
  s[tid] = i < n ? x[i] : 0.0f;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (tid < stride) s[tid] += s[tid + stride];
    if (kSync) __syncthreads();
  }
  if (tid == 0) partial[blockIdx.x] = s[0];
}

void block_sums(const float* x, float* partial, int n, bool with_barrier, cudaStream_t stream) {
  const int blocks = (n + kSumThreads - 1) / kSumThreads;
  if (with_barrier) {
    MGPU_LAUNCH(block_sum<true>, blocks, kSumThreads, 0, stream)(x, partial, n);
  } else {
    MGPU_LAUNCH(block_sum<false>, blocks, kSumThreads, 0, stream)(x, partial, n);
  }
}

// ---- Warp collectives: per-block sums by shuffles, ballots, and an inclusive warp scan
// ----------- block_total[b]: sum of block b's slice; ballot[b * warps + w]: lanes of warp w with x
// > 0; scan[i]: inclusive prefix sum of x within i's warp. blockDim.x is a multiple of 32.
__global__ void warp_collectives(const int* __restrict__ x, int n, int* __restrict__ block_total,
                                 unsigned* __restrict__ ballot, int* __restrict__ scan) {
  __shared__ int warp_totals[32];
  const unsigned full = 0xffffffffu;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int warps = blockDim.x / warpSize;
  const int v = i < n ? x[i] : 0;

  int butterfly = v;  // every lane ends with the warp's sum
  for (int offset = 16; offset > 0; offset >>= 1)
    butterfly += __shfl_xor_sync(full, butterfly, offset);
  int tree = v;  // lane 0 ends with the warp's sum
  for (int offset = 16; offset > 0; offset >>= 1) tree += __shfl_down_sync(full, tree, offset);
  tree = __shfl_sync(full, tree, 0);
  int prefix = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(full, prefix, offset);
    if (lane >= offset) prefix += up;
  }
  if (i < n) scan[i] = prefix;
  const unsigned positive = __ballot_sync(full, v > 0);
  const bool agree = __all_sync(full, butterfly == tree) && !__any_sync(full, butterfly != tree);
  if (lane == 0) {
    warp_totals[warp] = agree ? tree : INT_MIN;
    ballot[blockIdx.x * warps + warp] = positive;
  }
  __syncthreads();
  if (warp == 0) {
    int total = lane < warps ? warp_totals[lane] : 0;
    for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_down_sync(full, total, offset);
    if (lane == 0) block_total[blockIdx.x] = total;
  }
}

void warp_reduce(const int* x, int n, int* block_total, unsigned* ballot, int* scan, int threads,
                 cudaStream_t stream) {
  const int blocks = (n + threads - 1) / threads;
  MGPU_LAUNCH(warp_collectives, blocks, threads, 0, stream)(x, n, block_total, ballot, scan);
}

// ---- Histogram of values in [0, bins) with per-block shared counts; also a float sum and max
// -----
constexpr int kMaxBins = 64;

__global__ void histogram_kernel(const int* __restrict__ values, int n, unsigned* __restrict__ bins,
                                 int num_bins, float* __restrict__ sum,
                                 int* __restrict__ max_value) {
  __shared__ unsigned local[kMaxBins];
  for (int b = threadIdx.x; b < num_bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
    atomicAdd(&local[values[i]], 1u);
    atomicAdd(sum, static_cast<float>(values[i]));
    atomicMax(max_value, values[i]);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < num_bins; b += blockDim.x) atomicAdd(&bins[b], local[b]);
}

void histogram(const int* values, int n, unsigned* bins, int num_bins, float* sum, int* max_value,
               cudaStream_t stream) {
  MGPU_LAUNCH(histogram_kernel, 4, 128, 0, stream)(values, n, bins, num_bins, sum, max_value);
}

// ---- y = a x + y over a grid smaller than n: the grid-stride loop -------------------------------
__global__ void saxpy_kernel(int n, float a, const float* __restrict__ x, float* __restrict__ y) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;  // 64 bits: no overflow
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    y[i] = a * x[i] + y[i];
  }
}

void saxpy(int n, float a, const float* x, float* y, int blocks, int threads, cudaStream_t stream) {
  MGPU_LAUNCH(saxpy_kernel, blocks, threads, 0, stream)(n, a, x, y);
}

// ---- bfloat16 round trips: bits[i] = bf16(x[i]) (nearest even), back[i] = float(bits[i]); pairs
// [i] = (x[2i], x[2i+1]) as one __nv_bfloat162, widened back to both floats ------------------------
__global__ void bf16_kernel(const float* __restrict__ x, unsigned short* __restrict__ bits,
                            float* __restrict__ back, float* __restrict__ pairs, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
  bits[i] = __bfloat16_as_ushort(h);
  back[i] = __bfloat162float(h);
  if (i % 2 == 0 && i + 1 < n) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(x[i], x[i + 1]);
    pairs[i] = __low2float(p);
    pairs[i + 1] = __high2float(p);
  }
}

void bf16_round_trip(const float* x, unsigned short* bits, float* back, float* pairs, int n,
                     cudaStream_t stream) {
  MGPU_LAUNCH(bf16_kernel, (n + 127) / 128, 128, 0, stream)(x, bits, back, pairs, n);
}

// ---- y = x through a struct argument (a functor holding its arrays, as mgpu's op kernels) ------
struct CopySpan {
  const float* x;
  float* y;
  int n;
};
__global__ void copy_span_kernel(CopySpan s) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < s.n) s.y[i] = s.x[i];
}

void copy_span(const float* x, float* y, int n, cudaStream_t stream) {
  MGPU_LAUNCH(copy_span_kernel, (n + 63) / 64, 64, 0, stream)(CopySpan{x, y, n});
}

// ---- y = s * x (or x) through a struct argument with padding -----------------------------------
__global__ void scale_if_kernel(int n, ScaleIf f) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) f.y[i] = f.scale ? f.s * f.x[i] : f.x[i];
}

void scale_if(int n, const ScaleIf& f, cudaStream_t stream) {
  MGPU_LAUNCH(scale_if_kernel, (n + 63) / 64, 64, 0, stream)(n, f);
}

// ---- out = in with every blockDim.x-long chunk reversed, through dynamic shared memory ----------
__global__ void reverse_chunks_kernel(const float* __restrict__ in, float* __restrict__ out,
                                      int n) {
  MGPU_DYNAMIC_SHARED(float, chunk);
  const int base = blockIdx.x * blockDim.x;
  const int len = min(static_cast<int>(blockDim.x), n - base);
  if (static_cast<int>(threadIdx.x) < len) chunk[threadIdx.x] = in[base + threadIdx.x];
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < len) out[base + threadIdx.x] = chunk[len - 1 - threadIdx.x];
}

void reverse_chunks(const float* in, float* out, int n, int threads, cudaStream_t stream) {
  const int blocks = (n + threads - 1) / threads;
  MGPU_LAUNCH(reverse_chunks_kernel, blocks, threads, threads * sizeof(float), stream)(in, out, n);
}

// ---- Misuse, on purpose ------------------------------------------------------------------------
// A barrier in a divergent branch: half the block never reaches it (a hang on a GPU).
__global__ void divergent_barrier_kernel(float* out) {
  if (threadIdx.x < blockDim.x / 2) __syncthreads();
  out[threadIdx.x] = 1.0f;
}
// Lane 0 waits at the block barrier for lanes that wait at a shuffle for lane 0: a true deadlock.
__global__ void barrier_shuffle_deadlock_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x == 0) {
    __syncthreads();
  } else {
    v = __shfl_sync(0xffffffffu, v, 0);
  }
  out[threadIdx.x] = v;
}
// A device-side assert on an out-of-range index.
__global__ void gather_kernel(const float* __restrict__ x, const int* __restrict__ index,
                              float* __restrict__ out, int n, int m) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m) return;
  assert(index[i] >= 0 && index[i] < n);
  out[i] = x[index[i]];
}

void divergent_barrier(float* out, cudaStream_t stream) {
  MGPU_LAUNCH(divergent_barrier_kernel, 1, 64, 0, stream)(out);
}
void barrier_shuffle_deadlock(float* out, cudaStream_t stream) {
  MGPU_LAUNCH(barrier_shuffle_deadlock_kernel, 1, 32, 0, stream)(out);
}
void gather(const float* x, const int* index, float* out, int n, int m, cudaStream_t stream) {
  MGPU_LAUNCH(gather_kernel, (m + 127) / 128, 128, 0, stream)(x, index, out, n, m);
}

// ---- The order in which a grid's blocks ran: block b's thread 0 takes the next turn -------------
__global__ void block_turns_kernel(int* turns, int* counter) {
  if (threadIdx.x == 0) turns[blockIdx.x] = atomicAdd(counter, 1);
}

void block_turns(int* turns, int* counter, int blocks, cudaStream_t stream) {
  MGPU_LAUNCH(block_turns_kernel, blocks, 32, 0, stream)(turns, counter);
}

}  // namespace mgpu_test
