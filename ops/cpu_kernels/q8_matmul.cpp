// x @ W^T for a weight held as GGUF's Q8_0: int8 values in blocks of 32 along the input, one fp16 scale a
// block. It is what llama.cpp computes for such a weight: each row of x is itself quantized to Q8_0
// (scale = max |x| / 127 per block, values rounded to nearest), every block is one dot product of 32 int8
// pairs, and the block's two scales multiply its integer sum into an fp32 accumulator. The weight streams
// from memory once, a byte a value (half of bf16's bytes, a quarter of fp32's): for a batch-1 LM head
// that read is the whole cost.
//
// The int8 dot is AVX2's sign trick: |w| as unsigned times x with w's sign, summed in pairs (maddubs, no
// overflow: 2 * 128 * 127 < 2^15) and then in fours (madd), or in one VNNI instruction where the build has
// it. Rows of x are taken four at a time, so each 32-byte load of W serves all of them; the output rows are
// split over torch's threads.
//
// Built once per ISA variant with paged_decode.cpp (ops/cpu_kernels/isa.py names the flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#include "int8_dot.h"

constexpr int64_t kBlock = 32;
// Rows of x that share each load of W.
constexpr int kRows = 4;
// Fewest output columns a thread takes: below it, a parallel region costs more than it saves.
constexpr int64_t kGrain = 256;

// llama.cpp's quantize_row_q8_0: per block of 32, scale = max |x| / 127 and q = round(x / scale), the scale
// then kept at fp16 precision.
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* scales) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    scales[b] = static_cast<float>(c10::Half(scale));  // stored as fp16, as a Q8_0 block holds it
    for (int64_t i = 0; i < kBlock; ++i) q[b * kBlock + i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[i]) * inv));
  }
}

// The eight int32 partial sums of a block's 32 products w[i] * x[i], given |w| (at most 128) and x with w's sign.
inline __m256i block_dot(__m256i abs_w, __m256i signed_x) { return dot_u8s8(_mm256_setzero_si256(), abs_w, signed_x); }

struct Problem {
  int64_t k, n, blocks;
  const int8_t* xq;      // [M, K] x quantized
  const float* xs;       // [M, blocks] its scales
  const int8_t* wq;      // [N, K]
  const c10::Half* ws;   // [N, blocks]
  float* out;            // [M, N], row stride out_stride
  int64_t out_stride;
};

// Output column n for R rows of x starting at row m; `w_scales` holds W row n's scales in fp32.
template <int R>
void columns(const Problem& p, int64_t m, int64_t n, const float* w_scales) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int8_t* w = p.wq + n * p.k;
  for (int64_t b = 0; b < p.blocks; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    const __m256i abs_w = _mm256_sign_epi8(wv, wv);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m + r;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.xq + row * p.k + b * kBlock));
      const __m256 sum = _mm256_cvtepi32_ps(block_dot(abs_w, _mm256_sign_epi8(xv, wv)));
      acc[r] = _mm256_fmadd_ps(sum, _mm256_set1_ps(w_scales[b] * p.xs[row * p.blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) p.out[(m + r) * p.out_stride + n] = hsum(acc[r]);
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * blocks);
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < rows; ++m) quantize_row(xp + m * x.stride(0), k, xq.data() + m * k, xs.data() + m * blocks);
  const Problem p{k, qweight.size(0), blocks, xq.data(), xs.data(), qweight.data_ptr<int8_t>(),
                  scales.data_ptr<c10::Half>(), out.data_ptr<float>(), out.stride(0)};
  at::parallel_for(0, p.n, kGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> w_scales(blocks);
    for (int64_t n = lo; n < hi; ++n) {
      const c10::Half* s = p.ws + n * blocks;
      for (int64_t b = 0; b < blocks; ++b) w_scales[b] = static_cast<float>(s[b]);
      int64_t m = 0;
      for (; m + kRows <= rows; m += kRows) columns<kRows>(p, m, n, w_scales.data());
      switch (rows - m) {
        case 3: columns<3>(p, m, n, w_scales.data()); break;
        case 2: columns<2>(p, m, n, w_scales.data()); break;
        case 1: columns<1>(p, m, n, w_scales.data()); break;
        default: break;
      }
    }
  });
}

void q8_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && qweight.dim() == 2 && scales.dim() == 2,
              "out [M, N], x [M, K], qweight [N, K], scales [N, K / 32]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && qweight.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf,
              "out must be float32, qweight int8 and scales float16");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && qweight.is_contiguous() && scales.is_contiguous(),
              "rows of out and x, qweight and scales must be contiguous");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0 && qweight.size(1) == k && scales.size(1) == k / kBlock &&
                  scales.size(0) == qweight.size(0) && out.size(0) == x.size(0) && out.size(1) == qweight.size(0),
              "shapes do not match: K must be a multiple of 32 and the weight's width");
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(out, x, qweight, scales); break;
    case at::kBFloat16: run<c10::BFloat16>(out, x, qweight, scales); break;
    case at::kHalf: run<c10::Half>(out, x, qweight, scales); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_Q8_OP "q8_matmul_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def(FASTGEN_Q8_OP "(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales) -> ()");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_Q8_OP, &q8_matmul); }
