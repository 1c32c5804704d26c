// A Llama-family stage's layers in C++, giving the eager forward's bytes (issue 42).
// Built and loaded by shard/model/native.py, which says when it runs; docs/model.md ("The
// native forward").
//
// The eager forward (llama.py, attention.py, fused.py, quant.py) spends most of a small
// model's decode step in Python and in ~130 small torch operations a layer. This file runs
// the same layers for one session of S rows without them, and keeps the bytes by
// construction:
//
// - every operation whose result depends on how torch computes it (the int4 products, the
//   RMS norm's sum, SiLU, scaled-dot-product attention) is the same ATen call, on a tensor
//   of the same shape, strides and values as the eager path's, so it gives the same bytes;
// - every other operation is one IEEE float32 operation per element (add, subtract,
//   multiply, divide, square root: built with -ffp-contract=off, so never a fused
//   multiply-add), a copy, or torch's float32 -> bf16 rounding (round half to even, NaN to
//   0x7FC0), which is exact integer arithmetic here;
// - the int8 products are shard's own q8 kernel (native_q8.cpp), which the eager path calls
//   too (through q8.py, which states its order of operations).
//
// Float32 activations, batch 1; Llama's layer and Gemma 3's (its (1 + w) norms, sandwich
// norms, per-head q/k norms, GELU-tanh, sliding windows with their own rope); products on
// the CPU int4 kernel (an int4 weight), the q8 kernel (an int8 weight in groups) or held
// dequantized in bf16 (quant.py, held.py). native.py checks all of it before a stage runs
// here.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

using at::Tensor;

namespace shard_native {  // native_q8.cpp: the q8 product
int64_t q8_best();
Tensor q8_mm(const Tensor& x, const Tensor& packed, const Tensor& scale, const Tensor& offset,
             int64_t group, int64_t isa);
Tensor row_attention(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& mask,
                     double scale, int64_t isa);
}  // namespace shard_native
using shard_native::q8_mm;

