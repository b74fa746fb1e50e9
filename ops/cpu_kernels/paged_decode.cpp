// Paged attention of a step's queries (decode rows, verification rows, prompt chunks) over the blocked KV
// cache, read in place, after writing the step's K/V into that cache.
//
// One call serves every sequence of a step, and is all a layer of a decode step runs: the Python around a
// separate KV write (two index_put_ calls) and a zeroed output cost as much as the attention of a short
// context (SmolLM2-135M, batch 1, ~300 tokens: ~20 us each).
//
// Work items are (sequence, KV head, key split, rows). Rows of few-token queries (decode) are attended one at a
// time: an item scores each tile of its keys (at most 16 tokens of one block) against all the query heads
// sharing that KV head, then folds the tile into an online softmax kept in fp32. Queries whose tokens x query
// heads per KV head fill a 16-lane vector (prompt chunks) are attended 16 virtual rows at a time on AVX512
// (attention_lanes.h): 1.3-2x the rows' rate (prompt chunks of SmolLM2-135M's shape, 2-core EPYC). A sequence
// whose keys are split over several items (long contexts, few sequences: enough items to keep every core busy)
// gets its partial results merged through their log-sum-exps, as in flash-decoding. Only the slots a row may
// see are ever read, so whatever stale or NaN values lie beyond them never reach a result.
//
// Built once per ISA variant (ops/cpu_kernels/isa.py names the flags); FASTGEN_ISA names the op.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 16;       // tokens scored per softmax update
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxHeadDim = 512;
constexpr int64_t kMinSplit = 256;  // fewest keys an item takes when a sequence is split
// Fewer keys x KV heads than this in a step: one thread. Above it a second thread pays (2-core EPYC, 9 query heads
// on 3 KV heads of 64, 350 keys: 23 against 16-19 us a call; ~250 keys about even).
constexpr int64_t kParallelMin = 768;

#include "simd.h"

// Everything an item needs to find its rows, keys and outputs. Strides are in elements.
struct Problem {
  const void* query;  // [T, Hq, D], contiguous
  const void* k_cache;
  const void* v_cache;
  void* out;  // [T, Hq, D], contiguous
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const float* sinks;  // [Hq] or nullptr
  int64_t table_stride, block_size, kv_heads, group, head_dim;
  int64_t k_block, k_token, k_head, v_block, v_token, v_head;
  float scale, softcap;
  int64_t window, chunk;
};

// First key position query position `i` may see (causal end is i itself).
inline int64_t first_visible(const Problem& p, int64_t i) {
  int64_t lo = 0;
  if (p.window > 0) lo = std::max<int64_t>(0, i + 1 - p.window);
  if (p.chunk > 0) lo = std::max(lo, i / p.chunk * p.chunk);
  return lo;
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n, float norm) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d] * norm);
}

#include "attention_rows.h"
#include "attention_lanes.h"

// One sequence and KV head's share of keys lo..hi, for its query token rows r0..r1.
struct Item {
  int64_t seq, head, lo, hi, split, splits, r0, r1;
  int64_t partial;  // offset of its partial results when splits > 1
  int64_t cost;
  bool lanes;  // rows attended 16 virtual rows at a time (`attend_lanes`)
};

template <typename T>
void run_rows(const Problem& p, const Item& it, float* partials) {
  const int64_t D = p.head_dim, G = p.group;
  const int64_t q_start = p.query_start_loc[it.seq], q_len = p.query_start_loc[it.seq + 1] - q_start;
  const int64_t seq_len = p.seq_lens[it.seq];
  const int32_t* table = p.block_tables + it.seq * p.table_stride;
  RowState st;
  alignas(64) float qf[kMaxGroup * kMaxHeadDim];
  for (int64_t r = it.r0; r < it.r1; ++r) {
    const int64_t i = seq_len - q_len + r;
    const int64_t token = q_start + r;
    const T* q = static_cast<const T*>(p.query) + (token * p.kv_heads * G + it.head * G) * D;
    for (int64_t j = 0; j < G * D; ++j) qf[j] = to_float(q[j]) * p.scale;
    st.reset(G, (D + 31) / 32 * 32);  // `accumulate_pairs` works in whole 32-element chunks
    const int64_t lo = std::max(first_visible(p, i), it.lo), hi = std::min(i + 1, it.hi);
    if (lo < hi) attend_range(p, table, it.head, q, qf, lo, hi, st);
    if (it.splits == 1) {
      T* o = static_cast<T*>(p.out) + (token * p.kv_heads * G + it.head * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        float total = st.l[g];
        if (p.sinks) total += std::exp(p.sinks[it.head * G + g] - st.m[g]);
        store_row(o + g * D, st.acc[g], D, 1.0f / total);
      }
    } else {
      float* dst = partials + it.partial + (r - it.r0) * G * (D + 2);
      for (int64_t g = 0; g < G; ++g) {
        dst[g * (D + 2)] = st.m[g];
        dst[g * (D + 2) + 1] = st.l[g];
        std::copy(st.acc[g], st.acc[g] + D, dst + g * (D + 2) + 2);
      }
    }
  }
}

