// Prompt chunks of paged attention with 16 of their rows in the lanes of one AVX512 vector. paged_decode.cpp
// includes this after its `Problem`, `first_visible`, `store_row` and attention_rows.h (whose bf16 value pairs
// it shares), inside its anonymous namespace.
//
// A lane is a virtual row: one query token of a sequence's chunk and one of the query heads sharing a KV head.
// Queries are held transposed ([head dim][16 lanes]), so each key element is broadcast once and multiplied into
// all 16 rows' scores by one FMA: a tile of 16 keys costs head_dim x 16 FMAs and no horizontal sum. The online
// softmax runs across the lanes (running max, sum and rescale factor are one vector each), and the values are
// accumulated transposed the same way, each value element broadcast once into 16 rows. The row path
// (`attend_range`) reads a tile once per row and sums every score across a vector; it stays for decode rows,
// too few per KV head to fill the lanes.

#pragma once

#if defined(__AVX512F__)

constexpr int64_t kLanes = 16;

// One worker's buffers for `attend_lanes`, sized by the head dim.
struct LaneScratch {
  int64_t slots;  // accumulator rows: the head dim rounded up to whole 32-element chunks (bf16 pairs fill them)
  std::vector<float> qt, ot, keys, values;
  std::vector<uint32_t> query_pairs;
  std::vector<c10::BFloat16> key_rows;
  explicit LaneScratch(int64_t dim)
      : slots((dim + 31) / 32 * 32), qt(dim * kLanes), ot(slots * kLanes), keys(kTile * dim), values(kTile * dim),
        query_pairs(dim / 2 * kLanes), key_rows(kTile * dim) {}
};

// A tile's rows at one stride, every one of the kTile rows readable: rows read where they lie when the tile is
// whole and `widen` is off, else copied into `buf` (as fp32 when `widen`) with zero rows from n on.
template <bool widen, typename T, typename B>
inline const B* tile_rows(const T* src, int64_t token_stride, int64_t n, int64_t dim, B* buf, int64_t& stride) {
  if (!widen && n == kTile) {
    stride = token_stride;
    return reinterpret_cast<const B*>(src);
  }
  for (int64_t t = 0; t < kTile; ++t) {
    if constexpr (widen) {
      for (int64_t d = 0; d < dim; d += W) {
        vstore(buf + t * dim + d, t < n ? vload(src + t * token_stride + d) : vzero());
      }
    } else if (t < n) {
      std::memcpy(buf + t * dim, src + t * token_stride, dim * sizeof(T));
    } else {
      std::memset(buf + t * dim, 0, dim * sizeof(T));
    }
  }
  stride = dim;
  return buf;
}

// Whether a tile is scored with bf16 pairs (`_mm512_dpbf16_ps`) rather than widened to fp32.
template <typename T>
constexpr bool kPairs =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// s[t] = the lanes' scores against key t of the tile (queries scaled): each key element (fp32) or pair of
// elements (bf16) broadcast into one FMA over the 16 lanes.
template <typename T, typename P>
inline void score_lanes(const P& p, const T* k, int64_t n, LaneScratch& sc, vf* s) {
  const int64_t D = p.head_dim;
  // Accumulated in a local array and copied out at the end: accumulating into `s` itself made GCC store every
  // accumulator back to the stack after each FMA.
  vf acc[kTile];
  for (int t = 0; t < kTile; ++t) acc[t] = vzero();
  int64_t ks;
#if defined(__AVX512BF16__)
  if constexpr (kPairs<T>) {
    const uint32_t* keys =
        reinterpret_cast<const uint32_t*>(tile_rows<false>(k, p.k_token, n, D, sc.key_rows.data(), ks));
    ks /= 2;
    for (int64_t u = 0; u < D / 2; ++u) {
      const __m512bh qu = (__m512bh)_mm512_loadu_si512(sc.query_pairs.data() + u * kLanes);
      const uint32_t* ku = keys + u;
#pragma GCC unroll 16
      for (int t = 0; t < kTile; ++t) {
        acc[t] = _mm512_dpbf16_ps(acc[t], qu, (__m512bh)_mm512_set1_epi32(static_cast<int>(ku[t * ks])));
      }
    }
    for (int t = 0; t < kTile; ++t) s[t] = vmul(acc[t], vset(p.scale));
    return;
  }
#endif
  const float* keys = tile_rows<!std::is_same_v<T, float>>(k, p.k_token, n, D, sc.keys.data(), ks);
  for (int64_t d = 0; d < D; ++d) {
    const vf qd = vload(sc.qt.data() + d * kLanes);
    const float* kd = keys + d;
#pragma GCC unroll 16
    for (int t = 0; t < kTile; ++t) acc[t] = vfma(qd, vset(kd[t * ks]), acc[t]);
  }
  for (int t = 0; t < kTile; ++t) s[t] = acc[t];
}

