// cpp/ops/conv2d_cpu.cpp -- conv2d forward and backward on the CPU (LeNet's and ResNet's
// convolutions). x (N, C, H, W), w (K, C, R, S) seen as a (K, C*R*S) matrix, b (K), y and dy
// (N, K, P, Q). Four ways:
// - few taps (C*R*S <= 16, stride 1, no padding, Q >= 16: LeNet's conv1): direct loops over the
//   taps, sixteen output columns at a time (im2col and a packed sgemm would cost more than the
//   arithmetic);
// - other convolutions with stride 1 and no padding (LeNet's conv2): blocks of 16 images side by
//   side in vector lanes, multiplied out by register-tiled FMA kernels (no im2col, no packing);
// - the rest (padding, strides): a block of B images is unfolded (im2col) into col (C*R*S,
//   B*P*Q), so y = w * col, dw = dy * col^T and dcol = w^T * dy are sgemm calls and
//   dx = col2im(dcol);
// - 3x3 stride-1 convolutions (ResNet's): Winograd F(4x4, 3x3) (winograd.cpp).
// The first three are "direct". MGPU_CONV_ALGO (conv2d.h) forces one; auto (the default) takes
// Winograd for the 3x3 stride-1 shapes where it pays and the direct rule elsewhere, by the shape
// alone, so every thread count, process and run computes the same bits; tune measures instead
// (run_chosen).
// conv2d_relu_pool_* (LeNet's conv + relu + avg-pool blocks) share the block loops and apply
// the shape's rule (no Winograd).
// The algorithms live in cpp/ops/conv2d_cpu/ (im2col.cpp, direct.cpp, lanes.cpp, relu_pool.cpp,
// winograd.cpp; lanes_bf16.cpp for the lane path in precision bf16); this file picks one and runs
// the block loops around it.
#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "ops/bf16_round.h"
#include "ops/conv2d.h"
#include "ops/conv2d_cpu/conv2d_cpu.h"
#include "ops/conv2d_relu_pool.h"
#include "ops/cpu_isa.h"
#include "ops/gemm.h"

