// Paged attention one query row at a time: a row's query heads sharing a KV head scored against each tile of
// keys, an online softmax per head. paged_decode.cpp includes this after its `Problem` and constants, inside
// its anonymous namespace; attention_lanes.h shares its bf16 value pairs.

#pragma once

// The online softmax of one row and one KV head's query heads: running max, sum and unnormalised output.
struct RowState {
  float m[kMaxGroup];
  float l[kMaxGroup];
  alignas(64) float acc[kMaxGroup][kMaxHeadDim];

  void reset(int64_t group, int64_t dim) {
    for (int64_t g = 0; g < group; ++g) {
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.0f;
      std::fill(acc[g], acc[g] + dim, 0.0f);
    }
  }
};

// Lane t of the result: the sum of the lanes of acc[t] (kTile accumulators, one per token).
inline void lane_sums(const vf* acc, float* out) {
#if defined(__AVX512F__)
  // A transposing add tree: 45 shuffles and adds for 16 sums, against ~8 per sum reduced one by one.
  vf quads[4];
  for (int q = 0; q < 4; ++q) {
    const vf* a = acc + 4 * q;
    vf s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    vf s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    quads[q] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  auto fold = [](vf x, vf y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  vstore(out, fold(fold(quads[0], quads[1]), fold(quads[2], quads[3])));
#else
  for (int t = 0; t < kTile; ++t) out[t] = vsum(acc[t]);
#endif
}

inline vf dot_lanes(const float* q, const float* k, int64_t dim) {
  vf acc = vzero();
  for (int64_t d = 0; d < dim; d += W) acc = vfma(vload(q + d), vload(k + d), acc);
  return acc;
}

#if defined(__AVX512BF16__)
// Pairs of bf16 products summed into fp32 lanes: the keys are never widened.
inline vf dot_lanes(const c10::BFloat16* q, const c10::BFloat16* k, int64_t dim) {
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  }
  if (d < dim) {  // head dims of 16 mod 32 (80, 48): the last 16 elements, the rest of the register zero
    const __mmask32 half = 0xFFFFu;
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(half, q + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(half, k + d));
  }
  return acc;
}
#endif

// Scores of `n` tokens from `k` against the row's query heads, into s[g][t] (scaled); `tile` is scratch.
template <typename T>
inline void score_tile(const Problem& p, const T* q, const float* qf, const T* k, int64_t n, float (*s)[kTile],
                       float (*tile)[kMaxHeadDim]) {
  const int64_t D = p.head_dim;
  vf acc[kTile];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t g = 0; g < p.group; ++g) {
      for (int64_t t = 0; t < kTile; ++t) acc[t] = t < n ? dot_lanes(q + g * D, k + t * p.k_token, D) : vzero();
      lane_sums(acc, s[g]);
      for (int t0 = 0; t0 < kTile; t0 += W) vstore(s[g] + t0, vmul(vload(s[g] + t0), vset(p.scale)));
    }
    return;
  }
#endif
  (void)q;
  const float* rows[kTile];
  for (int64_t t = 0; t < n; ++t) {
    if constexpr (std::is_same_v<T, float>) {
      rows[t] = k + t * p.k_token;
    } else {  // widened once, then dotted with every query head from L1
      for (int64_t d = 0; d < D; d += W) vstore(tile[t] + d, vload(k + t * p.k_token + d));
      rows[t] = tile[t];
    }
  }
  for (int64_t g = 0; g < p.group; ++g) {
    for (int64_t t = 0; t < kTile; ++t) acc[t] = t < n ? dot_lanes(qf + g * D, rows[t], D) : vzero();
    lane_sums(acc, s[g]);  // qf carries the scale
  }
}