// The split items of one sequence, KV head and rows (consecutive in `items`) merged into the output.
template <typename T>
void merge_splits(const Problem& p, const Item* first, const float* partials) {
  const int64_t D = p.head_dim, G = p.group, splits = first->splits;
  const int64_t q_start = p.query_start_loc[first->seq];
  std::vector<float> acc(D);
  for (int64_t r = first->r0; r < first->r1; ++r) {
    T* o = static_cast<T*>(p.out) + ((q_start + r) * p.kv_heads * G + first->head * G) * D;
    const int64_t row = (r - first->r0) * G * (D + 2);
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < splits; ++k) m = std::max(m, partials[first[k].partial + row + g * (D + 2)]);
      float total = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < splits; ++k) {
        const float* part = partials + first[k].partial + row + g * (D + 2);
        if (part[1] == 0.0f) continue;  // a split holding none of this row's keys
        const float w = std::exp(part[0] - m);
        total += part[1] * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += part[2 + d] * w;
      }
      if (p.sinks) total += std::exp(p.sinks[first->head * G + g] - m);
      store_row(o + g * D, acc.data(), D, 1.0f / total);
    }
  }
}

// Token rows per item of a chunk attended in lanes: whole vectors of virtual rows (rows x G a multiple of 16),
// about 64 virtual rows, so a chunk's items balance over the threads.
inline int64_t lane_item_rows(int64_t group) {
  int64_t rows = 1;
  while (rows * group % 16 != 0) ++rows;
  return rows * std::max<int64_t>(1, 64 / (rows * group));
}

template <typename T>
void run(const Problem& p, int64_t num_seqs, int64_t num_tokens, int64_t max_query_len) {
  // Items of every sequence with 1..max_query_len query tokens; longer chunks are the caller's.
  std::vector<int64_t> spans(num_seqs, 0), starts(num_seqs, 0);
  std::vector<uint8_t> attended(num_tokens, 0);
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_start = p.query_start_loc[s], q_len = p.query_start_loc[s + 1] - q_start;
    const int64_t seq_len = p.seq_lens[s];
    if (seq_len <= 0 || q_len <= 0 || q_len > max_query_len) continue;
    TORCH_CHECK(q_start >= 0 && q_start + q_len <= num_tokens && q_len <= seq_len, "sequence ", s,
                ": query tokens ", q_start, "..", q_start + q_len, " do not fit ", num_tokens, " tokens and seq_len ",
                seq_len);
    std::fill(attended.begin() + q_start, attended.begin() + q_start + q_len, 1);
    starts[s] = first_visible(p, seq_len - q_len);
    spans[s] = seq_len - starts[s];
    total += spans[s] * q_len * p.kv_heads;
  }
  // The output is new: rows of no sequence here (padding, longer chunks) are zeros, as the op's contract says.
  const int64_t row = p.kv_heads * p.group * p.head_dim;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (!attended[t]) std::fill_n(static_cast<T*>(p.out) + t * row, row, T(0));
  }
  // Enough items for every thread to take several, each long enough to pay for its merge.
  const int64_t threads = at::get_num_threads();
  const int64_t split_len = std::max(kMinSplit, (total + 4 * threads - 1) / (4 * threads));
  std::vector<Item> items;
  int64_t partial_floats = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (spans[s] == 0) continue;
    const int64_t q_len = p.query_start_loc[s + 1] - p.query_start_loc[s], seq_len = p.seq_lens[s];
    const int64_t splits = (spans[s] + split_len - 1) / split_len;
    const int64_t step = (spans[s] + splits - 1) / splits;
#if defined(__AVX512F__)
    const bool lanes = q_len * p.group >= kLanes;
#else
    const bool lanes = false;
#endif
    const int64_t item_rows = lanes ? lane_item_rows(p.group) : q_len;
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t r0 = 0; r0 < q_len; r0 += item_rows) {
        const int64_t r1 = std::min(q_len, r0 + item_rows);
        const int64_t middle = seq_len - q_len + (r0 + r1) / 2;  // the rows' causal ends, on average
        for (int64_t k = 0; k < splits; ++k) {
          const int64_t lo = starts[s] + k * step, hi = std::min(starts[s] + spans[s], lo + step);
          const int64_t cost = (r1 - r0) * std::max<int64_t>(1, std::min(hi, middle + 1) - lo);
          items.push_back({s, h, lo, hi, k, splits, r0, r1, partial_floats, cost, lanes});
          if (splits > 1) partial_floats += (r1 - r0) * p.group * (p.head_dim + 2);
        }
      }
    }
  }
  if (items.empty()) return;
  std::vector<float> partials(partial_floats);
  // Longest first, taken one at a time by whichever thread is free: ragged lengths stay balanced.
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
#if defined(__AVX512F__)
    std::optional<LaneScratch> scratch;
