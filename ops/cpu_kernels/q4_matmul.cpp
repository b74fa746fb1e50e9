// x @ W^T for fastgen's int4 weights (w = q * scale + min per group of inputs, q in [0, 15]), with each row
// of x quantized to int8 per weight group first, as llama.cpp multiplies its Q4 blocks: every product is an
// integer one and a group's two scales are applied once to its integer sum. A decode step's linears are bound
// by reading their weights, and torch's int4 kernel is not: it widens every nibble to fp32 and multiplies in
// fp32, ~3 weights a cycle on a 2-core EPYC (SmolLM2-135M: ~11 GB/s of a ~28 GB/s read rate).
//
// Layout (`ops/cpu_kernels/q4.py` packs it): output columns in tiles of 16, each tile's weights interleaved so
// that one 64-byte load holds 4 bytes of each of its 16 columns. Within a 64-input chunk, sub-block b (0..7) is
// 64 bytes: column j's 4 bytes hold inputs 4b..4b+3 in their low nibbles and inputs 32+4b..32+4b+3 in their high
// ones. A u8 x s8 dot product of such a load against x's 4 matching inputs (broadcast) leaves each column's sum
// in its own int32 lane: no horizontal sums, and a group's scales are applied to 16 columns in one vector, read
// from scales_zeros `[N / 16, groups, 2, 16]` (each group's 16 scales, then its 16 zeros, w = (q - 8) * scale +
// zero) in x's dtype. A row-per-column layout did ~10 cycles of scalar scale work per 32 bytes and ran at ~11
// GB/s; this one runs the same linears at the read rate.
//
// Rows of x are taken four at a time, so each load of W serves all of them; the tiles are split over torch's
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
#include <cstring>
#include <vector>

namespace {

#include "int8_dot.h"
#include "simd.h"
#include "tiles.h"

constexpr int64_t kChunk = 64;
constexpr int64_t kChunkBytes = kChunk / 2 * kTileCols;  // one chunk of one tile
#if defined(__AVX512F__)
inline vi low_nibbles(vi p) { return _mm512_and_si512(p, _mm512_set1_epi8(0x0F)); }
inline vi high_nibbles(vi p) { return _mm512_and_si512(_mm512_srli_epi16(p, 4), _mm512_set1_epi8(0x0F)); }
inline vf sum_to_float(vi a, vi b) { return _mm512_cvtepi32_ps(_mm512_add_epi32(a, b)); }
#else
inline vi low_nibbles(vi p) { return _mm256_and_si256(p, _mm256_set1_epi8(0x0F)); }
inline vi high_nibbles(vi p) { return _mm256_and_si256(_mm256_srli_epi16(p, 4), _mm256_set1_epi8(0x0F)); }
inline vf sum_to_float(vi a, vi b) { return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b)); }
#endif

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
  const uint8_t* w;          // [N / 16, K * 8]
  const T* scales_zeros;     // [N / 16, groups, 2, 16]
  T* out;                    // [M, N]
  int64_t n;
};

// The 16 output columns of tile `tile` for R rows of x starting at row m.
template <int R, typename T>
void tile_rows(const Problem<T>& p, int64_t m, int64_t tile) {
  const uint8_t* w = p.w + tile * p.k * (kTileCols / 2);
  const T* sz = p.scales_zeros + tile * p.groups * 2 * kTileCols;
  const int64_t chunks = p.group / kChunk;
  vf acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = vzero();
  for (int64_t g = 0; g < p.groups; ++g) {
    // Low and high nibbles in separate sums: two dependency chains per row and vector.
    vi low_sum[R][kVectors], high_sum[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) low_sum[r][v] = high_sum[r][v] = vi_zero();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t chunk = g * chunks + c;
      const uint8_t* wc = w + chunk * kChunkBytes;
      for (int b = 0; b < 8; ++b) {
        vi low[kVectors], high[kVectors];
        for (int v = 0; v < kVectors; ++v) {
          const vi packed = vi_load(wc + b * 4 * kTileCols + v * 4 * W);
          low[v] = low_nibbles(packed);
          high[v] = high_nibbles(packed);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* x = p.xq + (m + r) * p.k + chunk * kChunk + 4 * b;
          const vi x_low = broadcast4(x), x_high = broadcast4(x + kChunk / 2);
          for (int v = 0; v < kVectors; ++v) {
            low_sum[r][v] = dot_u8s8(low_sum[r][v], low[v], x_low);
            high_sum[r][v] = dot_u8s8(high_sum[r][v], high[v], x_high);
          }
        }
      }
    }
    const T* scales = sz + g * 2 * kTileCols;
    for (int v = 0; v < kVectors; ++v) {
      const vf scale = vload(scales + v * W);
      const vf min = vfnma(vset(8.0f), scale, vload(scales + kTileCols + v * W));  // zero - 8 * scale
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m + r) * p.groups + g;
        acc[r][v] = vfma(sum_to_float(low_sum[r][v], high_sum[r][v]), vmul(scale, vset(p.xs[at])), acc[r][v]);
        acc[r][v] = vfma(min, vset(p.xsums[at]), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) vstore(p.out + (m + r) * p.n + tile * kTileCols + v * W, acc[r][v]);
}

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros, int64_t group) {
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = tiles * kTileCols, groups = k / group;
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
  for_each_tile(tiles, kTileCols * k / 2, rows, [&]<int R>(int64_t m, int64_t tile) { tile_rows<R>(p, m, tile); });
  return out;
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                     int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && scales_zeros.dim() == 4,
              "x [M, K], packed [N / 16, K * 8], scales_zeros [N / 16, K / group_size, 2, 16]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales_zeros.scalar_type() == x.scalar_type(),
              "packed must be uint8 and scales_zeros of x's dtype");
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous() && scales_zeros.is_contiguous(),
              "rows of x, packed and scales_zeros must be contiguous");
  const int64_t k = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0 && k % group_size == 0 && packed.size(1) == k * 8 &&
                  scales_zeros.size(0) == packed.size(0) && scales_zeros.size(1) == k / group_size &&
                  scales_zeros.size(2) == 2 && scales_zeros.size(3) == kTileCols,
              "shapes do not match: the group size must be a multiple of 64 dividing K, the packed width K * 8");
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
