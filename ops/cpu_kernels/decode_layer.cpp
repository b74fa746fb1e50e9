// One pre-norm decoder layer (RMSNorm, merged q/k/v with its optional bias and per-head q/k RMSNorms, rotary,
// paged attention, output projection, residual, RMSNorm, merged gate/up, SiLU-and-mul, down projection,
// residual) as one call, for steps of few rows.
//
// At batch 1 a layer's kernels take ~130 us and the compiled graph that calls them as much again in Python: its
// guards, its size arguments and Inductor's wrapper (2-core EPYC, SmolLM2-135M int4: 300 us a layer, 30 layers a
// token). Here the same kernels (q4_matmul / q8_matmul / bf16_matmul / f32_matmul for the linears, paged_decode
// for the attention and its KV write) are called from C++ through torch's dispatcher, and the glue between them
// is plain loops. Each rounding to the activations' dtype happens where the layer's torch forward rounds
// (RMSNorm's cast before its weight, the rotary's products and sum, SiLU before the product), so the result is
// the eager layer's to within the order of fp32 sums.
//
// Linear "kinds": a positive kind is an int4 linear of that group size (packed, scales_zeros), 0 a Q8_0 one
// (values, scales), -1 a bf16 one in bf16_matmul.cpp's tiles, -2 an fp32 one in f32_matmul.cpp's tiles (the
// tiles, and an unused tensor). Built per ISA variant (ops/cpu_kernels/isa.py) as a library of its own, which
// finds the sibling kernels' ops at their first call (build.py).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#define FASTGEN_STR2(x) #x
#define FASTGEN_STR(x) FASTGEN_STR2(x)
#define FASTGEN_OP_NAME(name) "fastgen::" name "_" FASTGEN_STR(FASTGEN_ISA)

namespace {

#include "simd.h"

using Q4Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using Q8Fn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using TilesFn = at::Tensor(const at::Tensor&, const at::Tensor&);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, int64_t, double, const std::optional<at::Tensor>&, int64_t,
                               int64_t);

// The sibling kernels of this variant, looked up at their first call (each is its own library, loaded by the
// layer that packed the weights it multiplies, or by the attention's step plan).
template <typename Fn>
c10::TypedOperatorHandle<Fn> sibling(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}
const c10::TypedOperatorHandle<Q4Fn>& q4_op() {
  static const auto op = sibling<Q4Fn>(FASTGEN_OP_NAME("q4_matmul"));
  return op;
}
const c10::TypedOperatorHandle<Q8Fn>& q8_op() {
  static const auto op = sibling<Q8Fn>(FASTGEN_OP_NAME("q8_matmul"));
  return op;
}
const c10::TypedOperatorHandle<TilesFn>& bf16_op() {
  static const auto op = sibling<TilesFn>(FASTGEN_OP_NAME("bf16_matmul"));
  return op;
}
const c10::TypedOperatorHandle<TilesFn>& f32_op() {
  static const auto op = sibling<TilesFn>(FASTGEN_OP_NAME("f32_matmul"));
  return op;
}
const c10::TypedOperatorHandle<AttentionFn>& attention_op() {
  static const auto op = sibling<AttentionFn>(FASTGEN_OP_NAME("paged_decode"));
  return op;
}

// v rounded to T and back: where the torch forward stores an intermediate in the activations' dtype.
template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// x @ W^T `[M, N]` in x's dtype for a linear of `kind` whose weight is the pair (a, b).
at::Tensor linear(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t kind) {
  if (kind > 0) return q4_op().call(x, a, b, kind);
  if (kind == -1) return bf16_op().call(x, a);
  if (kind == -2) return f32_op().call(x, a);
  TORCH_CHECK(kind == 0, "unknown linear kind ", kind);
  at::Tensor out = at::empty({x.size(0), a.size(0) * 16}, x.options().dtype(at::kFloat));  // whole tiles
  q8_op().call(out, x, a, b);
  return out.to(x.scalar_type());
}

// HF's RMSNorm of one row of `dim` values: x * rsqrt(mean(x^2) + eps) in fp32, rounded to T, times the weight
// (rounded to T). `y` may be `x`.
template <typename T>
void norm_row(const T* x, T* y, int64_t dim, const T* w, float eps) {
  vf squares = vzero();
  int64_t i = 0;
  for (; i + W <= dim; i += W) squares = vfma(vload(x + i), vload(x + i), squares);
  float sum = vsum(squares);
  for (; i < dim; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (i = 0; i < dim; ++i) y[i] = static_cast<T>(rnd<T>(static_cast<float>(x[i]) * r) * static_cast<float>(w[i]));
}

template <typename T>
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, double eps) {
  const int64_t rows = h.size(0), dim = h.size(1);
  at::Tensor out = at::empty_like(h);
  for (int64_t m = 0; m < rows; ++m) {
    norm_row(h.data_ptr<T>() + m * dim, out.data_ptr<T>() + m * dim, dim, weight.data_ptr<T>(),
             static_cast<float>(eps));
  }
  return out;
}

