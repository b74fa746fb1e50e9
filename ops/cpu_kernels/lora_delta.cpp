// The LoRA delta of a flat batch of rows that each name an adapter slot, in one call per linear.
//
// Row t with slot s >= 0 gets out[t] += B_s (A_s x[t]), where the stacks hold A as [slots, R, in] and B
// transposed, as [slots, R, out], the adapter's scale already in B. Rows are grouped by slot, up to four
// at a time, so every load of A or B serves the whole group. The shrink is R dot products of each row
// with A_s's rows (bf16 pairs dotted without widening where the CPU has AVX512-BF16); the expand adds
// h[k] * B_s[k] for every k, 16 (or 8) outputs a vector, so no horizontal sums. A merged linear (q/k/v, gate/up) packs one adapter pair per section, each on its own
// R / sections ranks and its own output rows: the expand reads only each section's own block of B,
// never the zeros around it, and skips ranks whose h is zero (an adapter of lower rank than the stack).
// Everything accumulates in fp32; the output is rounded once.
//
// Built once per ISA variant with paged_decode.cpp (ops/cpu_kernels/isa.py names the flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

#include "simd.h"

// Fewest multiply-adds a thread takes: below it, a parallel region costs more than it saves.
constexpr int64_t kGrainMacs = 1 << 16;
// Rows of one slot computed together: each load of A and B serves all of them.
constexpr int kRows = 4;

struct Stacks {
  int64_t in, out, rank, sections;
  int64_t x_stride, out_stride;
  const int64_t* section_starts;  // sections + 1 output offsets
};

// h[r][k] = A[k] . x[r] for the group's NR rows and every k < rank, four ranks at a time.
template <int NR, typename T>
void shrink(const Stacks& p, const T* a, const T* const* x, float (*h)[kRows]) {
  const int64_t n = p.in;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Pairs of bf16 products summed into fp32 lanes, 32 inputs an instruction, nothing widened; the last
    // partial chunk read under a mask.
    for (int64_t k = 0; k < p.rank; k += 4) {
      const int kn = static_cast<int>(std::min<int64_t>(4, p.rank - k));
      __m512 acc[4][NR];
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 32) {
        const __mmask32 m = n - i >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (n - i)) - 1);
        __m512bh xv[NR];
        for (int r = 0; r < NR; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, x[r] + i);
        for (int j = 0; j < kn; ++j) {
          const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, a + (k + j) * n + i);
          for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], av, xv[r]);
        }
      }
      for (int j = 0; j < kn; ++j)
        for (int r = 0; r < NR; ++r) h[k + j][r] = _mm512_reduce_add_ps(acc[j][r]);
    }
    return;
  }
#endif
  const int64_t full = n / W * W;
  for (int64_t k = 0; k < p.rank; k += 4) {
    const int kn = static_cast<int>(std::min<int64_t>(4, p.rank - k));
    vf acc[4][NR];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < NR; ++r) acc[j][r] = vzero();
    for (int64_t i = 0; i < full; i += W) {
      vf xv[NR];
      for (int r = 0; r < NR; ++r) xv[r] = vload(x[r] + i);
      for (int j = 0; j < kn; ++j) {
        const vf av = vload(a + (k + j) * n + i);
        for (int r = 0; r < NR; ++r) acc[j][r] = vfma(av, xv[r], acc[j][r]);
      }
    }
    for (int j = 0; j < kn; ++j) {
      for (int r = 0; r < NR; ++r) {
        float sum = vsum(acc[j][r]);
        for (int64_t i = full; i < n; ++i) sum += static_cast<float>(a[(k + j) * n + i]) * static_cast<float>(x[r][i]);
        h[k + j][r] = sum;
      }
    }
  }
}

// out[r][o] += sum over the section's non-zero ranks k of h[k][r] * B[k, o], for each section's outputs.
template <int NR, typename T>
void expand(const Stacks& p, const T* b, const float (*h)[kRows], T* const* out, int64_t* ranks) {
  const int64_t per_section = p.rank / p.sections;
  for (int64_t s = 0; s < p.sections; ++s) {
    int64_t used = 0;
    for (int64_t k = s * per_section; k < (s + 1) * per_section; ++k) {
      bool any = false;
      for (int r = 0; r < NR; ++r) any |= h[k][r] != 0.0f;
      if (any) ranks[used++] = k;
    }
    if (used == 0) continue;
    const int64_t lo = p.section_starts[s], hi = p.section_starts[s + 1];
    int64_t o = lo;
    for (; o + W <= hi; o += W) {
      vf acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = vload(out[r] + o);
      for (int64_t j = 0; j < used; ++j) {
        const vf bv = vload(b + ranks[j] * p.out + o);
        for (int r = 0; r < NR; ++r) acc[r] = vfma(vset(h[ranks[j]][r]), bv, acc[r]);
      }
      for (int r = 0; r < NR; ++r) vstore(out[r] + o, acc[r]);
    }
    for (; o < hi; ++o) {
      for (int r = 0; r < NR; ++r) {
        float acc = static_cast<float>(out[r][o]);
        for (int64_t j = 0; j < used; ++j) acc += h[ranks[j]][r] * static_cast<float>(b[ranks[j] * p.out + o]);
        out[r][o] = static_cast<T>(acc);
      }
    }
  }
}

// Up to kRows rows that share a slot.
struct Group {
  int64_t slot, first, count;  // rows order[first .. first + count)
};