namespace {

inline uint16_t to_bf16(float f) {
    if (std::isnan(f)) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

inline float from_bf16(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// One product, as QuantLinear runs it: an int4 weight (packed, scales_zeros), an int8 weight
// in groups for q8_mm (q8: packed, scale, offset), or a weight held dequantized in bf16 (held).
struct Product {
    Tensor packed, scales_zeros, held, scale, offset;
    bool q8 = false;
    int64_t group = 0, n = 0;
};

// QuantLinear.forward / JoinedInt4.forward on rows x [R, K] float32 (contiguous): q8_mm of
// the rows; else the rows rounded to bf16, the product, bf16 back to float32: [R, N] float32.
Tensor run_product(const Product& p, const Tensor& x) {
    if (p.q8) return q8_mm(x, p.packed, p.scale, p.offset, p.group, -1);  // its own rounding
    Tensor rows = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
    const float* src = x.data_ptr<float>();
    auto* dst = reinterpret_cast<uint16_t*>(rows.data_ptr());
    for (int64_t i = 0, n = x.numel(); i < n; i++) dst[i] = to_bf16(src[i]);
    Tensor prod;
    if (p.held.defined()) {  // one bf16 row runs as two (shard.model.linear)
        prod = x.size(0) == 1 ? at::linear(rows.expand({2, -1}), p.held).slice(0, 0, 1)
                              : at::linear(rows, p.held);
    } else {
        prod = at::_weight_int4pack_mm_for_cpu(rows, p.packed, p.group, p.scales_zeros);
    }
    prod = prod.contiguous();
    Tensor out = at::empty(prod.sizes(), x.options());
    float* y = out.data_ptr<float>();
    auto* a = reinterpret_cast<const uint16_t*>(prod.data_ptr());
    for (int64_t i = 0, n = out.numel(); i < n; i++) y[i] = from_bf16(a[i]);
    return out;
}

// RMSNorm.forward on x [..., D] (contiguous): weight * (x * rsqrt(mean(x * x) + eps));
// GemmaRMSNorm.forward when `w` holds its 1 + weight: (x * rsqrt(...)) * (1 + weight), the
// same two products (each exactly rounded: their order is the same value).
Tensor rmsnorm(const Tensor& x, const Tensor& w, double eps) {
    const int64_t d = x.size(-1), s = x.numel() / d;
    Tensor sq = at::empty_like(x);
    const float* xs = x.data_ptr<float>();
    float* q = sq.data_ptr<float>();
    for (int64_t i = 0, n = x.numel(); i < n; i++) q[i] = xs[i] * xs[i];  // torch's pow(x, 2)
    // torch's mean of float32 on a CPU is its sum, then one division by the count (mean_out:
    // sum_out(...).div_(n)): the sum is torch's own call (its reduction order), the division
    // one IEEE operation here
    Tensor sum = at::sum(sq, {-1}, true);
    const float* m = sum.data_ptr<float>();
    const float count = static_cast<float>(d);
    const float* ws = w.data_ptr<float>();
    Tensor out = at::empty_like(x);
    float* o = out.data_ptr<float>();
    const float e = static_cast<float>(eps);  // a Python float added to a float32 tensor
    for (int64_t r = 0; r < s; r++) {
        const float mean = m[r] / count;
        const float inv = 1.0f / std::sqrt(mean + e);  // torch's rsqrt: 1 / sqrt, each rounded
        for (int64_t i = 0; i < d; i++) o[r * d + i] = ws[i] * (xs[r * d + i] * inv);
    }
    return out;
}

// apply_rotary of h heads of Dh from rows [S, width] at column `col`: [1, h, S, Dh].
Tensor rotate(const float* rows, int64_t width, int64_t col, int64_t h, int64_t s, int64_t dh,
              const float* cos_, const float* sin_, const at::TensorOptions& opt) {
    Tensor out = at::empty({1, h, s, dh}, opt);
    float* o = out.data_ptr<float>();
    const int64_t half = dh / 2;
    for (int64_t i = 0; i < h; i++)
        for (int64_t t = 0; t < s; t++) {
            const float* x = rows + t * width + col + i * dh;
            float* y = o + (i * s + t) * dh;
            const float* c = cos_ + t * half;
            const float* sn = sin_ + t * half;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                y[j] = x1 * c[j] - x2 * sn[j];
                y[j + half] = x2 * c[j] + x1 * sn[j];
            }
        }
    return out;
}

struct Layer {
    Tensor norm1, norm2, pre_ffn, post_ffn, q_norm, k_norm;  // Gemma's hold 1 + weight
    Product qkv, o, gate_up, down;
    int64_t window = 0;  // a sliding window's length; 0: full attention
    bool local = false;  // the sliding layers' own rope tables
    int64_t slot = 0;    // its layer in the KV cache
};

// GemmaRMSNorm's factor, 1.0 + weight, as its forward computes it on each call.
Tensor one_plus(const Tensor& w) {
    Tensor out = at::empty_like(w);
    const float* ws = w.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0, n = w.numel(); i < n; i++) o[i] = 1.0f + ws[i];
    return out;
}

// The causal mask [S, end] of queries [start, end), with a sliding window (0: none).
Tensor causal_mask(int64_t start, int64_t s, int64_t window) {
    const int64_t end = start + s;
    Tensor mask = at::zeros({s, end}, at::TensorOptions().dtype(at::kBool));
    bool* m = mask.data_ptr<bool>();
    for (int64_t i = 0; i < s; i++)
        for (int64_t j = 0; j <= start + i; j++) m[i * end + j] = window == 0 || j > start + i - window;
    return mask;
}

class Stage {
   public:
    // weights, per layer: norm1, [q_norm, k_norm], the qkv product, o's, norm2, [pre_ffn,
    // post_ffn], gate_up's, down's; a product is its packed and scales/zeros tensors (int4),
    // its packed codes, scale and offset (q8; a 0-element offset for none), or its held weight.
    // ints, per layer: window, local, per product (qkv, o, gate_up, down) its kind (1 int4,
    // -1 q8, 0 held) and group, then the layer's cache slot. iconf: D, heads, KV
    // heads, Dh, F, the longest chunk attended row by row (0: never), Gemma's norms, sandwich
    // norms, q/k norms, GELU-tanh, row attention for those chunks (rowattn.py; else torch's
    // attention a row at a time) (each 0 or 1). fconf: eps, attention scale.
    Stage(const std::vector<Tensor>& weights, const std::vector<int64_t>& ints,
          const std::vector<int64_t>& iconf, const std::vector<double>& fconf)
        : d_(iconf.at(0)), heads_(iconf.at(1)), kv_(iconf.at(2)), dh_(iconf.at(3)),
          ffn_(iconf.at(4)), rowwise_(iconf.at(5)), gemma_(iconf.at(6) != 0),
          sandwich_(iconf.at(7) != 0), qk_norm_(iconf.at(8) != 0), gelu_(iconf.at(9) != 0),
          rows_(iconf.at(10) != 0),
          eps_(fconf.at(0)), scale_(fconf.at(1)) {
        size_t w = 0, p = 0;
        auto norm = [&]() { return gemma_ ? one_plus(weights.at(w++)) : weights.at(w++); };
        auto product = [&]() {
            Product out;
            const int64_t count = ints.at(p++);
            out.group = ints.at(p++);
            if (count == -1) {  // int8-group
                out.q8 = true;
                out.packed = weights.at(w++);
                out.scale = weights.at(w++);
                out.offset = weights.at(w++);
                out.n = out.packed.size(0);
                return out;
            }
            TORCH_CHECK(count == 0 || count == 1, "native stage: a product of ", count, " parts");
            if (count == 1) {  // int4
                out.packed = weights.at(w++);
                out.scales_zeros = weights.at(w++);
                out.n = out.scales_zeros.size(1);
            } else {  // held
                out.held = weights.at(w++);
                out.n = out.held.size(0);
            }
            return out;
        };
        while (w < weights.size()) {
            Layer l;
            l.window = ints.at(p++);
            l.local = ints.at(p++) != 0;
            l.norm1 = norm();
            if (qk_norm_) {
                l.q_norm = norm();
                l.k_norm = norm();
            }
            l.qkv = product();
            l.o = product();
            l.norm2 = norm();
            if (sandwich_) {
                l.pre_ffn = norm();
                l.post_ffn = norm();
            }
            l.gate_up = product();
            l.down = product();
            l.slot = ints.at(p++);
            TORCH_CHECK(l.qkv.n == (heads_ + 2 * kv_) * dh_ && l.o.n == d_ &&
                            l.gate_up.n == 2 * ffn_ && l.down.n == d_,
                        "native stage: a layer's products do not fit its config");
            layers_.push_back(l);
        }
    }