// ot = alpha * ot + sum over the tile's n tokens of weights[t] x value t, 16 accumulator rows at a time in
// registers: fp32 values broadcast element by element, bf16 ones as (token 2j, token 2j + 1) pairs.
template <typename T, typename P>
inline void accumulate_lanes(const P& p, const T* v, int64_t n, vf alpha, float (*weights)[kLanes],
                             LaneScratch& sc) {
  const int64_t D = p.head_dim;
  float* ot = sc.ot.data();
#if defined(__AVX512BF16__)
  if constexpr (kPairs<T>) {
    __m512i pairs[kTile / 2 * kChunks * 2];
    pair_values(v, p.v_token, n, D, pairs);
    const int64_t npairs = (n + 1) / 2, chunks = sc.slots / 32;
    __m512i wp[kTile / 2];
    for (int64_t j = 0; j < npairs; ++j) {
      const __m512i even = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(weights[2 * j])));
      const __m512i odd = 2 * j + 1 < n
          ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(weights[2 * j + 1])))
          : _mm512_setzero_si512();
      wp[j] = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
    }
    // pair_values lays pair j's chunk c out as two vectors of 16 slots at (j * kChunks + c) * 2.
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t h = 0; h < 2; ++h) {
        float* acc = ot + (32 * c + 16 * h) * kLanes;
        vf o[kLanes];
        for (int i = 0; i < kLanes; ++i) o[i] = vmul(vload(acc + i * kLanes), alpha);
        for (int64_t j = 0; j < npairs; ++j) {
          const uint32_t* vj = reinterpret_cast<const uint32_t*>(pairs + (j * kChunks + c) * 2 + h);
#pragma GCC unroll 16
          for (int i = 0; i < kLanes; ++i) {
            o[i] = _mm512_dpbf16_ps(o[i], (__m512bh)wp[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(vj[i])));
          }
        }
        for (int i = 0; i < kLanes; ++i) vstore(acc + i * kLanes, o[i]);
      }
    }
    return;
  }
#endif
  int64_t vs;
  const float* values = tile_rows<!std::is_same_v<T, float>>(v, p.v_token, n, D, sc.values.data(), vs);
  for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
    vf o[kLanes];
    for (int j = 0; j < kLanes; ++j) o[j] = vmul(vload(ot + (d0 + j) * kLanes), alpha);
    for (int64_t t = 0; t < n; ++t) {
      const vf w = _mm512_load_ps(weights[t]);
      const float* vd = values + t * vs + d0;
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) o[j] = vfma(w, vset(vd[j]), o[j]);
    }
    for (int j = 0; j < kLanes; ++j) vstore(ot + (d0 + j) * kLanes, o[j]);
  }
}

