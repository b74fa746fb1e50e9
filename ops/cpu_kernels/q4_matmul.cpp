// x @ W^T for fastgen's int4 weights (w = q * scale + min per group of inputs, q in [0, 15]), with each row
// of x quantized to int8 per weight group first, as llama.cpp multiplies its Q4 blocks: every product is an
// integer one and a group's two scales are applied once to its integer sum. A decode step's linears are bound
// by reading their weights, and torch's int4 kernel is not: it widens every nibble to fp32 and multiplies in
// fp32, ~3 weights a cycle on a 2-core EPYC (SmolLM2-135M: ~11 GB/s of a ~28 GB/s read rate). Here a 32-byte
// load of W is 64 weights: two masks, a shift and two u8 x s8 dot products (one VNNI instruction each, or
// AVX2's maddubs and madd: 2 x 15 x 127 fits an int16).
//
// Layout (`ops/cpu_kernels/q4.py` packs it): W row n is K / 2 bytes; byte j of each 64-input chunk holds
// input j in its low nibble and input j + 32 in its high one. scales_zeros `[N, groups, 2]` holds each group's
// scale and zero (w = (q - 8) * scale + zero, so min = zero - 8 * scale) in x's dtype.
//
// Rows of x are taken four at a time, so each load of W serves all of them, and output columns in tiles of
// 32, whose packed rows stay in cache while every group of four rows passes; the tiles are split over torch's
// threads. Built once per ISA variant with the other kernels (ops/cpu_kernels/isa.py names the flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

constexpr int64_t kChunk = 64;
constexpr int kRows = 4;
constexpr int64_t kTile = 32;
// Fewest packed bytes a thread takes: below it, waking another thread costs more than it saves.
constexpr int64_t kMinThreadBytes = 64 * 1024;

// Row m of x, `k` values, quantized per group of `group`: scale = max |x| / 127 and q = round(x / scale) (to
// nearest even, through the reciprocal), plus each group's scale times the sum of its q (for the min term).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, int8_t* q, float* scales, float* scaled_sums) {
  for (int64_t g = 0; g < k / group; ++g) {
    const T* xg = x + g * group;
    float amax = 0.0f;
    for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xg[i])));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < group; ++i) {
      const int8_t v = static_cast<int8_t>(std::nearbyint(static_cast<float>(xg[i]) * inv));
      q[g * group + i] = v;
      sum += v;
    }
    scales[g] = scale;
    scaled_sums[g] = scale * static_cast<float>(sum);
  }
}

template <typename T>
struct Problem {
  int64_t k, groups, group;
  const int8_t* xq;          // [M, K]
  const float* xs;           // [M, groups]: each group's scale
  const float* xsums;        // [M, groups]: scale x sum of q
  const uint8_t* w;          // [N, K / 2]
  const T* scales_zeros;     // [N, groups, 2]
  T* out;                    // [M, N]
  int64_t n;
};

// Output column n for R rows of x starting at row m.
template <int R, typename T>
void column(const Problem<T>& p, int64_t m, int64_t n) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const uint8_t* w = p.w + n * (p.k / 2);
  const T* sz = p.scales_zeros + n * p.groups * 2;
  const int64_t chunks = p.group / kChunk;
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = 0.0f;
  }
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i low_sum[R], high_sum[R];
    for (int r = 0; r < R; ++r) low_sum[r] = high_sum[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t at = (g * chunks + c) * kChunk;
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + at / 2));
      const __m256i low = _mm256_and_si256(packed, mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = p.xq + (m + r) * p.k + at;
        low_sum[r] = dot_u8s8(low_sum[r], low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
        high_sum[r] = dot_u8s8(high_sum[r], high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
      }
    }
    const float scale = static_cast<float>(sz[2 * g]);
    const float min = static_cast<float>(sz[2 * g + 1]) - 8.0f * scale;
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m + r) * p.groups + g;
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(low_sum[r], high_sum[r]));
      acc[r] = _mm256_fmadd_ps(sum, _mm256_set1_ps(scale * p.xs[at]), acc[r]);
      mins[r] += min * p.xsums[at];
    }
  }
  for (int r = 0; r < R; ++r) {
    p.out[(m + r) * p.n + n] = static_cast<T>(hsum(acc[r]) + mins[r]);
  }
}

// Columns lo..hi of rows m..m + count (count <= kRows) of x.
template <typename T>
void columns(const Problem<T>& p, int64_t m, int64_t count, int64_t lo, int64_t hi) {
  for (int64_t n = lo; n < hi; ++n) {
    switch (count) {
      case 4: column<4>(p, m, n); break;
      case 3: column<3>(p, m, n); break;
      case 2: column<2>(p, m, n); break;
      default: column<1>(p, m, n); break;
    }
  }
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t group) {
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / group;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * groups), xsums(rows * groups);
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      quantize_row(xp + m * x.stride(0), k, group, xq.data() + m * k, xs.data() + m * groups,
                   xsums.data() + m * groups);
    }
  });
  at::Tensor out = at::empty({rows, n}, x.options());
  const Problem<T> p{k, groups, group, xq.data(), xs.data(), xsums.data(), packed.data_ptr<uint8_t>(),
                     scales_zeros.data_ptr<T>(), out.data_ptr<T>(), n};
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / (kTile * k / 2));
  at::parallel_for(0, tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t tile = lo; tile < hi; ++tile) {
      const int64_t end = std::min(n, (tile + 1) * kTile);
      // Every row of x against one tile of W, four rows at a time: the tile is read from memory once.
      for (int64_t m = 0; m < rows; m += kRows) columns(p, m, std::min<int64_t>(kRows, rows - m), tile * kTile, end);
    }
  });
  return out;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                     int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scales_zeros.dim() == 3,
              "x [M, K], packed [N, K / 2], scales_zeros [N, K / group_size, 2]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales_zeros.scalar_type() == x.scalar_type(),
              "packed must be uint8 and scales_zeros of x's dtype");
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous() && scales_zeros.is_contiguous(),
              "rows of x, packed and scales_zeros must be contiguous");
  const int64_t k = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0 && k % group_size == 0 && packed.size(1) * 2 == k &&
                  scales_zeros.size(0) == packed.size(0) && scales_zeros.size(1) == k / group_size &&
                  scales_zeros.size(2) == 2,
              "shapes do not match: the group size must be a multiple of 64 dividing K, the packed width K / 2");
  switch (x.scalar_type()) {
    case at::kFloat: return run<float>(x, packed, scales_zeros, group_size);
    case at::kBFloat16: return run<c10::BFloat16>(x, packed, scales_zeros, group_size);
    case at::kHalf: return run<c10::Half>(x, packed, scales_zeros, group_size);
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_Q4_OP "q4_matmul_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def(FASTGEN_Q4_OP "(Tensor x, Tensor packed, Tensor scales_zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_Q4_OP, &q4_matmul); }
