// x @ W^T for bf16 x and a bf16 weight, for steps of a few rows (batch-1 decode), at the rate the weight is read.
//
// A row-per-output-column GEMV needs a horizontal sum per column and, in oneDNN's packed kernel or ATen's
// `mv`, streamed bf16 weights at ~18 GB/s of a ~29 GB/s read rate on a 2-core EPYC (SmolLM2-135M's shapes).
// Here the output columns come in tiles of 16, interleaved so that one 64-byte load holds one input pair of
// each of its 16 columns: a bf16 pair-dot (AVX512-BF16's vdpbf16ps) against x's matching pair, broadcast,
// leaves each column's sum in its own fp32 lane. Without AVX512-BF16 the pairs are widened (a shift, a mask)
// and multiplied by FMAs. Products are exact in fp32 either way; only the order of the sums differs from a
// dense GEMM's.
//
// Layout (`ops/cpu_kernels/bf16.py` packs it): `[N / 16, K * 16]` bf16: tile t, input pair p, column j, then
// the pair's two values (inputs 2p and 2p + 1 of column 16t + j). Rows of x are taken four at a time, so each
// load of W serves all of them; the tiles are split over torch's threads. Built once per ISA variant with the
// other kernels (ops/cpu_kernels/isa.py names the flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#include "simd.h"
#include "tiles.h"

#if defined(__AVX512F__)
inline vf even_values(vi w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline vf odd_values(vi w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF0000))); }
#else
inline vf even_values(vi w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline vf odd_values(vi w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

// acc + the products of one input pair of W's 16 columns (per lane) with x's pair.
inline vf pair_fma(vf acc, vi w, const c10::BFloat16* x) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)broadcast4(x));
#else
  acc = vfma(even_values(w), vset(static_cast<float>(x[0])), acc);
  return vfma(odd_values(w), vset(static_cast<float>(x[1])), acc);
#endif
}

struct Problem {
  int64_t k, n;
  const c10::BFloat16* x;  // [M, K], row stride x_stride
  int64_t x_stride;
  const c10::BFloat16* w;  // [N / 16, K * 16]
  c10::BFloat16* out;      // [M, N]
};

// The 16 output columns of tile `tile` for R rows of x starting at row m.
template <int R>
void tile_rows(const Problem& p, int64_t m, int64_t tile) {
  const c10::BFloat16* w = p.w + tile * p.k * kTileCols;
  // Two sums per row and vector (even and odd pairs): two dependency chains of pair-dots.
  vf acc[R][kVectors][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v][0] = acc[r][v][1] = vzero();
  const int64_t pairs = p.k / 2;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const c10::BFloat16* wp = w + pair * 2 * kTileCols;
    for (int v = 0; v < kVectors; ++v) {
      const vi wv = vi_load(wp + v * 2 * W);
      for (int r = 0; r < R; ++r) {
        acc[r][v][pair & 1] = pair_fma(acc[r][v][pair & 1], wv, p.x + (m + r) * p.x_stride + 2 * pair);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      vstore(p.out + (m + r) * p.n + tile * kTileCols + v * W, vadd(acc[r][v][0], acc[r][v][1]));
}

at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "x [M, K], packed [N / 16, K * 16]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "x and packed must be bf16");
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous(), "rows of x and packed must be contiguous");
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = tiles * kTileCols;
  TORCH_CHECK(k % 2 == 0 && packed.size(1) == k * kTileCols,
              "shapes do not match: K must be even and the packed width K * 16");
  at::Tensor out = at::empty({rows, n}, x.options());
  const Problem p{k, n, x.data_ptr<c10::BFloat16>(), x.stride(0), packed.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>()};
  for_each_tile(tiles, kTileCols * k * 2, rows, [&]<int R>(int64_t m, int64_t tile) { tile_rows<R>(p, m, tile); });
  return out;
}

}  // namespace

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_BF16_OP "bf16_matmul_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) { m.def(FASTGEN_BF16_OP "(Tensor x, Tensor packed) -> Tensor"); }

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_BF16_OP, &bf16_matmul); }