// silu(gate) * up over `n` values, SiLU rounded to T before the product as torch's `act(gate).mul_(up)` is.
template <typename T>
void silu_and_mul(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
  alignas(64) T silu[W];
  for (; i + W <= n; i += W) {
    const vf g = vload(gate + i);
    vstore(silu, vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g)))));
    vstore(out + i, vmul(vload(silu), vload(up + i)));
  }
  for (; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(rnd<T>(g / (1.0f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}

// Heads `heads` of `src` (contiguous `[heads, D]`) rotated NeoX-style into `dst` (which may be `src`): with
// half = rotary_dim / 2, [x1 c - x2 s, x2 c + x1 s] over the first rotary_dim elements, each product and the sum
// rounded to T as torch's rotate-half does, the rest copied.
template <typename T>
void rotate(const T* src, T* dst, int64_t heads, int64_t dim, const float* cos_sin, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * dim;
    T* y = dst + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float c = rnd<T>(cos_sin[i]), s = rnd<T>(cos_sin[half + i]);
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
      y[i] = static_cast<T>(rnd<T>(x1 * c) + rnd<T>(-x2 * s));
      y[half + i] = static_cast<T>(rnd<T>(x2 * c) + rnd<T>(x1 * s));
    }
    for (int64_t i = rotary_dim; i < dim; ++i) y[i] = x[i];
  }
}

// One layer's fixed arguments (see the op below).
struct Layer {
  at::TensorList weights;
  at::IntArrayRef kinds;
  at::Tensor cos_sin, qkv_bias, q_norm, k_norm;
  int64_t num_heads, num_kv_heads, head_dim;
  float eps, head_eps;
  double scale;
  int64_t sliding_window;
  double softcap;
};

// The step's arguments: where the tokens sit and their sequences' KV.
struct Step {
  const at::Tensor& positions;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  const at::Tensor& query_start_loc;
  int64_t max_query_len;
};

// q `[T, Hq, D]` and k `[T, Hkv, D]` of the step's rows from the q/k/v product (its bias already added): per head
// RMSNorm where the layer has q/k norms, then the rotary.
template <typename T>
void queries_and_keys(const Layer& l, const Step& s, const at::Tensor& qkv, at::Tensor& q, at::Tensor& k) {
  const int64_t rows = qkv.size(0), D = l.head_dim, q_size = l.num_heads * D, kv_size = l.num_kv_heads * D;
  const int64_t rotary_dim = l.cos_sin.defined() ? l.cos_sin.size(1) : 0;
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = qkv.data_ptr<T>() + m * qkv.stride(0);
    T* qm = q.data_ptr<T>() + m * q_size;
    T* km = k.data_ptr<T>() + m * kv_size;
    std::copy(row, row + q_size, qm);
    std::copy(row + q_size, row + q_size + kv_size, km);
    if (l.q_norm.defined()) {
      for (int64_t h = 0; h < l.num_heads; ++h) norm_row(qm + h * D, qm + h * D, D, l.q_norm.data_ptr<T>(), l.head_eps);
      for (int64_t h = 0; h < l.num_kv_heads; ++h) {
        norm_row(km + h * D, km + h * D, D, l.k_norm.data_ptr<T>(), l.head_eps);
      }
    }
    if (rotary_dim > 0) {
      const int64_t pos = s.positions.data_ptr<int64_t>()[m];
      TORCH_CHECK(pos >= 0 && pos < l.cos_sin.size(0), "position ", pos, " is beyond the rotary cache's ",
                  l.cos_sin.size(0));
      const float* cs = l.cos_sin.data_ptr<float>() + pos * rotary_dim;
      rotate<T>(qm, qm, l.num_heads, D, cs, rotary_dim);
      rotate<T>(km, km, l.num_kv_heads, D, cs, rotary_dim);
    }
  }
}

// a + b elementwise over `n` values into a, rounded to T (a residual add, or a bias broadcast by the caller).
template <typename T>
void add_into(T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

template <typename T>
at::Tensor run(const at::Tensor& hidden, const Layer& l, const Step& s) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const int64_t q_size = l.num_heads * l.head_dim, kv_size = l.num_kv_heads * l.head_dim;
  const at::Tensor h = hidden.contiguous();
  const at::TensorList w = l.weights;

  const at::Tensor qkv = linear(rms_norm<T>(h, w[0], l.eps), w[1], w[2], l.kinds[0]);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size && qkv.is_contiguous(), "qkv_proj gives ", qkv.size(1),
              " columns, the heads need ", q_size + 2 * kv_size);
  if (l.qkv_bias.defined()) {
    for (int64_t m = 0; m < rows; ++m) {
      add_into(qkv.data_ptr<T>() + m * qkv.size(1), l.qkv_bias.data_ptr<T>(), qkv.size(1));
    }
  }
  at::Tensor q = at::empty({rows, l.num_heads, l.head_dim}, h.options());
  at::Tensor k = at::empty({rows, l.num_kv_heads, l.head_dim}, h.options());
  queries_and_keys<T>(l, s, qkv, q, k);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, l.num_kv_heads, l.head_dim});
  const at::Tensor attended =
      attention_op().call(q, k, v, s.k_cache, s.v_cache, s.slot_mapping, s.block_tables, s.seq_lens, s.query_start_loc,
                          l.scale, l.sliding_window, l.softcap, std::nullopt, 0, s.max_query_len);
  TORCH_CHECK(attended.defined(), "the paged decode kernel does not take this layer's tensors");
  const at::Tensor o = linear(attended.view({rows, q_size}), w[3], w[4], l.kinds[1]);

  // The residual stream after attention, rounded to T as the layer's `hidden + attn` is.
  at::Tensor out = h.clone();
  add_into(out.data_ptr<T>(), o.data_ptr<T>(), rows * width);

  const at::Tensor gate_up = linear(rms_norm<T>(out, w[5], l.eps), w[6], w[7], l.kinds[2]);
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, inter}, h.options());
  const T* gu = gate_up.data_ptr<T>();
  for (int64_t m = 0; m < rows; ++m) {
    silu_and_mul(gu + m * 2 * inter, gu + m * 2 * inter + inter, act.data_ptr<T>() + m * inter, inter);
  }
  add_into(out.data_ptr<T>(), linear(act, w[8], w[9], l.kinds[3]).data_ptr<T>(), rows * width);
  return out;
}

