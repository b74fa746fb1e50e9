// What the column-tile kernels (q4_matmul.cpp, q8_matmul.cpp, bf16_matmul.cpp, f32_matmul.cpp) share: output
// columns in tiles of 16 with one 32-bit lane per column, an integer vector of W such lanes, loads and 4-byte
// broadcasts into it, the walk over x's rows in groups of four (each load of a tile serves all of them), and the
// tiles' split over threads. Every kernel source includes this after simd.h and ATen/Parallel.h, inside its own
// anonymous namespace.

#pragma once

constexpr int64_t kTileCols = 16;
constexpr int kVectors = kTileCols / W;  // vectors across a tile's columns (AVX512: 1, AVX2: 2)
constexpr int kRows = 4;

#if defined(__AVX512F__)
using vi = __m512i;
inline vi vi_load(const void* p) { return _mm512_loadu_si512(p); }
inline vi vi_zero() { return _mm512_setzero_si512(); }
inline vi broadcast4(const void* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}
#else
using vi = __m256i;
inline vi vi_load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vi vi_zero() { return _mm256_setzero_si256(); }
inline vi broadcast4(const void* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}
#endif

// fn.template operator()<R>(m) for rows m..m + R of `rows`, R = kRows until fewer are left, then the rest.
template <typename Fn>
inline void row_groups(int64_t rows, Fn&& fn) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows) fn.template operator()<kRows>(m);
  switch (rows - m) {
    case 3: fn.template operator()<3>(m); break;
    case 2: fn.template operator()<2>(m); break;
    case 1: fn.template operator()<1>(m); break;
    default: break;
  }
}

// Fewest weight bytes a thread takes: below it, waking another thread costs more than it saves.
constexpr int64_t kMinThreadBytes = 64 * 1024;

// fn.template operator()<R>(m, tile) for every tile of `tiles` (each `tile_bytes` of weight) and every group of
// x's `rows` (row_groups), the tiles split over torch's threads, at least kMinThreadBytes of weight to a thread.
template <typename Fn>
inline void for_each_tile(int64_t tiles, int64_t tile_bytes, int64_t rows, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, kMinThreadBytes / tile_bytes);
  at::parallel_for(0, tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t tile = lo; tile < hi; ++tile) {
      row_groups(rows, [&]<int R>(int64_t m) { fn.template operator()<R>(m, tile); });
    }
  });
}