    // The layers on hidden x [1, S, D] float32 at positions [start, start + S): x after the
    // last layer. kcache, vcache: KVCache.k / .v, [slots, 1, KV, max_len, Dh] float32, written
    // at [start, start + S). cos, sin: the rope tables' rows [S, Dh / 2] float32; local_cos,
    // local_sin: the sliding layers' (undefined where no layer slides). Runs the stage's layers
    // [first, last) only.
    Tensor forward(const Tensor& x, int64_t start, const Tensor& kcache, const Tensor& vcache,
                   const Tensor& cos_, const Tensor& sin_, const std::optional<Tensor>& local_cos,
                   const std::optional<Tensor>& local_sin, int64_t first, int64_t last) const {
        at::NoGradGuard no_grad;
        const int64_t s = x.size(1), end = start + s;
        TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(2) == d_ &&
                        x.scalar_type() == at::kFloat,
                    "native stage: want hidden [1, S, ", d_, "] float32");
        TORCH_CHECK(kcache.scalar_type() == at::kFloat && kcache.is_contiguous() &&
                        vcache.is_contiguous() && kcache.sizes() == vcache.sizes() &&
                        kcache.dim() == 5 && kcache.size(1) == 1 && kcache.size(2) == kv_ &&
                        kcache.size(4) == dh_ && start >= 0 && end <= kcache.size(3),
                    "native stage: the KV cache does not fit");
        auto fits = [&](const Tensor& t) {
            return t.is_contiguous() && t.dim() == 2 && t.size(0) == s && t.size(1) == dh_ / 2 &&
                   t.scalar_type() == at::kFloat;
        };
        TORCH_CHECK(fits(cos_) && fits(sin_), "native stage: the rope rows do not fit");
        TORCH_CHECK(0 <= first && first <= last && last <= static_cast<int64_t>(layers_.size()),
                    "native stage: no layers [", first, ", ", last, ")");
        std::map<int64_t, Tensor> masks;
        for (int64_t i = first; i < last; i++) {
            const Layer& l = layers_[i];
            TORCH_CHECK(0 <= l.slot && l.slot < kcache.size(0), "native stage: no cache slot ",
                        l.slot);
            TORCH_CHECK(!l.local || (local_cos && local_sin && fits(*local_cos) &&
                                     fits(*local_sin)),
                        "native stage: the local rope rows do not fit");
            if (!masks.count(l.window)) masks[l.window] = causal_mask(start, s, l.window);
        }
        Tensor h = x.contiguous();
        for (int64_t i = first; i < last; i++) {
            const Layer& l = layers_[i];
            const Tensor& c = l.local ? *local_cos : cos_;
            const Tensor& sn = l.local ? *local_sin : sin_;
            h = layer(l, h, start, kcache.select(0, l.slot), vcache.select(0, l.slot), c, sn,
                      masks.at(l.window));
        }
        return h;
    }

