// What the column-tile kernels (q4_matmul.cpp, q8_matmul.cpp, bf16_matmul.cpp) share: output columns in tiles of
// 16 with one 32-bit lane per column, an integer vector of W such lanes, loads and 4-byte broadcasts into it, and
// the walk over x's rows in groups of four (each load of a tile serves all of them). Every kernel source includes
// this after simd.h, inside its own anonymous namespace.

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
