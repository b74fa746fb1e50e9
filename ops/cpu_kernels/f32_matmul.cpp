// x @ W^T for fp32 x and an fp32 weight, for steps of a few rows (batch-1 decode), at the rate the weight is read.
//
// bf16_matmul.cpp's scheme for fp32 weights: the output columns come in tiles of 16, interleaved so that one
// 64-byte line holds one input of each of a tile's 16 columns, and an FMA against x's matching input, broadcast,
// leaves each column's sum in its own lane. No horizontal sums, one stream of whole lines per tile; the grouped
// `bmm` this replaces runs MKL's row-per-column GEMV on each core's slice of the weight.
//
// Layout (`ops/cpu_kernels/f32.py` packs it): `[N / 16, K * 16]` fp32: tile t, input i, column j (input i of
// column 16t + j). Rows of x are taken four at a time, so each load of W serves all of them; the tiles are split
// over torch's threads. Built once per ISA variant with the other kernels (ops/cpu_kernels/isa.py names the flags).

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

struct Problem {
  int64_t k, n;
  const float* x;  // [M, K], row stride x_stride
  int64_t x_stride;
  const float* w;  // [N / 16, K * 16]
  float* out;      // [M, N]
};

// The 16 output columns of tile `tile` for R rows of x starting at row m.
template <int R>
void tile_rows(const Problem& p, int64_t m, int64_t tile) {
  const float* w = p.w + tile * p.k * kTileCols;
  // Two sums per row and vector (even and odd inputs): two dependency chains of FMAs.
  vf acc[R][kVectors][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v][0] = acc[r][v][1] = vzero();
  for (int64_t i = 0; i < p.k; ++i) {
    const float* wi = w + i * kTileCols;
    for (int v = 0; v < kVectors; ++v) {
      const vf wv = vload(wi + v * W);
      for (int r = 0; r < R; ++r) {
        acc[r][v][i & 1] = vfma(wv, vset(p.x[(m + r) * p.x_stride + i]), acc[r][v][i & 1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      vstore(p.out + (m + r) * p.n + tile * kTileCols + v * W, vadd(acc[r][v][0], acc[r][v][1]));
}

at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2, "x [M, K], packed [N / 16, K * 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "x and packed must be fp32");
  TORCH_CHECK(x.stride(1) == 1 && packed.is_contiguous(), "rows of x and packed must be contiguous");
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = tiles * kTileCols;
  TORCH_CHECK(packed.size(1) == k * kTileCols, "shapes do not match: the packed width must be K * 16");
  at::Tensor out = at::empty({rows, n}, x.options());
  const Problem p{k, n, x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), out.data_ptr<float>()};
  for_each_tile(tiles, kTileCols * k * 4, rows, [&]<int R>(int64_t m, int64_t tile) { tile_rows<R>(p, m, tile); });
  return out;
}

}  // namespace

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_F32_OP "f32_matmul_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) { m.def(FASTGEN_F32_OP "(Tensor x, Tensor packed) -> Tensor"); }

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_F32_OP, &f32_matmul); }