// The op. weights: input_layernorm.weight, qkv_proj (2 tensors), o_proj (2), post_attention_layernorm.weight,
// gate_up_proj (2), down_proj (2); kinds: one per linear (int4 group size, 0 for Q8_0, -1 for bf16 tiles, -2 for
// fp32 tiles).
// cos_sin: the rotary cache `[positions, rotary_dim]` fp32 (cos then sin), none for a layer without rotary.
// qkv_bias: q/k/v's bias (none: no bias); q_norm, k_norm: per-head RMSNorm weights `[head_dim]` (with `head_eps`)
// applied before the rotary (none: no head norms). The attention arguments are fastgen::paged_attention's; every
// sequence of the step must have at most `max_query_len` query tokens (the kernel attends only those).
at::Tensor decode_layer(const at::Tensor& hidden, const at::Tensor& positions, const std::optional<at::Tensor>& cos_sin,
                        at::TensorList weights, at::IntArrayRef kinds, const std::optional<at::Tensor>& qkv_bias,
                        const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double head_eps,
                        double scale, int64_t sliding_window, double softcap, int64_t max_query_len) {
  TORCH_CHECK(hidden.dim() == 2 && weights.size() == 10 && kinds.size() == 4,
              "hidden [T, H], 10 weight tensors and 4 linear kinds");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == hidden.size(0),
              "positions must be contiguous int64, one per row");
  const at::Tensor cs = cos_sin.has_value() ? cos_sin->contiguous() : at::Tensor();
  TORCH_CHECK(!cs.defined() || (cs.scalar_type() == at::kFloat && cs.dim() == 2 && cs.size(1) % 2 == 0 &&
                                cs.size(1) <= head_dim),
              "cos_sin must be fp32 [positions, even rotary_dim <= head_dim]");
  auto own = [&](const std::optional<at::Tensor>& t, int64_t numel, const char* what) {
    if (!t.has_value()) return at::Tensor();
    TORCH_CHECK(t->scalar_type() == hidden.scalar_type() && t->is_contiguous() && t->numel() == numel, what,
                " must be contiguous, of hidden's dtype, ", numel, " values");
    return *t;
  };
  own(weights[0], hidden.size(1), "the norms' weights");
  own(weights[5], hidden.size(1), "the norms' weights");
  const Layer layer{weights, kinds, cs, own(qkv_bias, (num_heads + 2 * num_kv_heads) * head_dim, "qkv_bias"),
                    own(q_norm, head_dim, "q_norm"), own(k_norm, head_dim, "k_norm"), num_heads, num_kv_heads,
                    head_dim, static_cast<float>(eps), static_cast<float>(head_eps), scale, sliding_window, softcap};
  TORCH_CHECK(layer.q_norm.defined() == layer.k_norm.defined(), "q_norm and k_norm come together");
  const Step step{positions, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len};
  switch (hidden.scalar_type()) {
    case at::kFloat: return run<float>(hidden, layer, step);
    case at::kBFloat16: return run<c10::BFloat16>(hidden, layer, step);
    case at::kHalf: return run<c10::Half>(hidden, layer, step);
    default: TORCH_CHECK(false, "unsupported dtype ", hidden.scalar_type());
  }
}

}  // namespace

#define FASTGEN_DECODE_LAYER_OP "decode_layer_" FASTGEN_STR(FASTGEN_ISA)

TORCH_LIBRARY_FRAGMENT(fastgen, m) {
  m.def(FASTGEN_DECODE_LAYER_OP
        "(Tensor hidden, Tensor positions, Tensor? cos_sin, Tensor[] weights, int[] kinds, Tensor? qkv_bias, "
        "Tensor? q_norm, Tensor? k_norm, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int num_heads, int num_kv_heads, int head_dim, "
        "float eps, float head_eps, float scale, int sliding_window, float softcap, int max_query_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl(FASTGEN_DECODE_LAYER_OP, &decode_layer); }
