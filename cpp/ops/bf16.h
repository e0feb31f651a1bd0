// cpp/ops/bf16.h -- bfloat16 mixed precision for the matrix products: linear's mm and conv2d's
// forward, data gradient and weight gradient, with float32 inputs and float32 outputs.
//
// Where bfloat16 enters. Tensors stay float32: the master weights, the activations, the
// gradients and everything batch norm, the loss, softmax and the optimizer touch. Only the
// operands of a matrix product are rounded to bfloat16, while they are packed into the panels the
// product's register tiles read (as oneDNN's reorders do), and every product accumulates in
// float32. (Conv passes under auto round their operands first and run float32's kernels on
// them: see algo below.) The products' speed comes from AVX512_BF16's vdpbf16ps, two
// multiply-adds per float32 lane per instruction, and from packed operands half the bytes of
// float32 ones; the bfloat16 tensor dtype (storage, NumPy / DLPack interop) changes nothing here.
//
// The numbers, on every CPU path alike:
// - float -> bfloat16 rounds to nearest, ties to even; a NaN stays a NaN with its sign and top
//   mantissa bits, the quiet bit set; +-inf stays; zeros and float32 denormals become a zero of
//   their sign (what vcvtneps2bf16 does; the bits of x + 0x7fff + lsb, top half).
// - A product's k dimension is cut into pairs (k, k+1), the last one padded with zeros when k is
//   odd. Each output adds its pairs in order of k; within a pair it adds the odd element's
//   product first, then the even one's, each a fused multiply-add rounded to nearest even, with
//   denormal inputs read as zero and denormal results flushed to zero. That is vdpbf16ps's order
//   (Intel's pseudo-code, confirmed on Zen 4). A bfloat16 x bfloat16 product is exact in float32,
//   so the AVX-512F and AVX2 paths, which run float32 FMAs on the rounded values under
//   MXCSR.FTZ|DAZ in that order, give the AVX512_BF16 path's bits, and so does every thread count.
//   (A NaN result is a NaN on every path; which input's payload it carries may differ, since
//   vdpbf16ps ranks NaN operands in its own order.)
// - Error, for operands and partial sums in the normal range: each operand carries a relative
//   error of at most u = 2^-8 (bfloat16 keeps 8 significant bits), a product 2u + u^2, and the
//   float32 sum over k adds at most g_k = k * 2^-24 / (1 - k * 2^-24) of the sum of |products|:
//   |y - y_exact| <= ((2u + u^2)(1 + g_k) + g_k) * sum_k |a_ik| |b_kj|. Tests hold every op to
//   that bound against float64 (tests/ops/test_bf16.py).
//
// Paths (MGPU_ISA, cpu_isa.h): avx512_bf16 (vdpbf16ps; chosen by auto where the CPU has
// AVX512_BF16), avx512 and avx2 (the float32-FMA emulation). The ops take precision=bf16
// (ops/precision.h) on CPU devices and GPUs; GPUs run ops/bf16_gpu.h's kernels, which follow the
// order above (and the chunks and sums of the conv passes below) and so give these bits.
#pragma once

#include <cstdint>
#include <string>

#include "ops/conv2d.h"