namespace mgpu::ops::cpu::MGPU_CPU_ISA {

namespace conv {
namespace {

// Sum of x[0, n) in a fixed order: 16 running lanes (lane j takes every 16th element from j),
// then a fixed pairwise tree. Vectorizes without reassociating, so it is the same on any ISA.
float sum_lanes(const float* __restrict x, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  }
  for (int j = 0; i + j < n; ++j) acc[j] += x[i + j];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

// The direct paths' rounded copies of x under round_bf16 (below).
thread_local std::vector<float> tl_rounded;

// dst[0, n) = src[0, n) rounded to bfloat16 (ops/bf16_round.h); returns dst.
const float* rounded_copy(const float* src, int64_t n, float* dst) {
  std::copy(src, src + n, dst);
  bf16::round_in_place(dst, n);
  return dst;
}

// Images per block on the im2col path's backward: kBlock, doubled (up to 64) until a block's
// product is kMinBlockColumns = 512 columns wide (B*P*Q). Backward sums one (K, C*R*S) dw slot
// per block, so small images (ResNet-18's 7x7 layers: 16 output pixels, 128 columns at 8 images)
// paid one slot addition per 128 columns; at 512 the 256->512 3x3 stride-2 layer's backward ran
// ~10% faster (AMD EPYC Zen 4, 2 threads, batch 128, CPU time under load), other layers the
// same. Forward has no slots and keeps kBlock (its 1x1 7x7 layer ran ~15% slower in blocks of
// 32). A function of the shape alone, so every thread count adds the same slots in the same
// order.
constexpr int64_t kMinBlockColumns = 512;
int64_t gemm_block(const Conv2dShape& s) {
  int64_t b = kBlock;
  while (b * s.P() * s.Q() < kMinBlockColumns && b < 64) b *= 2;
  return b;
}

// The forward product, block by block: unfolds each block of B images, multiplies, and hands
// the block's (K, B*P*Q) product (image-major columns, ld = B*P*Q) to emit(out, ld, n0, B), which
// runs on the worker that computed it while the product is still in its cache.
// only_im2col skips the direct and lane paths (MGPU_CONV_ALGO=im2col). round_bf16 rounds x to
// bfloat16 (ops/bf16_round.h) in the block's own copy of it (col, the lanes, or one image): the
// bits of the pass on a rounded copy of x, without that copy, except on the lane path, which
// then runs the bfloat16 pair products (lanes_bf16.cpp; hardware_dot: vdpbf16ps).
template <class Emit>
void forward_blocks(const Conv2dShape& s, const float* x, const float* w, const Emit& emit,
                    bool only_im2col = false, bool round_bf16 = false,
                    bool hardware_dot = false) {
  const int64_t PQ = s.P() * s.Q(), CRS = s.C * s.R * s.S, CHW = s.C * s.H * s.W;
  if (!only_im2col && use_direct(s)) {  // one image at a time: the product is (K, P*Q), ld = P*Q
    const auto direct = direct_forward_kernel(CRS);
    parallel_for((s.N + kBlock - 1) / kBlock, [&](int64_t blk) {
      float* out = scratch(tl_mat, s.K * PQ);
      float* xr = round_bf16 ? scratch(tl_rounded, CHW) : nullptr;
      for (int64_t n = blk * kBlock; n < std::min(s.N, (blk + 1) * kBlock); ++n) {
        direct(s, round_bf16 ? rounded_copy(x + n * CHW, CHW, xr) : x + n * CHW, w, out);
        emit(out, PQ, n, 1);
      }
    });
    return;
  }
  if (!only_im2col && use_lanes(s)) {  // blocks of 16 images in lanes; the product goes back to (K, B*P*Q)
    float* wP = round_bf16 ? nullptr : scratch(tl_weights, s.K * CRS);
    const LanesBf16Weights wq = round_bf16 ? lanes_bf16_forward_weights(s, w, hardware_dot)
                                           : LanesBf16Weights{nullptr, nullptr};
    if (wP) pack_forward_weights(s, w, wP);
    parallel_for((s.N + kLaneBlock - 1) / kLaneBlock, [&](int64_t blk) {
      const int64_t n0 = blk * kLaneBlock, B = std::min(s.N - n0, kLaneBlock), ld = B * PQ;
      float* xT = scratch(tl_lanes, kLaneBlock * (CHW + s.K * PQ));
      float* outT = xT + kLaneBlock * CHW;
      float* out = scratch(tl_mat, s.K * ld);
      to_lanes(x + n0 * CHW, CHW, B, CHW, xT);
      if (round_bf16) {
        bf16::round_in_place(xT, kLaneBlock * CHW);
        lanes_bf16_forward(s, xT, wq, outT, hardware_dot);
      } else {
        lanes_forward(s, xT, wP, outT);
      }
      for (int64_t k = 0; k < s.K; ++k) {
        from_lanes(outT + k * PQ * kLaneBlock, PQ, B, out + k * ld, PQ);
      }
      emit(out, ld, n0, B);
    });
    return;
  }
  const Unfold u(s);
  parallel_for((s.N + kBlock - 1) / kBlock, [&](int64_t blk) {
    const int64_t n0 = blk * kBlock, B = std::min(s.N - n0, kBlock), ld = B * PQ;
    float* col = scratch(tl_col, CRS * ld);
    float* out = scratch(tl_mat, s.K * ld);
    im2col(u, x + n0 * CHW, B, col, ld);
    if (round_bf16) bf16::round_in_place(col, CRS * ld);
    sgemm(false, false, s.K, ld, CRS, 1.0f, w, CRS, col, ld, 0.0f, out, ld);
    emit(out, ld, n0, B);
  });
}

// The backward products, block by block: load(dyb, ld, n0, B) writes the block's dy as (K, B*P*Q)
// (image-major columns, ld = B*P*Q); then dw and db of the block go to their slot and dx is
// scattered back from dcol. The slots are added in block order at the end (see kBlock).
// direct_dw, when given, computes a block's dw and db on the direct path without dx instead of
// load and direct_backward_block: direct_dw(n0, B, dw, db).
using DirectDw = std::function<void(int64_t, int64_t, float*, float*)>;
// Rows of dcol per product of dx (see backward_blocks): whole input channels, at least this many
// rows. OpenBLAS packs dy, the (K, B*P*Q) operand, once per product, so one channel (9 rows of a
// 3x3 kernel, 1 of a 1x1) per product repacked it C times; from 144 rows up (16 channels of a
// 3x3 kernel) the packing is amortized, and a 144-row product of ResNet-18's widest stride-2
// block (1568 columns) still fits L2 for the scatter. Measured (CPU time, 1 thread, batch 32,
// AMD EPYC Zen 4 under load): 64->128 3x3 stride 2 backward 34 -> 27 ms, 1x1 5.1 -> 3.5 ms.
constexpr int64_t kDxRowsMin = 144;

// round_bf16 rounds x and the loaded dy to bfloat16 in the blocks' copies of them, as
// forward_blocks does, the lane path then running the pair products (direct_fused, which reads
// x and dy itself, must be given them rounded).
template <class Load>
void backward_blocks(const Conv2dShape& s, const float* x, const float* w, const Load& load,
                     float* dx, float* dw, float* db, const DirectDw& direct_fused = nullptr,
                     bool only_im2col = false, bool round_bf16 = false,
                     bool hardware_dot = false) {
  const int64_t PQ = s.P() * s.Q(), CRS = s.C * s.R * s.S, CHW = s.C * s.H * s.W;
  const int64_t KCRS = s.K * CRS, RS = s.R * s.S;
  const Unfold u(s);
  if (s.N == 0) {
    std::fill(dw, dw + KCRS, 0.0f);
    if (db) std::fill(db, db + s.K, 0.0f);
    return;
  }
  // dw from patch rows (im2col_rows) where a patch is long enough to fill cache lines (conv2's
  // 500 floats); LeNet's conv1 (9-float patches) is faster from col with the transpose flag.
  // A function of the shape alone, so every thread count takes the same path.
  // A 1x1 kernel's patch is one float per channel, a gather across C planes, while im2col
  // copies whole strided rows: its dw is faster from col (~5% on ResNet-18's 1x1 stride-2 layers).
  // So is a strided convolution's: each patch is R pieces of S floats per channel, while im2col
  // gathers whole output rows with vector shuffles (ResNet-18's 3x3 stride-2 layers: dw 1.04x
  // to 1.30x faster, from 256 down to 64 input channels; AMD EPYC Zen 3, 2 threads, batch 64).
  const bool patch_rows = CRS >= kPatchRowsMin && RS > 1 && s.stride == 1;
  // Block 0 writes straight into dw and db; blocks 1.. into slots in this thread's scratch. The
  // blocks run in waves of `wave`, each wave's slots added into dw and db (in block order) before
  // the next wave reuses them: the scratch holds `wave` slots instead of one per block (31 x
  // 9.4 MB for a 512-channel 3x3 convolution at batch 256), and the sums are the same
  // dw_0 + dw_1 + ... in block order whatever the wave size, so it may follow the thread count.
  // A wave takes as many blocks as fit in kSlotBudget (at least max(4, 2 x threads)): small
  // layers (LeNet's) run in one wave, with no barrier between waves.
  const bool lanes = !only_im2col && use_lanes(s);
  const bool direct = !only_im2col && use_direct(s);
  const int64_t block = lanes ? kLaneBlock : direct ? kBlock : gemm_block(s);
  const int64_t blocks = (s.N + block - 1) / block;
  constexpr int64_t kSlotBudget = int64_t{16} << 20;  // bytes
  const int64_t fit = kSlotBudget / static_cast<int64_t>((KCRS + s.K) * sizeof(float));
  const int64_t wave = std::min<int64_t>(blocks, std::max<int64_t>({4, 2 * num_threads(), fit}));
  float* slots = scratch(tl_slots, wave * (KCRS + s.K));
  auto dw_slot = [&](int64_t blk) { return blk == 0 ? dw : slots + (blk % wave) * KCRS; };
  auto db_slot = [&](int64_t blk) {
    return blk == 0 ? db : slots + wave * KCRS + (blk % wave) * s.K;
  };

  const auto direct_dw = direct ? direct_backward_kernel(CRS) : nullptr;
  int64_t* xoff = nullptr;  // tap j = (c, r, t) of the lanes' dw: its offset in an image
  if (lanes) {
    if (static_cast<int64_t>(tl_offsets.size()) < CRS) tl_offsets.resize(static_cast<size_t>(CRS));
    xoff = tl_offsets.data();
    int64_t j = 0;
    for (int64_t c = 0; c < s.C; ++c) {
      for (int64_t r = 0; r < s.R; ++r) {
        for (int64_t t = 0; t < s.S; ++t) xoff[j++] = (c * s.H + r) * s.W + t;
      }
    }
  }
  const LanesBf16Weights wq = lanes && round_bf16 && dx
                                  ? lanes_bf16_dx_weights(s, w, hardware_dot)
                                  : LanesBf16Weights{nullptr, nullptr};

  auto run_block = [&](int64_t blk) {
    const int64_t n0 = blk * block, B = std::min(s.N - n0, block), ld = B * PQ;
    if (direct && direct_fused && !dx) {
      direct_fused(n0, B, dw_slot(blk), db ? db_slot(blk) : nullptr);
      return;
    }
    float* dyb = scratch(tl_mat, s.K * ld);  // dy of the block as (K, B*P*Q)
    load(dyb, ld, n0, B);
    if (round_bf16) bf16::round_in_place(dyb, s.K * ld);
    if (lanes) {
      float* xT = scratch(tl_lanes, kLaneBlock * (2 * CHW + s.K * PQ));
      float* dxT = xT + kLaneBlock * CHW;
      float* dyT = dxT + kLaneBlock * CHW;
      to_lanes(x + n0 * CHW, CHW, B, CHW, xT);
      if (round_bf16) bf16::round_in_place(xT, kLaneBlock * CHW);
      for (int64_t k = 0; k < s.K; ++k) {
        to_lanes(dyb + k * ld, PQ, B, PQ, dyT + k * PQ * kLaneBlock);
      }
      if (db) {
        float* dbs = db_slot(blk);
        for (int64_t k = 0; k < s.K; ++k) dbs[k] = sum_lanes(dyb + k * ld, ld);
      }
      if (round_bf16) {
        lanes_bf16_backward(s, xT, dyT, xoff, wq, dw_slot(blk), dx ? dxT : nullptr,
                            hardware_dot);
      } else {
        lanes_dw(s, xT, dyT, xoff, dw_slot(blk));
        if (dx) lanes_dx(s, w, dyT, dxT);
      }
      if (dx) from_lanes(dxT, CHW, B, dx + n0 * CHW, CHW);
      return;
    }
    if (direct) {
      const float* xb = x + n0 * CHW;
      if (round_bf16) xb = rounded_copy(xb, B * CHW, scratch(tl_rounded, B * CHW));
      direct_dw(s, xb, B, dyb, ld, dw_slot(blk), db ? db_slot(blk) : nullptr);
      if (dx) direct_backward_dx(s, w, B, dyb, ld, dx + n0 * CHW);
      return;
    }
    float* col = scratch(tl_col, CRS * ld);  // col (or its transpose), then reused for dcol
    if (patch_rows) {
      im2col_rows(u, x + n0 * CHW, B, col);
      if (round_bf16) bf16::round_in_place(col, CRS * ld);
      sgemm(false, false, s.K, CRS, ld, 1.0f, dyb, ld, col, CRS, 0.0f, dw_slot(blk), CRS);
    } else {
      im2col(u, x + n0 * CHW, B, col, ld);
      if (round_bf16) bf16::round_in_place(col, CRS * ld);
      sgemm(false, true, s.K, CRS, ld, 1.0f, dyb, ld, col, ld, 0.0f, dw_slot(blk), CRS);
    }
    if (db) {
      float* dbs = db_slot(blk);
      for (int64_t k = 0; k < s.K; ++k) dbs[k] = sum_lanes(dyb + k * ld, ld);
    }
    if (dx) {
      // dcol = w^T * dy a group of g input channels (g*R*S >= kDxRowsMin rows, or all C) at a
      // time, each group scattered into dx while it is in cache, so col2im does not read a whole
      // (C*R*S, B*P*Q) dcol back from memory; g whole channels so one channel's adds stay in one
      // col2im_channel call, in the same order as before.
      float* dxb = dx + n0 * CHW;
      std::fill(dxb, dxb + B * CHW, 0.0f);
      const int64_t g = std::max<int64_t>(1, kDxRowsMin / RS);
      for (int64_t c0 = 0; c0 < s.C; c0 += g) {
        const int64_t gc = std::min(g, s.C - c0);
        sgemm(true, false, gc * RS, ld, s.K, 1.0f, w + c0 * RS, CRS, dyb, ld, 0.0f, col, ld);
        for (int64_t c = c0; c < c0 + gc; ++c) {
          col2im_channel(u, col + (c - c0) * RS * ld, ld, B, c, dxb);
        }
      }
    }
  };

  for (int64_t first = 0; first < blocks; first += wave) {
    const int64_t end = std::min(blocks, first + wave), lo = std::max<int64_t>(first, 1);
    parallel_for(end - first, [&](int64_t j) { run_block(first + j); });
    if (end <= lo) continue;
    parallel_for((KCRS + kReduceChunk - 1) / kReduceChunk, [&](int64_t chunk) {
      const int64_t i0 = chunk * kReduceChunk, i1 = std::min(KCRS, i0 + kReduceChunk);
      float* __restrict dst = dw;
      for (int64_t blk = lo; blk < end; ++blk) {
        const float* __restrict src = dw_slot(blk);
        for (int64_t i = i0; i < i1; ++i) dst[i] += src[i];
      }
    });
    if (db) {
      for (int64_t blk = lo; blk < end; ++blk) {
        const float* src = db_slot(blk);
        for (int64_t k = 0; k < s.K; ++k) db[k] += src[k];
      }
    }
  }
}

}  // namespace
}  // namespace conv

using namespace conv;

namespace conv {
namespace {

// ---- The per-shape choice (MGPU_CONV_ALGO, see ConvAlgo in conv2d.h) ----
// Rule: today's rule by the shape (direct or lanes where they apply, else im2col); Im2col: im2col
// everywhere; Winograd: winograd.cpp, for the shapes it fits.
enum class Algo { Rule, Im2col, Winograd };
const char* algo_name(Algo a) {
  return a == Algo::Winograd ? "winograd" : a == Algo::Im2col ? "im2col" : "direct";
}

// Winograd is considered only where both input and output have this many channels: below it the
// transforms cost more than the products they save (LeNet, ResNet's 1-channel stem).
constexpr int64_t kWinogradMinChannels = 16;
// auto takes Winograd for outputs of at least this many pixels (6x6), and for smaller outputs
// cut into whole 4x4 tiles (no overhang) only with at least kWinogradWholeTileMinChannels input
// and output channels: there the products it saves outweigh the per-call weight transforms.
// Measured at ResNet-18's 512-channel 4x4 layer (bench conv, interleaved, AMD EPYC Zen 4, 2
// threads, load ~15): batch 256 forward 1020 vs direct 1316 ms, backward 1414 vs 2692 ms;
// batch 128 forward 576 vs 672 ms, backward 872 vs 1640 ms. Smaller 4x4 layers are unmeasured
// and stay direct.
constexpr int64_t kWinogradMinPixels = 36;
constexpr int64_t kWinogradWholeTileMinChannels = 512;
bool winograd_pays(const Conv2dShape& s) {
  const int64_t P = s.P(), Q = s.Q();
  return P * Q >= kWinogradMinPixels ||
         (P % 4 == 0 && Q % 4 == 0 && std::min(s.C, s.K) >= kWinogradWholeTileMinChannels);
}

// What tune measured, per shape without the batch size (shards of a batch and the last, short
// batch then run the same algorithm as the full batch) and direction.
struct Tuned {
  Algo pick;
  double seconds[2];  // Rule, Winograd: the best of two runs each
};
using TuneKey = std::array<int64_t, 9>;  // C, H, W, K, R, S, stride, pad, direction
std::mutex tune_mutex;
std::map<TuneKey, Tuned>& tune_cache() {
  static std::map<TuneKey, Tuned> cache;
  return cache;
}

// True where algorithm `want` leaves shape s to the shape's rule (no Winograd, no forced im2col).
bool rule_only(const Conv2dShape& s, ConvAlgo want) {
  if (want == ConvAlgo::Im2col) return false;
  const bool fits = winograd_fits(s);
  if (want == ConvAlgo::Winograd) return !fits;
  return want == ConvAlgo::Direct || !fits || s.C < kWinogradMinChannels ||
         s.K < kWinogradMinChannels || s.N == 0 ||
         (want == ConvAlgo::Auto && !winograd_pays(s));
}

// Runs algorithm `want` on a shape s it does not leave to the rule (rule_only(s, want) is false:
// im2col forced, or a Winograd-eligible shape): run(algo) must write the whole output. direction
// tells apart forward (0) and backward with (1) or without (2) dx. Under tune the first call for a
// shape times Rule and Winograd twice each, interleaved, keeps the faster (its output is the one
// left), and later calls look it up; the lock makes concurrent devices wait for the measurement
// instead of disturbing it.
template <class Run>
void run_chosen(const Conv2dShape& s, ConvAlgo want, int64_t direction, const Run& run) {
  if (want == ConvAlgo::Im2col) return run(Algo::Im2col);
  if (want != ConvAlgo::Tune) return run(Algo::Winograd);  // winograd, or auto on its shapes
  const TuneKey key{s.C, s.H, s.W, s.K, s.R, s.S, s.stride, s.pad, direction};
  std::unique_lock<std::mutex> lock(tune_mutex);
  auto it = tune_cache().find(key);
  if (it != tune_cache().end()) {
    const Algo pick = it->second.pick;
    lock.unlock();
    return run(pick);
  }
  Tuned t{Algo::Rule, {1e300, 1e300}};
  const Algo candidates[2] = {Algo::Rule, Algo::Winograd};
  for (int rep = 0; rep < 2; ++rep) {
    for (int i = 0; i < 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run(candidates[i]);
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      t.seconds[i] = std::min(t.seconds[i], dt.count());
    }
  }
  t.pick = t.seconds[1] < t.seconds[0] ? Algo::Winograd : Algo::Rule;
  tune_cache()[key] = t;
  if (t.pick != Algo::Winograd) run(t.pick);  // the last run was Winograd's
}

}  // namespace

bool winograd_by_auto(const Conv2dShape& s) { return !rule_only(s, ConvAlgo::Auto); }

}  // namespace conv

std::string conv_autotune_report() {
  std::lock_guard<std::mutex> lock(tune_mutex);
  std::ostringstream out;
  for (const auto& [key, t] : tune_cache()) {
    static const char* const kDirection[3] = {"forward", "backward", "backward without dx"};
    out << kDirection[key[8]] << " C=" << key[0] << " H=" << key[1] << " W=" << key[2]
        << " K=" << key[3] << " " << key[4] << "x" << key[5] << " stride " << key[6] << " pad "
        << key[7] << ": " << algo_name(t.pick) << " (direct " << t.seconds[0] * 1e3
        << " ms, winograd " << t.seconds[1] * 1e3 << " ms)\n";
  }
  return out.str();
}

void conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                    float* y) {
  conv2d_forward_algo(s, x, w, b, y, conv_algo());
}

void conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                     float* dx, float* dw, float* db) {
  conv2d_backward_algo(s, x, w, dy, dx, dw, db, conv_algo());
}

namespace {

// y = the block products + b, for forward_blocks.
auto forward_emit(const Conv2dShape& s, const float* b, float* y) {
  return [&s, b, y](const float* out, int64_t ld, int64_t n0, int64_t B) {
    const int64_t PQ = s.P() * s.Q(), KPQ = s.K * PQ;
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        const float* __restrict src = out + k * ld + i * PQ;
        float* __restrict dst = y + (n0 + i) * KPQ + k * PQ;
        const float bias = b ? b[k] : 0.0f;
        for (int64_t j = 0; j < PQ; ++j) dst[j] = src[j] + bias;
      }
    }
  };
}

// A block of dy (N, K, P, Q) as (K, B*P*Q), for backward_blocks.
auto backward_load(const Conv2dShape& s, const float* dy) {
  return [&s, dy](float* dyb, int64_t ld, int64_t n0, int64_t B) {
    const int64_t PQ = s.P() * s.Q(), KPQ = s.K * PQ;
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        copy_floats(dyb + k * ld + i * PQ, dy + (n0 + i) * KPQ + k * PQ, PQ);
      }
    }
  };
}

}  // namespace