template <int NR, typename T>
void run_group(const Stacks& p, const Group& g, const int64_t* order, T* out, const T* x, const T* a, const T* b,
               float (*h)[kRows], int64_t* ranks) {
  const T* xs[NR];
  T* outs[NR];
  for (int r = 0; r < NR; ++r) {
    xs[r] = x + order[g.first + r] * p.x_stride;
    outs[r] = out + order[g.first + r] * p.out_stride;
  }
  shrink<NR>(p, a + g.slot * p.rank * p.in, xs, h);
  expand<NR>(p, b + g.slot * p.rank * p.out, h, outs, ranks);
}

template <typename T>
void run(const Stacks& p, T* out, const T* x, const T* a, const T* b, const int32_t* slots, int64_t rows,
         int64_t num_slots) {
  // The adapted rows by slot (a counting sort), cut into groups of up to kRows.
  std::vector<int64_t> counts(num_slots + 1, 0), order;
  for (int64_t t = 0; t < rows; ++t) {
    if (slots[t] >= 0) ++counts[slots[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) counts[s + 1] += counts[s];
  order.resize(counts[num_slots]);
  std::vector<int64_t> fill(counts.begin(), counts.end() - 1);
  for (int64_t t = 0; t < rows; ++t) {
    if (slots[t] >= 0) order[fill[slots[t]]++] = t;
  }
  std::vector<Group> groups;
  for (int64_t s = 0; s < num_slots; ++s) {
    for (int64_t first = counts[s]; first < counts[s + 1]; first += kRows) {
      groups.push_back({s, first, std::min<int64_t>(kRows, counts[s + 1] - first)});
    }
  }
  const int64_t per_section = p.rank / p.sections;
  const int64_t macs = kRows * (p.rank * p.in + per_section * p.out);
  const int64_t grain = std::max<int64_t>(1, kGrainMacs / std::max<int64_t>(macs, 1));
  at::parallel_for(0, static_cast<int64_t>(groups.size()), grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> h_store(p.rank * kRows);
    auto* h = reinterpret_cast<float (*)[kRows]>(h_store.data());
    std::vector<int64_t> ranks(per_section);
    for (int64_t i = lo; i < hi; ++i) {
      const Group& g = groups[i];
      switch (g.count) {
        case 4: run_group<4>(p, g, order.data(), out, x, a, b, h, ranks.data()); break;
        case 3: run_group<3>(p, g, order.data(), out, x, a, b, h, ranks.data()); break;
        case 2: run_group<2>(p, g, order.data(), out, x, a, b, h, ranks.data()); break;
        default: run_group<1>(p, g, order.data(), out, x, a, b, h, ranks.data()); break;
      }
    }
  });
}

void lora_delta(const at::Tensor& out, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& slot_ids, c10::IntArrayRef output_sizes) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
              "out [T, out], x [T, in], lora_a [slots, R, in], lora_b [slots, R, out]");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && lora_a.is_contiguous() && lora_b.is_contiguous(),
              "rows of out and x, and both stacks, must be contiguous");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && lora_a.scalar_type() == out.scalar_type() &&
                  lora_b.scalar_type() == out.scalar_type(),
              "out, x and the stacks must share a dtype");
  TORCH_CHECK(slot_ids.scalar_type() == at::kInt && slot_ids.is_contiguous() && slot_ids.numel() == x.size(0) &&
                  out.size(0) == x.size(0),
              "slot_ids must be contiguous int32, one per row of x and out");
  const int64_t rank = lora_a.size(1), sections = static_cast<int64_t>(output_sizes.size());
  TORCH_CHECK(lora_a.size(2) == x.size(1) && lora_b.size(1) == rank && lora_b.size(2) == out.size(1) &&
                  lora_b.size(0) == lora_a.size(0),
              "the stacks do not match x and out");
  TORCH_CHECK(sections > 0 && rank % sections == 0, "the rank must split evenly over the output sections");
  std::vector<int64_t> starts(sections + 1, 0);
  for (int64_t s = 0; s < sections; ++s) starts[s + 1] = starts[s] + output_sizes[s];
  TORCH_CHECK(starts[sections] == out.size(1), "output_sizes must add up to out's width");
  const int32_t* slots = slot_ids.data_ptr<int32_t>();
  for (int64_t t = 0; t < slot_ids.numel(); ++t) {
    TORCH_CHECK(slots[t] < lora_a.size(0), "slot ", slots[t], " is outside the stack of ", lora_a.size(0));
  }
  const Stacks p{x.size(1), out.size(1), rank, sections, x.stride(0), out.stride(0), starts.data()};
  switch (out.scalar_type()) {
    case at::kFloat:
      run(p, out.data_ptr<float>(), x.data_ptr<float>(), lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), slots,
          x.size(0), lora_a.size(0));
      break;
    case at::kBFloat16:
      run(p, out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), lora_a.data_ptr<c10::BFloat16>(),
          lora_b.data_ptr<c10::BFloat16>(), slots, x.size(0), lora_a.size(0));
      break;
    case at::kHalf:
      run(p, out.data_ptr<c10::Half>(), x.data_ptr<c10::Half>(), lora_a.data_ptr<c10::Half>(),
          lora_b.data_ptr<c10::Half>(), slots, x.size(0), lora_a.size(0));
      break;
    default: TORCH_CHECK(false, "unsupported dtype ", out.scalar_type());
  }
}

}  // namespace

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_LORA_OP "lora_delta_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def(FASTGEN_LORA_OP "(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor slot_ids, int[] output_sizes) -> ()");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_LORA_OP, &lora_delta); }