#endif
    for (int64_t i = next++; i < static_cast<int64_t>(order.size()); i = next++) {
      const Item& it = items[order[i]];
      if (!it.lanes) {
        run_rows<T>(p, it, partials.data());
        continue;
      }
#if defined(__AVX512F__)
      if (!scratch) scratch.emplace(p.head_dim);
      float* partial = it.splits > 1 ? partials.data() + it.partial : nullptr;
      for (int64_t v = it.r0 * p.group; v < it.r1 * p.group; v += kLanes) {
        attend_lanes<T>(p, it.seq, it.head, it.lo, it.hi, it.r0, v, std::min(kLanes, it.r1 * p.group - v), partial,
                        *scratch);
      }
#endif
    }
  };
  // A step this small is done before a parallel region would have started its threads.
  const int64_t workers = total < kParallelMin ? 1 : std::min<int64_t>(threads, static_cast<int64_t>(items.size()));
  if (workers == 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, workers, 1, work);
  }
  std::vector<int64_t> merges;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].splits > 1 && items[i].split == 0) merges.push_back(static_cast<int64_t>(i));
  }
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) merge_splits<T>(p, &items[merges[i]], partials.data());
  });
}

// Whether the kernel takes these tensors: else the op returns no tensor, touching nothing, and the caller's
// torch path answers (any block size, window, softcap, sinks and attention chunk are the kernel's own flags).
bool serves(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const auto dtype = query.scalar_type();
  const int64_t kv_heads = k_cache.size(2), D = k_cache.size(3);
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && query.dim() == 3 &&
         k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && v_cache.sizes() == k_cache.sizes() &&
         query.size(2) == D && D % 16 == 0 && D <= kMaxHeadDim && query.size(1) % kv_heads == 0 &&
         query.size(1) / kv_heads <= kMaxGroup && k_cache.stride(3) == 1 && v_cache.stride(3) == 1;
}

// rows[t] (`[T, kv_heads, head_dim]`) copied to slot slots[t] of `cache` (`[num_blocks, block_size, kv_heads,
// head_dim]` by shape, any strides with whole head vectors), as bytes: any dtype; slot -1 is skipped.
void write_rows(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots) {
  const at::Tensor src_rows = rows.to(cache.scalar_type());
  const at::Tensor r = src_rows.stride(2) == 1 ? src_rows : src_rows.contiguous();
  const int64_t size = cache.element_size(), bytes = cache.size(3) * size, block_size = cache.size(1);
  const char* src = static_cast<const char*>(r.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < r.size(0); ++t) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < cache.size(2); ++h) {
      std::memcpy(dst + (block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2)) * size,
                  src + (t * r.stride(0) + h * r.stride(1)) * size, bytes);
    }
  }
}

// The op: every token's K/V written to its slot before any sequence attends (a sequence admitted with a
// prefix-cache hit may read blocks another sequence of the same step fills), then the rows of every
// sequence with 1..max_query_len query tokens attended into a new output, zeros in every other row.
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        double scale, int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks,
                        int64_t attention_chunk, int64_t max_query_len) {
  if (!serves(query, k_cache, v_cache)) return {};
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "metadata must be contiguous int32");
  const int64_t num_tokens = query.size(0), kv_heads = k_cache.size(2), D = k_cache.size(3);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == num_tokens, "slot_mapping must hold one slot per query token");
  for (const at::Tensor* rows : {&key, &value}) {
    TORCH_CHECK(rows->dim() == 3 && rows->size(0) == num_tokens && rows->size(1) == kv_heads && rows->size(2) == D,
                "key and value must be [T, num_kv_heads, head_dim] as the cache");
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] < capacity, "slot ", slot[t], " is beyond the cache's ", capacity);
  }
  write_rows(key, k_cache, slot);
  write_rows(value, v_cache, slot);
  std::optional<at::Tensor> sinks_f;
  if (sinks.has_value()) {
    sinks_f = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sinks_f->numel() == query.size(1), "sinks must hold one logit per query head");
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  Problem p{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
            sinks_f.has_value() ? sinks_f->data_ptr<float>() : nullptr,
            block_tables.stride(0), k_cache.size(1), kv_heads, query.size(1) / kv_heads, D,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), static_cast<float>(scale), static_cast<float>(softcap), sliding_window,
            attention_chunk};
  const int64_t num_seqs = seq_lens.size(0);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(p, num_seqs, num_tokens, max_query_len); break;
    case at::kBFloat16: run<c10::BFloat16>(p, num_seqs, num_tokens, max_query_len); break;
    default: run<c10::Half>(p, num_seqs, num_tokens, max_query_len); break;
  }
  return out;
}

}  // namespace

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_OP "paged_decode_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  // fastgen::paged_attention's arguments, and the longest query it attends; no tensor where `serves` says no.
  m.def(FASTGEN_OP
        "(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, "
        "float softcap, Tensor? sinks, int attention_chunk, int max_query_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_OP, &paged_decode); }
