// x @ W^T for a weight held as GGUF's Q8_0: int8 values in blocks of 32 along the input, one fp16 scale a
// block. It is what llama.cpp computes for such a weight: each row of x is itself quantized to Q8_0
// (scale = max |x| / 127 per block, values rounded to nearest), every block is one dot product of 32 int8
// pairs, and the block's two scales multiply its integer sum into an fp32 accumulator. The weight streams
// from memory once, a byte a value (half of bf16's bytes, a quarter of fp32's).
//
// Layout (`ops/cpu_kernels/q8.py` packs it): the output columns in tiles of 16 (the last one padded with
// zeros), interleaved so that one 64-byte load holds 4 values of each of a tile's columns: within a block,
// sub-block b (0..7) holds inputs 4b..4b+3 of each column. A dot product of such a load against x's 4
// matching values (broadcast) leaves each column's sum in its own int32 lane, and a block's 16 scales
// (`[tiles, K / 32, 16]` fp16) apply as one vector. With VNNI the weights are read as unsigned (w + 128, an
// xor) and 128 x the block's sum of x taken back; without it, |w| times x with w's sign (maddubs and madd:
// 2 * 127 * 127 < 2^15). A row-per-column layout read the 120 products of a SmolLM2-135M token at ~19 GB/s of
// a ~29 GB/s read rate (2-core EPYC); the scalar work per 32-byte block was the limit.
//
// Rows of x are taken four at a time, so each load of W serves all of them; the tiles are split over torch's
// threads. Built once per ISA variant with the other kernels (ops/cpu_kernels/isa.py names the flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
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

constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes = kBlock * kTileCols;  // one block of one tile
#if defined(__AVX512F__)
inline vf sum_to_float(vi a, vi b, int32_t correction) {
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a, b), _mm512_set1_epi32(correction)));
}
#if defined(__AVX512VNNI__)
constexpr bool kOffset = true;
inline vi dot_s8(vi acc, vi w, vi x) { return dot_u8s8(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), x); }
#else
constexpr bool kOffset = false;
inline vi dot_s8(vi acc, vi w, vi x) {
  const vi signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return dot_u8s8(acc, _mm512_abs_epi8(w), signed_x);
}
#endif
#else
inline vf sum_to_float(vi a, vi b, int32_t correction) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(a, b), _mm256_set1_epi32(correction)));
}
constexpr bool kOffset = false;
inline vi dot_s8(vi acc, vi w, vi x) { return dot_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
#endif

// llama.cpp's quantize_row_q8_0: per block of 32, scale = max |x| / 127 and q = round(x / scale), the scale
// then kept at fp16 precision; and 128 x each block's sum of q (what the VNNI path's offset adds).
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* scales, int32_t* offsets) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    scales[b] = static_cast<float>(c10::Half(scale));  // stored as fp16, as a Q8_0 block holds it
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      q[b * kBlock + i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[i]) * inv));
      sum += q[b * kBlock + i];
    }
    offsets[b] = kOffset ? 128 * sum : 0;
  }
}

struct Problem {
  int64_t k, n, blocks;
  const int8_t* xq;          // [M, K] x quantized
  const float* xs;           // [M, blocks] its scales
  const int32_t* offsets;    // [M, blocks] 128 x its sums (VNNI), else 0
  const int8_t* w;           // [tiles, K * 16]
  const c10::Half* scales;   // [tiles, blocks, 16]
  float* out;                // [M, N], row stride out_stride
  int64_t out_stride;
};

// The 16 output columns of tile `tile` (fewer in a padded last tile) for R rows of x starting at row m.
template <int R>
void tile_rows(const Problem& p, int64_t m, int64_t tile) {
  const int8_t* w = p.w + tile * p.k * kTileCols;
  const c10::Half* tile_scales = p.scales + tile * p.blocks * kTileCols;
  vf acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = vzero();
  for (int64_t bl = 0; bl < p.blocks; ++bl) {
    // Even and odd sub-blocks in separate sums: two dependency chains per row and vector.
    vi sums[R][kVectors][2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) sums[r][v][0] = sums[r][v][1] = vi_zero();
    const int8_t* wb = w + bl * kBlockBytes;
    for (int b = 0; b < 8; ++b) {
      vi wv[kVectors];
      for (int v = 0; v < kVectors; ++v) wv[v] = vi_load(wb + b * 4 * kTileCols + v * 4 * W);
      for (int r = 0; r < R; ++r) {
        const vi x = broadcast4(p.xq + (m + r) * p.k + bl * kBlock + 4 * b);
        for (int v = 0; v < kVectors; ++v) sums[r][v][b & 1] = dot_s8(sums[r][v][b & 1], wv[v], x);
      }
    }
    for (int v = 0; v < kVectors; ++v) {
      const vf scale = vload(tile_scales + bl * kTileCols + v * W);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m + r) * p.blocks + bl;
        acc[r][v] = vfma(sum_to_float(sums[r][v][0], sums[r][v][1], p.offsets[at]), vmul(scale, vset(p.xs[at])),
                         acc[r][v]);
      }
    }
  }
  const int64_t width = std::min(kTileCols, p.n - tile * kTileCols);
  for (int r = 0; r < R; ++r) {
    float* dst = p.out + (m + r) * p.out_stride + tile * kTileCols;
    if (width == kTileCols) {
      for (int v = 0; v < kVectors; ++v) vstore(dst + v * W, acc[r][v]);
    } else {
      alignas(64) float full[kTileCols];
      for (int v = 0; v < kVectors; ++v) vstore(full + v * W, acc[r][v]);
      std::copy(full, full + width, dst);
    }
  }
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock, tiles = packed.size(0);
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows * blocks);
  std::vector<int32_t> offsets(rows * blocks);
  const T* xp = x.data_ptr<T>();
  for (int64_t m = 0; m < rows; ++m) {
    quantize_row(xp + m * x.stride(0), k, xq.data() + m * k, xs.data() + m * blocks, offsets.data() + m * blocks);
  }
  const Problem p{k, out.size(1), blocks, xq.data(), xs.data(), offsets.data(), packed.data_ptr<int8_t>(),
                  scales.data_ptr<c10::Half>(), out.data_ptr<float>(), out.stride(0)};
  for_each_tile(tiles, kTileCols * k, rows, [&]<int R>(int64_t m, int64_t tile) { tile_rows<R>(p, m, tile); });
}

void q8_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && packed.dim() == 2 && scales.dim() == 3,
              "out [M, N], x [M, K], packed [tiles, K * 16], scales [tiles, K / 32, 16]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && packed.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf,
              "out must be float32, packed int8 and scales float16");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && packed.is_contiguous() && scales.is_contiguous(),
              "rows of out and x, packed and scales must be contiguous");
  const int64_t k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(k % kBlock == 0 && packed.size(1) == k * kTileCols && scales.size(0) == tiles &&
                  scales.size(1) == k / kBlock && scales.size(2) == kTileCols && out.size(0) == x.size(0) &&
                  out.size(1) > (tiles - 1) * kTileCols && out.size(1) <= tiles * kTileCols,
              "shapes do not match: K must be a multiple of 32 and the packed width K * 16, N within the tiles");
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(out, x, packed, scales); break;
    case at::kBFloat16: run<c10::BFloat16>(out, x, packed, scales); break;
    case at::kHalf: run<c10::Half>(out, x, packed, scales); break;
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
