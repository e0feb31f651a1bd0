// cpp/ops/cpu_isa.h -- run-time choice of the instruction set the hot CPU kernels run with.
// The kernels listed below (declared in their ops' headers) are compiled twice (CMakeLists.txt:
// MGPU_CPU_ISA_SOURCES) into cpu::avx2 (x86-64-v3) and cpu::avx512 (x86-64-v4); cpu::NAME
// forwards to the one chosen once, at the first call, by the CPU's features and
// MGPU_ISA=auto|avx2|avx512. Both give the same bits. Other cpu:: kernels compile once.
#pragma once

#include <cstdint>
#include <string>

#include "ops/argmax.h"
#include "ops/avg_pool2d.h"
#include "ops/batch_norm.h"
#include "ops/bf16.h"
#include "ops/conv2d.h"
#include "ops/conv2d_relu_pool.h"
#include "ops/elementwise.h"
#include "ops/max_pool2d.h"
#include "ops/softmax_ce.h"

namespace mgpu::ops::cpu {

enum class Isa { AVX2, AVX512 };

struct IsaChoice {
  Isa isa;
  std::string name;    // "avx2" or "avx512"
  std::string reason;  // why: "auto: ..." or "MGPU_ISA=avx2"
  // The bfloat16 products (ops/bf16.h) run vdpbf16ps: auto or MGPU_ISA=avx512_bf16 on a CPU with
  // AVX512_BF16. MGPU_ISA=avx512 keeps the AVX-512 path with the float32-FMA emulation.
  bool bf16_dot = false;
};

// The path the kernels run, chosen at the first call (mgpu._core's import makes that call).
// Throws std::invalid_argument (ValueError) when MGPU_ISA names an unknown path or one this CPU
// lacks, std::runtime_error when the CPU is below x86-64-v3; every later call throws the same.
const IsaChoice& isa_choice();
inline Isa active_isa() { return isa_choice().isa; }

// What the CPU and the OS support: AVX2 + FMA + BMI1/2 (x86-64-v3), AVX-512 F/BW/DQ/VL with the
// OS saving zmm state (x86-64-v4). cpu_model() is the brand string ("" where unknown).
bool cpu_has_avx2();
bool cpu_has_avx512();
bool cpu_has_avx512_bf16();  // AVX-512 as above plus AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16)
std::string cpu_model();

// The kernels behind each path: return type, name, parameters, arguments. cpu_isa.cpp defines
// cpu::NAME (declared in the op's header) from this list; tests call cpu::avx2::NAME and
// cpu::avx512::NAME to compare them. A kernel joins the list together with its source file in
// MGPU_CPU_ISA_SOURCES, whose definitions then live in namespace cpu::MGPU_CPU_ISA.
#define MGPU_CPU_ISA_KERNELS(X)                                                                   \
  X(void, conv2d_forward,                                                                         \
    (const Conv2dShape& s, const float* x, const float* w, const float* b, float* y),             \
    (s, x, w, b, y))                                                                              \
  X(void, conv2d_backward,                                                                        \
    (const Conv2dShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,  \
     float* db),                                                                                  \
    (s, x, w, dy, dx, dw, db))                                                                    \
  X(void, conv2d_forward_algo,                                                                    \
    (const Conv2dShape& s, const float* x, const float* w, const float* b, float* y,              \
     ConvAlgo algo),                                                                              \
    (s, x, w, b, y, algo))                                                                        \
  X(void, conv2d_backward_algo,                                                                   \
    (const Conv2dShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,  \
     float* db, ConvAlgo algo),                                                                   \
    (s, x, w, dy, dx, dw, db, algo))                                                              \
  X(std::string, conv_autotune_report, (), ())                                                   \
  X(void, conv2d_relu_pool_forward,                                                               \
    (const Conv2dShape& s, int64_t pool, const float* x, const float* w, const float* b,          \
     uint8_t* mask, float* pooled, bool bf16, bool hardware_dot),                                 \
    (s, pool, x, w, b, mask, pooled, bf16, hardware_dot))                                         \
  X(void, conv2d_relu_pool_backward,                                                              \
    (const Conv2dShape& s, int64_t pool, const float* x, const float* w, const uint8_t* mask,     \
     const float* dpooled, float* dx, float* dw, float* db, bool bf16, bool hardware_dot),        \
    (s, pool, x, w, mask, dpooled, dx, dw, db, bf16, hardware_dot))                               \
  X(void, avg_pool2d_forward,                                                                     \
    (int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw, int64_t sh, int64_t sw,  \
     const float* x, float* y),                                                                   \
    (N, C, H, W, kh, kw, sh, sw, x, y))                                                           \
  X(void, avg_pool2d_backward,                                                                    \
    (int64_t N, int64_t C, int64_t H, int64_t W, int64_t kh, int64_t kw, int64_t sh, int64_t sw,  \
     const float* dy, float* dx),                                                                 \
    (N, C, H, W, kh, kw, sh, sw, dy, dx))                                                         \
  X(void, max_pool2d_forward,                                                                     \
    (const MaxPoolShape& s, const float* x, float* y, int32_t* indices), (s, x, y, indices))      \
  X(void, max_pool2d_backward,                                                                    \
    (const MaxPoolShape& s, const int32_t* indices, const float* dy, float* dx),                  \
    (s, indices, dy, dx))                                                                         \
  X(void, batch_norm_stats,                                                                       \
    (int64_t N, int64_t C, int64_t HW, const float* x, float* mean, float* var),                  \
    (N, C, HW, x, mean, var))                                                                     \
  X(void, batch_norm_forward,                                                                     \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* mean, const float* var,       \
     const float* gamma, const float* beta, float eps, float* y),                                 \
    (N, C, HW, x, mean, var, gamma, beta, eps, y))                                                \
  X(void, batch_norm_backward_reduce,                                                             \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* dy, const float* mean,        \
     const float* var, float eps, float* sum_dy, float* sum_dy_xhat),                             \
    (N, C, HW, x, dy, mean, var, eps, sum_dy, sum_dy_xhat))                                       \
  X(void, batch_norm_backward,                                                                    \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* dy, const float* mean,        \
     const float* var, const float* gamma, const float* sum_dy, const float* sum_dy_xhat,         \
     double count, float eps, bool training, float* dx),                                          \
    (N, C, HW, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, count, eps, training, dx))           \
  X(void, batch_norm_act_forward,                                                                 \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* mean, const float* var,       \
     const float* gamma, const float* beta, const float* shortcut, float eps, float* y),          \
    (N, C, HW, x, mean, var, gamma, beta, shortcut, eps, y))                                      \
  X(void, batch_norm_act_backward_reduce,                                                         \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* y, const float* dy,           \
     const float* mean, const float* var, float eps, float* sum_dz, float* sum_dz_xhat),          \
    (N, C, HW, x, y, dy, mean, var, eps, sum_dz, sum_dz_xhat))                                    \
  X(void, batch_norm_act_backward,                                                                \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* y, const float* dy,           \
     const float* mean, const float* var, const float* gamma, const float* sum_dz,                \
     const float* sum_dz_xhat, double count, float eps, float* dx, float* dshortcut),             \
    (N, C, HW, x, y, dy, mean, var, gamma, sum_dz, sum_dz_xhat, count, eps, dx, dshortcut))       \
  X(void, batch_norm_backward_full,                                                               \
    (int64_t N, int64_t C, int64_t HW, const float* x, const float* y, const float* dy,           \
     const float* mean, const float* var, const float* gamma, float eps, float* sum_dy,           \
     float* sum_dy_xhat, float* dx, float* dshortcut),                                            \
    (N, C, HW, x, y, dy, mean, var, gamma, eps, sum_dy, sum_dy_xhat, dx, dshortcut))              \
  X(void, bias_grad_rows, (int64_t n, int64_t m, const float* dy, float* db), (n, m, dy, db))     \
  X(void, add_elements, (int64_t n, const float* a, const float* b, float* out), (n, a, b, out))  \
  X(void, sgd_step, (int64_t begin, int64_t end, const SgdStep& body), (begin, end, body))         \
  X(void, adam_step, (int64_t begin, int64_t end, const AdamStep& body), (begin, end, body))       \
  X(double, sum_squares, (int64_t n, const float* x), (n, x))                                     \
  X(void, softmax_ce_forward,                                                                     \
    (int64_t n, int64_t m, const float* logits, const int64_t* labels, float* loss),              \
    (n, m, logits, labels, loss))                                                                 \
  X(void, softmax_ce_forward,                                                                     \
    (int64_t n, int64_t m, const float* logits, const int32_t* labels, float* loss),              \
    (n, m, logits, labels, loss))                                                                 \
  X(void, softmax_ce_backward,                                                                    \
    (int64_t n, int64_t m, const float* logits, const int64_t* labels, const float* dloss,        \
     float* dlogits),                                                                             \
    (n, m, logits, labels, dloss, dlogits))                                                       \
  X(void, softmax_ce_backward,                                                                    \
    (int64_t n, int64_t m, const float* logits, const int32_t* labels, const float* dloss,        \
     float* dlogits),                                                                             \
    (n, m, logits, labels, dloss, dlogits))                                                       \
  X(void, argmax_rows, (int64_t n, int64_t m, const float* x, int64_t* out), (n, m, x, out))     \
  X(void, bf16_round, (int64_t n, const float* x, uint16_t* y), (n, x, y))                       \
  X(void, bf16_round_floats, (int64_t n, const float* x, float* y), (n, x, y))                   \
  X(bool, bf16_rounds_for_rule, (const Conv2dShape& s, ConvAlgo algo), (s, algo))                 \
  X(void, bf16_pack_a,                                                                            \
    (bool trans, int64_t m, int64_t k, const float* a, int64_t lda, uint32_t* out),              \
    (trans, m, k, a, lda, out))                                                                   \
  X(void, bf16_pack_b,                                                                            \
    (bool trans, int64_t k, int64_t n, const float* b, int64_t ldb, uint32_t* out),              \
    (trans, k, n, b, ldb, out))                                                                   \
  X(void, bf16_product, (const Bf16Product& p), (p))                                              \
  X(void, bf16_mm,                                                                                \
    (bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,    \
     const float* b, int64_t ldb, float* c, bool hardware_dot),                                   \
    (trans_a, trans_b, m, n, k, a, lda, b, ldb, c, hardware_dot))                                 \
  X(void, bf16_conv2d_forward,                                                                    \
    (const Conv2dShape& s, const float* x, const float* w, const float* b, float* y,              \
     bool hardware_dot, ConvAlgo algo),                                                           \
    (s, x, w, b, y, hardware_dot, algo))                                                          \
  X(void, bf16_conv2d_backward,                                                                   \
    (const Conv2dShape& s, const float* x, const float* w, const float* dy, float* dx, float* dw,  \
     float* db, bool hardware_dot, ConvAlgo algo),                                                \
    (s, x, w, dy, dx, dw, db, hardware_dot, algo))

#define MGPU_CPU_ISA_DECLARE(ret, name, params, args) ret name params;
namespace avx2 {
MGPU_CPU_ISA_KERNELS(MGPU_CPU_ISA_DECLARE)
}  // namespace avx2
namespace avx512 {
MGPU_CPU_ISA_KERNELS(MGPU_CPU_ISA_DECLARE)
}  // namespace avx512
#undef MGPU_CPU_ISA_DECLARE

}  // namespace mgpu::ops::cpu