void conv2d_forward_algo(const Conv2dShape& s, const float* x, const float* w, const float* b,
                         float* y, ConvAlgo algo) {
  const auto emit = forward_emit(s, b, y);
  // The shape's rule is called directly, not through run_chosen's closure: LeNet's conv2 ran
  // ~20% slower when its block loops were instantiated inside that lambda.
  if (rule_only(s, algo)) return forward_blocks(s, x, w, emit);
  run_chosen(s, algo, 0, [&](Algo a) {
    if (a == Algo::Winograd) return winograd_forward(s, x, w, b, y);
    forward_blocks(s, x, w, emit, a == Algo::Im2col);
  });
}

void conv2d_backward_algo(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, ConvAlgo algo) {
  const auto load = backward_load(s, dy);
  if (rule_only(s, algo)) return backward_blocks(s, x, w, load, dx, dw, db);
  run_chosen(s, algo, dx ? 1 : 2, [&](Algo a) {
    if (a == Algo::Winograd) return winograd_backward(s, x, w, dy, dx, dw, db);
    backward_blocks(s, x, w, load, dx, dw, db, nullptr, a == Algo::Im2col);
  });
}

void conv::rule_forward_bf16(const Conv2dShape& s, const float* x, const float* w, const float* b,
                             float* y, bool hardware_dot) {
  forward_blocks(s, x, w, forward_emit(s, b, y), false, true, hardware_dot);
}