// One tile's scores s[0..kTile) (-inf beyond its n tokens) folded into the running max m and sum l: s becomes
// the weights exp(s - m_new); returns the factor the accumulated values are rescaled by.
inline float softmax_tile(float* s, int64_t n, float& m, float& l) {
  float tile_max = s[0];
  for (int64_t t = 1; t < n; ++t) tile_max = std::max(tile_max, s[t]);
  const float m_new = std::max(m, tile_max);
  const float alpha = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
  float sum = 0.0f;
  for (int t0 = 0; t0 < kTile; t0 += W) {
    vf e = vexp(vsub(vload(s + t0), vset(m_new)));
    vstore(s + t0, e);
    sum += vsum(e);
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// acc = alpha * acc + sum over t < n of p[t] * rows[t]. Four vectors of the head at a time: a single
// accumulator would chain every token's FMA on the one before (latency-bound, ~3x slower).
inline void accumulate_values(float* acc, float alpha, const float* p, const float* const* rows, int64_t n,
                              int64_t dim) {
  const vf va = vset(alpha);
  int64_t d = 0;
  for (; d + 4 * W <= dim; d += 4 * W) {
    vf a0 = vmul(vload(acc + d), va), a1 = vmul(vload(acc + d + W), va);
    vf a2 = vmul(vload(acc + d + 2 * W), va), a3 = vmul(vload(acc + d + 3 * W), va);
    for (int64_t t = 0; t < n; ++t) {
      const vf pt = vset(p[t]);
      const float* r = rows[t] + d;
      a0 = vfma(pt, vload(r), a0);
      a1 = vfma(pt, vload(r + W), a1);
      a2 = vfma(pt, vload(r + 2 * W), a2);
      a3 = vfma(pt, vload(r + 3 * W), a3);
    }
    vstore(acc + d, a0);
    vstore(acc + d + W, a1);
    vstore(acc + d + 2 * W, a2);
    vstore(acc + d + 3 * W, a3);
  }
  for (; d < dim; d += W) {
    vf a = vmul(vload(acc + d), va);
    for (int64_t t = 0; t < n; ++t) a = vfma(vset(p[t]), vload(rows[t] + d), a);
    vstore(acc + d, a);
  }
}

#if defined(__AVX512BF16__)
constexpr int kChunks = kMaxHeadDim / 32;

// bf16 values of `n` tokens as token pairs: pair j, 32-element chunk c -> (lo, hi) at pairs[(j * kChunks + c) * 2],
// token 2j in the even 16-bit halves, 2j + 1 (or zero) in the odd ones. Each 128-bit lane L of lo holds
// elements 8L..8L+3 of the chunk, of hi 8L+4..8L+7: accumulators keep that order until `unpermute`.
inline void pair_values(const c10::BFloat16* v, int64_t token_stride, int64_t n, int64_t dim, __m512i* pairs) {
  for (int64_t j = 0; 2 * j < n; ++j) {
    const c10::BFloat16* a = v + 2 * j * token_stride;
    const bool has_b = 2 * j + 1 < n;
    for (int64_t c = 0, d = 0; d < dim; ++c, d += 32) {
      const __mmask32 m = dim - d >= 32 ? 0xFFFFFFFFu : (1u << (dim - d)) - 1;  // a 16-element tail
      const __m512i va = _mm512_maskz_loadu_epi16(m, a + d);
      const __m512i vb = has_b ? _mm512_maskz_loadu_epi16(m, a + token_stride + d) : _mm512_setzero_si512();
      pairs[(j * kChunks + c) * 2] = _mm512_unpacklo_epi16(va, vb);
      pairs[(j * kChunks + c) * 2 + 1] = _mm512_unpackhi_epi16(va, vb);
    }
  }
}

// acc (permuted, chunks cs..cs+NC) = alpha * acc + sum over token pairs of (p[2j], p[2j+1]) . pair j: bf16
// products summed in fp32, 2 * NC independent accumulators.
template <int NC>
inline void accumulate_pair_chunks(float* acc, vf va, const uint32_t* pp, int64_t npairs, const __m512i* pairs,
                                   int64_t cs) {
  vf a[2 * NC];
  for (int i = 0; i < 2 * NC; ++i) a[i] = vmul(vload(acc + 32 * cs + 16 * i), va);
  for (int64_t j = 0; j < npairs; ++j) {
    const __m512bh pj = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[j]));
    for (int i = 0; i < 2 * NC; ++i) a[i] = _mm512_dpbf16_ps(a[i], pj, (__m512bh)pairs[(j * kChunks + cs) * 2 + i]);
  }
  for (int i = 0; i < 2 * NC; ++i) vstore(acc + 32 * cs + 16 * i, a[i]);
}