   private:
    // The per-head norm of `heads` heads of Dh at column `col` of rows [S, width]: the
    // normed heads as rows [S, heads * Dh] (GemmaRMSNorm over [1, S, heads, Dh]).
    Tensor head_norm(const float* rows, int64_t width, int64_t col, int64_t heads, int64_t s,
                     const Tensor& w) const {
        Tensor part = at::empty({1, s, heads, dh_}, at::TensorOptions().dtype(at::kFloat));
        float* pd = part.data_ptr<float>();
        for (int64_t t = 0; t < s; t++)
            std::memcpy(pd + t * heads * dh_, rows + t * width + col, heads * dh_ * sizeof(float));
        return rmsnorm(part, w, eps_);
    }

    Tensor layer(const Layer& l, const Tensor& x, int64_t start, const Tensor& kc,
                 const Tensor& vc, const Tensor& cos_, const Tensor& sin_,
                 const Tensor& mask) const {
        const int64_t s = x.size(1), end = start + s, qw = heads_ * dh_, kw = kv_ * dh_;
        const auto opt = x.options();
        Tensor qkv = run_product(l.qkv, rmsnorm(x, l.norm1, eps_).view({s, d_}));
        const float* rows = qkv.data_ptr<float>();
        const int64_t width = qkv.size(1);
        const float *cs = cos_.data_ptr<float>(), *sn = sin_.data_ptr<float>();
        Tensor q, k;
        if (qk_norm_) {  // per head, before the rotation
            Tensor qn = head_norm(rows, width, 0, heads_, s, l.q_norm);
            Tensor kn = head_norm(rows, width, qw, kv_, s, l.k_norm);
            q = rotate(qn.data_ptr<float>(), qw, 0, heads_, s, dh_, cs, sn, opt);
            k = rotate(kn.data_ptr<float>(), kw, 0, kv_, s, dh_, cs, sn, opt);
        } else {
            q = rotate(rows, width, 0, heads_, s, dh_, cs, sn, opt);
            k = rotate(rows, width, qw, kv_, s, dh_, cs, sn, opt);
        }
        // KVCache.update: k, v into [start, end) of this layer's [1, KV, max_len, Dh]
        float *kd = kc.data_ptr<float>(), *vd = vc.data_ptr<float>();
        const int64_t max_len = kc.size(2);
        const float* ks = k.data_ptr<float>();
        for (int64_t g = 0; g < kv_; g++)
            for (int64_t t = 0; t < s; t++) {
                std::memcpy(kd + (g * max_len + start + t) * dh_, ks + (g * s + t) * dh_,
                            dh_ * sizeof(float));
                std::memcpy(vd + (g * max_len + start + t) * dh_,
                            rows + t * width + qw + kw + g * dh_, dh_ * sizeof(float));
            }
        Tensor keys = kc.slice(2, 0, end), values = vc.slice(2, 0, end);
        const bool gqa = heads_ != kv_;
        Tensor y;  // [1, H, S, Dh]
        if (rows_ && s <= rowwise_) {  // rowattn.attend_rows: each row as its own decode
            y = shard_native::row_attention(q, keys, values, mask, scale_, -1);
        } else if (1 < s && s <= rowwise_) {  // Attention.rowwise: each row as its own decode
            std::vector<Tensor> ys;
            for (int64_t i = 0; i < s; i++)
                ys.push_back(at::scaled_dot_product_attention(
                    q.slice(2, i, i + 1), keys.slice(2, 0, start + i + 1),
                    values.slice(2, 0, start + i + 1),
                    mask.slice(-2, i, i + 1).slice(-1, 0, start + i + 1), 0.0, false, scale_,
                    gqa));
            y = at::cat(ys, 2);
        } else {
            y = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, false, scale_, gqa);
        }
        y = y.contiguous();
        Tensor att = at::empty({s, qw}, opt);  // y.transpose(1, 2).reshape(S, H * Dh)
        const float* ys = y.data_ptr<float>();
        float* a = att.data_ptr<float>();
        for (int64_t i = 0; i < heads_; i++)
            for (int64_t t = 0; t < s; t++)
                std::memcpy(a + t * qw + i * dh_, ys + (i * s + t) * dh_, dh_ * sizeof(float));
        Tensor o = run_product(l.o, att).view({1, s, d_});  // [1, S, D]
        if (sandwich_) o = rmsnorm(o, l.norm2, eps_);  // post_attention_layernorm
        Tensor h = add(x, o);  // the attention's residual
        Tensor ffn_in = rmsnorm(h, sandwich_ ? l.pre_ffn : l.norm2, eps_);
        Tensor gu = run_product(l.gate_up, ffn_in.view({s, d_}));  // [S, 2F]
        const float* g = gu.data_ptr<float>();
        Tensor gate = at::empty({1, s, ffn_}, opt);
        float* gd = gate.data_ptr<float>();
        for (int64_t t = 0; t < s; t++)
            std::memcpy(gd + t * ffn_, g + t * 2 * ffn_, ffn_ * sizeof(float));
        // the activation: torch's own call, on the eager path's shape
        Tensor act = gelu_ ? at::gelu(gate, "tanh") : at::silu(gate);
        float* ad = act.data_ptr<float>();
        for (int64_t t = 0; t < s; t++)
            for (int64_t i = 0; i < ffn_; i++) ad[t * ffn_ + i] *= g[t * 2 * ffn_ + ffn_ + i];
        Tensor dn = run_product(l.down, act.view({s, ffn_})).view({1, s, d_});  // [1, S, D]
        if (sandwich_) dn = rmsnorm(dn, l.post_ffn, eps_);  // post_feedforward_layernorm
        return add(h, dn);  // the feed-forward's residual
    }

    static Tensor add(const Tensor& a, const Tensor& b) {
        Tensor out = at::empty_like(a);
        const float *as = a.data_ptr<float>(), *bs = b.data_ptr<float>();
        float* os = out.data_ptr<float>();
        for (int64_t i = 0, n = a.numel(); i < n; i++) os[i] = as[i] + bs[i];
        return out;
    }

    int64_t d_, heads_, kv_, dh_, ffn_, rowwise_;
    bool gemma_, sandwich_, qk_norm_, gelu_, rows_;
    double eps_, scale_;
    std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    pybind11::class_<Stage>(m, "Stage")
        .def(pybind11::init<const std::vector<Tensor>&, const std::vector<int64_t>&,
                            const std::vector<int64_t>&, const std::vector<double>&>())
        // no Python runs inside: the event loop's thread keeps the interpreter meanwhile
        .def("forward", &Stage::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("q8_mm", &q8_mm, pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("q8_best", &shard_native::q8_best);
    m.def("row_attention", &shard_native::row_attention,
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