namespace mgpu::ops::cpu {

// The packed layouts every path shares. op(A) (m, k) is packed in panels of kBf16Mr rows: for
// each k pair p, kBf16Mr 32-bit words, row r's word holding bf16(A[r, 2p + 1]) in its high half
// and bf16(A[r, 2p]) in its low half. op(B) (k, n) likewise in panels of kBf16Nr columns. Rows,
// columns and the odd k past the end are zeros.
constexpr int64_t kBf16Mr = 8;
constexpr int64_t kBf16Nr = 32;
inline int64_t bf16_pairs(int64_t k) { return (k + 1) / 2; }
inline int64_t bf16_packed_a_words(int64_t m, int64_t k) {
  return (m + kBf16Mr - 1) / kBf16Mr * kBf16Mr * bf16_pairs(k);
}
inline int64_t bf16_packed_b_words(int64_t k, int64_t n) {
  return (n + kBf16Nr - 1) / kBf16Nr * kBf16Nr * bf16_pairs(k);
}

// True where the products run vdpbf16ps: the AVX-512 path on a CPU with AVX512_BF16, unless
// MGPU_ISA=avx512 asks for the float32-FMA emulation (cpu_isa.h's IsaChoice::bf16_dot).
bool bf16_hardware_dot();

// One product for the per-path kernels (cpu_isa.h's MGPU_CPU_ISA_KERNELS): c (m, n, row stride
// ldc) = pa @ pb from packed operands; with accumulate, each output's sum starts from c's old
// value instead of zero.
// hardware_dot selects vdpbf16ps; only the avx512 path has it (the avx2 kernel ignores it).
struct Bf16Product {
  int64_t m, n, k;
  const uint32_t* pa;
  const uint32_t* pb;
  float* c;
  int64_t ldc;
  bool accumulate;
  bool hardware_dot;
};

// The kernels, one per path (cpu_isa.h's MGPU_CPU_ISA_KERNELS); cpu::NAME runs the active path's.
// The caller checks shapes and allocates; results never depend on the thread count.
// y[i] = the bfloat16 bits of x[i] (the rounding above).
void bf16_round(int64_t n, const float* x, uint16_t* y);
// y[i] = x[i] rounded to bfloat16 and widened back to float32 (y may be x), on the device's cores.
void bf16_round_floats(int64_t n, const float* x, float* y);
// True where a bf16 conv pass of shape s under algo runs float32's rule (direct, lanes or
// im2col; not Winograd) on operands rounded to bfloat16 (see algo below): the passes
// conv2d_relu_pool's kernels may then run on rounded operands too.
bool bf16_rounds_for_rule(const Conv2dShape& s, ConvAlgo algo);
// Pack op(A) (m, k; A^T when trans, a's rows lda floats apart) into bf16_packed_a_words(m, k)
// words, and op(B) (k, n) into bf16_packed_b_words(k, n) words.
void bf16_pack_a(bool trans, int64_t m, int64_t k, const float* a, int64_t lda, uint32_t* out);
void bf16_pack_b(bool trans, int64_t k, int64_t n, const float* b, int64_t ldb, uint32_t* out);
// One product on the calling thread.
void bf16_product(const Bf16Product& p);
// c (m, n, contiguous) = op(a) @ op(b), on the device's cores.
void bf16_mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, bool hardware_dot);
// conv2d's forward and backward (conv2d.h's cpu:: contract: b, dx and db may be null) through
// im2col onto the products above, in chunks of images whose size depends on the shape alone
// (x and dy are rounded to bfloat16 once and unfolded as 16-bit values): y = W @ col + b;
// dw = sum over chunks, in order, of dy @ col^T (each chunk's sums start from the previous
// chunks' dw); dx, for stride 1 with a square kernel and pad <= R-1, is the forward pass of dy
// padded by R-1-pad with the kernel flipped and its channels swapped (K*R*S products per
// element, one float32 sum), else col2im(W^T @ dy) (the R*S taps added in float32 after);
// db sums dy rounded to bfloat16 (the dy the products see, as PyTorch's autocast sums a
// bfloat16 gradient) in float32 per image and in double over images.
// algo (conv2d.h's ConvAlgo, MGPU_CONV_ALGO):
// - auto and tune: the pass rounds x, w and dy to bfloat16 (as float32 values, the rounding
//   above: ops/bf16_round.h) and runs float32's choice under auto on them: Winograd F(4x4, 3x3)
//   where float32's auto takes it (conv2d_cpu.h's winograd_by_auto; its transforms round x and
//   dy as they read them), float32's rule (direct, lanes, im2col + sgemm) elsewhere, rounding
//   x and dy in its blocks' own copies of them (conv2d_cpu.h's rule_forward_bf16). The rule's
//   lane shapes (LeNet's conv2) then run their own pair products (conv2d_cpu/lanes_bf16.cpp:
//   vdpbf16ps, or this order's float32 FMAs, on 16 images in lanes); the direct, im2col and
//   Winograd kernels are float32's: they were faster than these products at ResNet-18's layers
//   and LeNet's conv1 on every CPU path but two stride-2 layers on AVX512_BF16 (bf16_cpu.cpp's
//   bf16_route has the figures), and the route must not depend on the path. The lane products
//   are faster than float32's lane kernels on AVX512_BF16 and slower on the other paths
//   (lanes_bf16.cpp has the figures). The operands are
//   then what the products would see; a product of two bfloat16 values is exact in float32, so
//   direct, im2col and lane kernels keep the bound above (another order of the float32 sums),
//   and Winograd adds float32 Winograd's own error on the rounded operands
//   (tests/ops/test_bf16_rounded.py states it). Every output of the direct, im2col and Winograd
//   kernels, db included (the sum of the rounded dy, as below, in float32's kernel's order), is
//   then float32's pass on the rounded operands, bit for bit.
// - winograd runs the forward of a 3x3 stride-1 shape with pad <= 2, and the data gradient
//   through it, as Winograd F(2x2, 3x3) with these products over the channels
//   (conv2d_cpu/winograd_bf16.cpp: its error and bound); dw takes the im2col product.
// - direct and im2col take the im2col products everywhere (their bits are the GPU kernels').
void bf16_conv2d_forward(const Conv2dShape& s, const float* x, const float* w, const float* b,
                         float* y, bool hardware_dot, ConvAlgo algo);
void bf16_conv2d_backward(const Conv2dShape& s, const float* x, const float* w, const float* dy,
                          float* dx, float* dw, float* db, bool hardware_dot, ConvAlgo algo);

}  // namespace mgpu::ops::cpu