// Lanes v0..v0+count of an item (sequence `seq`'s chunk, KV head `head`, keys item_lo..item_hi, token rows from
// `r0`): lane j is virtual row v = v0 + j, the chunk's token v / G and query head v % G of the KV head. Each lane
// folds in only the keys its row may see. With `partial` null the rows are normalised into the output, else
// written as (max, sum, unnormalised row) at partial + (v - r0 * G) * (D + 2) for the split merge.
template <typename T, typename P>
void attend_lanes(const P& p, int64_t seq, int64_t head, int64_t item_lo, int64_t item_hi, int64_t r0, int64_t v0,
                  int64_t count, float* partial, LaneScratch& sc) {
  const int64_t D = p.head_dim, G = p.group;
  const int64_t q_start = p.query_start_loc[seq], q_len = p.query_start_loc[seq + 1] - q_start;
  const int64_t seq_len = p.seq_lens[seq];
  const int32_t* table = p.block_tables + seq * p.table_stride;
  alignas(64) int32_t lo[kLanes], hi[kLanes];
  int64_t block_lo = std::numeric_limits<int64_t>::max(), block_hi = 0;
  for (int64_t j = 0; j < kLanes; ++j) {
    lo[j] = hi[j] = 0;
    const T* q = nullptr;
    if (j < count) {
      const int64_t v = v0 + j, r = v / G, i = seq_len - q_len + r;
      lo[j] = static_cast<int32_t>(std::max(first_visible(p, i), item_lo));
      hi[j] = static_cast<int32_t>(std::min(i + 1, item_hi));
      if (lo[j] < hi[j]) {
        block_lo = std::min<int64_t>(block_lo, lo[j]);
        block_hi = std::max<int64_t>(block_hi, hi[j]);
      }
      q = static_cast<const T*>(p.query) + ((q_start + r) * p.kv_heads * G + head * G + v % G) * D;
    }
    // The queries transposed: fp32 scaled, or bf16 pairs as they are (the scores are scaled after).
    if constexpr (kPairs<T>) {
      for (int64_t u = 0; u < D / 2; ++u) {
        uint32_t pair = 0;
        if (q) std::memcpy(&pair, q + 2 * u, 4);
        sc.query_pairs[u * kLanes + j] = pair;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) sc.qt[d * kLanes + j] = q ? to_float(q[d]) * p.scale : 0.0f;
    }
  }
  std::fill(sc.ot.begin(), sc.ot.end(), 0.0f);
  const vf neg_inf = vset(-std::numeric_limits<float>::infinity());
  vf m = neg_inf, l = vzero();
  const __m512i lanes_lo = _mm512_load_si512(lo), lanes_hi = _mm512_load_si512(hi);
  alignas(64) float weights[kTile][kLanes];
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int64_t pos = block_lo; pos < block_hi;) {
    const int64_t block = table[pos / p.block_size], offset = pos % p.block_size;
    const int64_t n = std::min({block_hi - pos, p.block_size - offset, static_cast<int64_t>(kTile)});
    vf s[kTile];
    score_lanes(p, kc + block * p.k_block + offset * p.k_token + head * p.k_head, n, sc, s);
    if (p.softcap > 0) {
      alignas(64) float raw[kLanes];
      for (int t = 0; t < n; ++t) {
        vstore(raw, s[t]);
        for (int64_t j = 0; j < kLanes; ++j) raw[j] = p.softcap * std::tanh(raw[j] / p.softcap);
        s[t] = _mm512_load_ps(raw);
      }
    }
    // Each lane's own causal end, window and chunk: the keys it may not see score -inf.
    vf tile_max = neg_inf;
    for (int t = 0; t < kTile; ++t) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(pos + t));
      const __mmask16 visible = t < n ? _mm512_cmple_epi32_mask(lanes_lo, key) & _mm512_cmplt_epi32_mask(key, lanes_hi)
                                      : __mmask16(0);
      s[t] = _mm512_mask_mov_ps(neg_inf, visible, s[t]);
      tile_max = _mm512_max_ps(tile_max, s[t]);
    }
    const vf m_new = _mm512_max_ps(m, tile_max);
    // Lanes that have seen no key yet subtract 0 instead of -inf: their weights and rescale are exp(-inf) = 0.
    const vf shift = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_new, neg_inf, _CMP_NEQ_OQ), m_new);
    const vf alpha = vexp(vsub(m, shift));
    vf sum = vzero();
    for (int t = 0; t < n; ++t) {
      const vf e = vexp(vsub(s[t], shift));
      _mm512_store_ps(weights[t], e);
      sum = vadd(sum, e);
    }
    l = vfma(l, alpha, sum);
    m = m_new;
    accumulate_lanes(p, vc + block * p.v_block + offset * p.v_token + head * p.v_head, n, alpha, weights, sc);
    pos += n;
  }
  alignas(64) float lane_m[kLanes], lane_l[kLanes];
  vstore(lane_m, m);
  vstore(lane_l, l);
  const float* ot = sc.ot.data();
  for (int64_t j = 0; j < count; ++j) {
    const int64_t v = v0 + j, r = v / G, g = v % G;
    float row[kMaxHeadDim];
    for (int64_t slot = 0; slot < sc.slots; ++slot) row[slot] = ot[slot * kLanes + j];
#if defined(__AVX512BF16__)
    if constexpr (kPairs<T>) unpermute(row, D);  // bf16 pairs accumulate in `pair_values`' order
#endif
    if (partial == nullptr) {
      float total = lane_l[j];
      if (p.sinks) total += std::exp(p.sinks[head * G + g] - lane_m[j]);
      store_row(static_cast<T*>(p.out) + ((q_start + r) * p.kv_heads * G + head * G + g) * D, row, D, 1.0f / total);
    } else {
      float* dst = partial + (v - r0 * G) * (D + 2);
      dst[0] = lane_m[j];
      dst[1] = lane_l[j];
      std::copy(row, row + D, dst + 2);
    }
  }
}

#endif