void conv::rule_backward_bf16(const Conv2dShape& s, const float* x, const float* w,
                              const float* dy, float* dx, float* dw, float* db,
                              bool hardware_dot) {
  backward_blocks(s, x, w, backward_load(s, dy), dx, dw, db, nullptr, false, true, hardware_dot);
}

void conv2d_relu_pool_forward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                              const float* b, uint8_t* mask, float* pooled, bool bf16,
                              bool hardware_dot) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q;
  const int64_t pooled_plane = (P / pool) * (Q / pool);
  if (use_direct(s) && pool == 2) {  // the whole block in registers, image by image
    const auto fused = direct_relu_pool2_kernel(s.C * s.R * s.S);
    const int64_t CHW = s.C * s.H * s.W;
    parallel_for((s.N + kBlock - 1) / kBlock, [&](int64_t blk) {
      float* xr = bf16 ? scratch(tl_rounded, CHW) : nullptr;
      for (int64_t n = blk * kBlock; n < std::min(s.N, (blk + 1) * kBlock); ++n) {
        fused(s, bf16 ? rounded_copy(x + n * CHW, CHW, xr) : x + n * CHW, w, b,
              mask ? mask + n * s.K * PQ : nullptr, pooled + n * s.K * pooled_plane);
      }
    });
    return;
  }
  forward_blocks(s, x, w, [&](const float* out, int64_t ld, int64_t n0, int64_t B) {
    float* acc = scratch(tl_row, Q);
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t plane = (n0 + i) * s.K + k;
        bias_relu_pool_plane(out + k * ld + i * PQ, b ? b[k] : 0.0f, P, Q, pool,
                             mask ? mask + plane * PQ : nullptr, pooled + plane * pooled_plane,
                             acc);
      }
    }
  }, false, bf16, hardware_dot);
}