// The weights p[0..kTile) (zero beyond the tile's tokens) as bf16 pairs, then acc += them . the value pairs.
inline void accumulate_pairs(float* acc, float alpha, const float* p, const __m512i* pairs, int64_t n, int64_t dim) {
  alignas(32) uint32_t pp[kTile / 2];
  _mm256_store_si256(reinterpret_cast<__m256i*>(pp), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p)));
  const vf va = vset(alpha);
  const int64_t chunks = (dim + 31) / 32, npairs = (n + 1) / 2;
  int64_t c = 0;
  for (; c + 4 <= chunks; c += 4) accumulate_pair_chunks<4>(acc, va, pp, npairs, pairs, c);
  switch (chunks - c) {
    case 3: accumulate_pair_chunks<3>(acc, va, pp, npairs, pairs, c); break;
    case 2: accumulate_pair_chunks<2>(acc, va, pp, npairs, pairs, c); break;
    case 1: accumulate_pair_chunks<1>(acc, va, pp, npairs, pairs, c); break;
    default: break;
  }
}

// `accumulate_pairs`' order back to the head's: lane 4L+k of a chunk's lo is element 8L+k, of its hi 8L+4+k.
inline void unpermute(float* acc, int64_t dim) {
  float tmp[32];
  for (int64_t d = 0; d < dim; d += 32) {
    for (int i = 0; i < 16; ++i) {
      tmp[8 * (i / 4) + i % 4] = acc[d + i];
      tmp[8 * (i / 4) + 4 + i % 4] = acc[d + 16 + i];
    }
    std::copy(tmp, tmp + std::min<int64_t>(32, dim - d), acc + d);
  }
}
#endif

// Folds keys lo..hi (positions of the sequence) of one KV head into `st` for the query heads `q`/`qf`.
template <typename T>
void attend_range(const Problem& p, const int32_t* table, int64_t head, const T* q, const float* qf,
                  int64_t lo, int64_t hi, RowState& st) {
  const int64_t D = p.head_dim, G = p.group;
  alignas(64) float s[kMaxGroup][kTile];
  alignas(64) float tile[kTile][kMaxHeadDim];  // widened keys, then widened values
#if defined(__AVX512BF16__)
  __m512i pairs[kTile / 2 * kChunks * 2];
#endif
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int64_t pos = lo; pos < hi;) {
    const int64_t block = table[pos / p.block_size], offset = pos % p.block_size;
    const int64_t n = std::min({hi - pos, p.block_size - offset, static_cast<int64_t>(kTile)});
    const T* k = kc + block * p.k_block + offset * p.k_token + head * p.k_head;
    const T* v = vc + block * p.v_block + offset * p.v_token + head * p.v_head;
    score_tile(p, q, qf, k, n, s, tile);
    if (p.softcap > 0) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < n; ++t) s[g][t] = p.softcap * std::tanh(s[g][t] / p.softcap);
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = n; t < kTile; ++t) s[g][t] = -std::numeric_limits<float>::infinity();
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // bf16 values stay bf16: weights rounded to bf16 and multiplied two tokens at a time.
      pair_values(v, p.v_token, n, D, pairs);
      for (int64_t g = 0; g < G; ++g) {
        const float alpha = softmax_tile(s[g], n, st.m[g], st.l[g]);
        accumulate_pairs(st.acc[g], alpha, s[g], pairs, n, D);
      }
      pos += n;
      continue;
    }
#endif
    // Values widened once per tile (fp32 caches are read where they lie).
    const float* vrow[kTile];
    for (int64_t t = 0; t < n; ++t) {
      const T* vtok = v + t * p.v_token;
      if constexpr (std::is_same_v<T, float>) {
        vrow[t] = vtok;
      } else {
        for (int64_t d = 0; d < D; d += W) vstore(tile[t] + d, vload(vtok + d));
        vrow[t] = tile[t];
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float alpha = softmax_tile(s[g], n, st.m[g], st.l[g]);
      accumulate_values(st.acc[g], alpha, s[g], vrow, n, D);
    }
    pos += n;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t g = 0; g < G; ++g) unpermute(st.acc[g], D);
  }
#endif
}
