// Integer dot products shared by the quantized-weight kernels (q8_matmul.cpp, q4_matmul.cpp): u8 x s8 products
// summed in fours into int32 lanes. Every kernel source includes this inside its own anonymous namespace.

#pragma once

// acc + the sums of four products u[i] * s[i] per int32 lane: one VNNI instruction where the build has it,
// else AVX2's maddubs (pairs into int16, which saturates: callers keep 2 * max(u) * 128 below 2^15) and madd.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512BW__)
inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
#endif