void conv2d_relu_pool_backward(const Conv2dShape& s, int64_t pool, const float* x, const float* w,
                               const uint8_t* mask, const float* dpooled, float* dx, float* dw,
                               float* db, bool bf16, bool hardware_dot) {
  const int64_t P = s.P(), Q = s.Q(), PQ = P * Q;
  const int64_t pooled_plane = (P / pool) * (Q / pool);
  auto load = [&](float* dyb, int64_t ld, int64_t n0, int64_t B) {
    float* up = scratch(tl_row, Q);
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t plane = (n0 + i) * s.K + k;
        relu_pool_grad_plane(mask + plane * PQ, dpooled + plane * pooled_plane, P, Q, pool,
                             dyb + k * ld + i * PQ, up);
      }
    }
  };
  DirectDw direct_fused;
  if (use_direct(s) && pool == 2) {
    const auto fn = direct_pool2_backward_kernel(s.C * s.R * s.S);
    const int64_t CHW = s.C * s.H * s.W;
    direct_fused = [&, fn, CHW](int64_t n0, int64_t B, float* dws, float* dbs) {
      const float* xb = x + n0 * CHW;
      if (bf16) xb = rounded_copy(xb, B * CHW, scratch(tl_rounded, B * CHW));
      fn(s, xb, B, mask + n0 * s.K * PQ, dpooled + n0 * s.K * pooled_plane, dws, dbs);
    };
  }
  backward_blocks(s, x, w, load, dx, dw, db, direct_fused, false, bf16, hardware_dot);
}

}  // namespace mgpu::ops::cpu::MGPU_CPU_ISA
