// Row attention (issue 42): a short chunk's attention in float32, each row in the order
// shard/model/rowattn.py states, so that its torch reference gives the same bytes and a row
// the same bytes alone as in a chunk. Built into the one extension with native_step.cpp
// (which registers it and calls it for the native forward's attention).
//
// Every float operation is one IEEE float32 operation (built with -ffp-contract=off: never
// fused) on lanes that never mix but where the order says so, so the compiler's vectors of
// any width give the same bytes: one body (row_head), compiled for AVX-512, AVX2 and plain
// x86-64, chosen at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using at::Tensor;

namespace shard_native {

namespace {

constexpr int LANES = 16;
constexpr int CHUNK = 16;  // keys summed in order before the pairwise sum
constexpr float EXP_FLOOR = -87.0f;
constexpr float LOG2E = 1.44269504f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// rowattn.stated_exp, for x <= 0 or NaN
__attribute__((always_inline)) inline float stated_exp(float x) {
    if (std::isnan(x)) return x;
    if (x < EXP_FLOOR) return 0.0f;
    const float n = std::nearbyint(x * LOG2E);
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + POLY[i];
    const float y = ((p * (r * r)) + r) + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float power;
    std::memcpy(&power, &bits, 4);
    return y * power;
}

// rowattn._dot of q with KEYS keys, each its own sums: 16 lanes over the head, then the
// lanes in halves (a[l] + a[l + 8], + a[l + 4], + a[l + 2], + a[l + 1]). ISA 0: plain C++.
template <int ISA, int KEYS>
__attribute__((always_inline)) inline void dots(const float* q, const float* const* k, int64_t dh,
                                                float* out) {
    float acc[KEYS][LANES];
    for (int c = 0; c < KEYS; c++)
        for (int l = 0; l < LANES; l++) acc[c][l] = q[l] * k[c][l];
    for (int64_t b = LANES; b < dh; b += LANES)
        for (int c = 0; c < KEYS; c++)
            for (int l = 0; l < LANES; l++) acc[c][l] = acc[c][l] + q[b + l] * k[c][b + l];
    for (int c = 0; c < KEYS; c++) {
        for (int w = LANES / 2; w >= 1; w /= 2)
            for (int l = 0; l < w; l++) acc[c][l] = acc[c][l] + acc[c][l + w];
        out[c] = acc[c][0];
    }
}

// A chunk's weighted values: out[d] = the sum over its keys c in order, from -0.0, of
// e[c] * v_c[d] (a hidden key is left out: it would add -0.0).
template <int ISA>
__attribute__((always_inline)) inline void chunk_values(const float* e, const float* const* vs,
                                                        int count, int64_t dh, float* out) {
    for (int64_t d = 0; d < dh; d++) out[d] = -0.0f;
    for (int c = 0; c < count; c++)
        for (int64_t d = 0; d < dh; d++) out[d] = out[d] + e[c] * vs[c][d];
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ROWS_X86 1

// the last 8 lanes' halves (a[l] + a[l + 4], + a[l + 2], + a[l + 1]) of x
__attribute__((target("avx2"), always_inline)) inline float halves8(__m256 x) {
    __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_add_ps(y, _mm_movehl_ps(y, y));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_shuffle_ps(y, y, 1)));
}

template <>
__attribute__((target("avx2"), noinline)) void dots<1, 4>(const float* q,
                                                                     const float* const* k,
                                                                     int64_t dh, float* out) {
    __m256 lo[4], hi[4];
    for (int c = 0; c < 4; c++) {
        lo[c] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k[c]));
        hi[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k[c] + 8));
    }
    for (int64_t b = LANES; b < dh; b += LANES) {
        const __m256 ql = _mm256_loadu_ps(q + b), qh = _mm256_loadu_ps(q + b + 8);
        for (int c = 0; c < 4; c++) {
            lo[c] = _mm256_add_ps(lo[c], _mm256_mul_ps(ql, _mm256_loadu_ps(k[c] + b)));
            hi[c] = _mm256_add_ps(hi[c], _mm256_mul_ps(qh, _mm256_loadu_ps(k[c] + b + 8)));
        }
    }
    for (int c = 0; c < 4; c++) out[c] = halves8(_mm256_add_ps(lo[c], hi[c]));
}

template <>
__attribute__((target("avx2"), noinline)) void chunk_values<1>(
    const float* e, const float* const* vs, int count, int64_t dh, float* out) {
    for (int64_t d0 = 0; d0 < dh; d0 += 8) {
        __m256 acc = _mm256_set1_ps(-0.0f);
        for (int c = 0; c < count; c++)
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(e[c]),
                                                   _mm256_loadu_ps(vs[c] + d0)));
        _mm256_storeu_ps(out + d0, acc);
    }
}

__attribute__((target("avx512f"), always_inline)) inline float halves16(__m512 x) {
    const __m256 lo = _mm512_castps512_ps256(x);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    return halves8(_mm256_add_ps(lo, hi));
}

template <>
__attribute__((target("avx512f"), noinline)) void dots<2, 4>(const float* q,
                                                                        const float* const* k,
                                                                        int64_t dh, float* out) {
    __m512 acc[4];
    for (int c = 0; c < 4; c++) acc[c] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k[c]));
    for (int64_t b = LANES; b < dh; b += LANES) {
        const __m512 qb = _mm512_loadu_ps(q + b);
        for (int c = 0; c < 4; c++)
            acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(qb, _mm512_loadu_ps(k[c] + b)));
    }
    for (int c = 0; c < 4; c++) out[c] = halves16(acc[c]);
}

template <>
__attribute__((target("avx512f"), noinline)) void chunk_values<2>(
    const float* e, const float* const* vs, int count, int64_t dh, float* out) {
    int64_t d0 = 0;
    for (; d0 + 64 <= dh; d0 += 64) {
        __m512 acc[4];
        for (int i = 0; i < 4; i++) acc[i] = _mm512_set1_ps(-0.0f);
        for (int c = 0; c < count; c++) {
            const __m512 ec = _mm512_set1_ps(e[c]);
            for (int i = 0; i < 4; i++)
                acc[i] = _mm512_add_ps(acc[i],
                                       _mm512_mul_ps(ec, _mm512_loadu_ps(vs[c] + d0 + 16 * i)));
        }
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + d0 + 16 * i, acc[i]);
    }
    for (; d0 < dh; d0 += 16) {
        __m512 acc = _mm512_set1_ps(-0.0f);
        for (int c = 0; c < count; c++)
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(e[c]),
                                                   _mm512_loadu_ps(vs[c] + d0)));
        _mm512_storeu_ps(out + d0, acc);
    }
}
#endif

struct Rows {
    const float *q, *k, *v;   // q [B, H, S, Dh]; k, v [B, KV, L, Dh] with their strides
    const bool* mask;         // [S, L]
    float* out;               // [B, H, S, Dh]
    int64_t b, h, kv, s, l, dh;
    int64_t kb, kg, kj;  // k's strides (batch, head, key); v has the same
    int64_t vb, vg, vj;
    float scale;
};

// One row and head (unit = (batch, head, row)), in rowattn.py's order: the keys in chunks of
// 16, each summed in order, the chunks' sums added pairwise, kept as a binary counter (which
// is the level-by-level order of rowattn.pairwise_sum): a stack of partial sums of 2^p
// chunks, the two newest merged while their sizes match, the rest folded from the newest
// down at the end. A partial known to be -0.0 (hidden keys only) adds nothing and is not
// added. scratch: n scores, then the stack's vectors.
template <int ISA>
__attribute__((always_inline)) inline void row_head(const Rows& a, int64_t unit,
                                                    std::vector<float>& scratch) {
    const int64_t i = unit % a.s, hb = unit / a.s, head = hb % a.h, batch = hb / a.h;
    const int64_t g = head / (a.h / a.kv), n = a.l - a.s + i + 1, dh = a.dh;
    const float* q = a.q + ((batch * a.h + head) * a.s + i) * dh;
    const float* k = a.k + batch * a.kb + g * a.kg;
    const float* v = a.v + batch * a.vb + g * a.vg;
    const bool* allowed = a.mask + i * a.l;
    constexpr int DEPTH = 64;
    scratch.resize(static_cast<size_t>(n + (DEPTH + 1) * dh));
    float* scores = scratch.data();
    float* stack = scores + n;
    float m = -std::numeric_limits<float>::infinity();
    int64_t j = 0;
    while (j < n && !allowed[j]) j++;  // a sliding window's hidden keys: no score
    for (; j + 4 <= n; j += 4) {  // the scores, four keys at a time (each its own sums)
        const float* ks[4] = {k + j * a.kj, k + (j + 1) * a.kj, k + (j + 2) * a.kj,
                              k + (j + 3) * a.kj};
        dots<ISA, 4>(q, ks, dh, scores + j);
    }
    for (; j < n; j++) {
        const float* ks[1] = {k + j * a.kj};
        dots<0, 1>(q, ks, dh, scores + j);
    }
    for (j = 0; j < n; j++) {
        if (!allowed[j]) continue;
        const float sc = scores[j] * a.scale;
        scores[j] = sc;
        if (std::isnan(sc) || std::isnan(m)) m = std::numeric_limits<float>::quiet_NaN();
        else if (sc > m) m = sc;
    }
    int64_t size[DEPTH];
    bool zero[DEPTH];
    float dsum[DEPTH];
    int top = 0;
    for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
        float e[CHUNK];
        const float* vs[CHUNK];
        int count = 0;
        float den = -0.0f;
        for (int64_t jj = c0; jj < std::min<int64_t>(n, c0 + CHUNK); jj++) {
            if (!allowed[jj]) continue;
            e[count] = stated_exp(scores[jj] - m);
            den = den + e[count];
            vs[count++] = v + jj * a.vj;
        }
        float* t = stack + top * dh;
        zero[top] = count == 0;
        if (count > 0) chunk_values<ISA>(e, vs, count, dh, t);
        dsum[top] = den;
        size[top] = 1;
        top++;
        while (top >= 2 && size[top - 1] == size[top - 2]) {
            float *lo = stack + (top - 2) * dh, *hi = stack + (top - 1) * dh;
            if (zero[top - 2]) {
                if (!zero[top - 1]) std::memcpy(lo, hi, dh * sizeof(float));
                zero[top - 2] = zero[top - 1];
            } else if (!zero[top - 1]) {
                for (int64_t d = 0; d < dh; d++) lo[d] = lo[d] + hi[d];
            }
            dsum[top - 2] = dsum[top - 2] + dsum[top - 1];
            size[top - 2] *= 2;
            top--;
        }
    }
    float* acc = stack + (top - 1) * dh;  // fold: newest first
    bool acc_zero = zero[top - 1];
    float den = dsum[top - 1];
    for (int p = top - 2; p >= 0; p--) {
        const float* lo = stack + p * dh;
        if (!zero[p]) {
            if (acc_zero) std::memcpy(acc, lo, dh * sizeof(float));
            else
                for (int64_t d = 0; d < dh; d++) acc[d] = lo[d] + acc[d];
            acc_zero = false;
        }
        den = dsum[p] + den;
    }
    float* out = a.out + ((batch * a.h + head) * a.s + i) * dh;
    for (int64_t d = 0; d < dh; d++) out[d] = (acc_zero ? -0.0f : acc[d]) / den;
}

void units_plain(const Rows& a, int64_t u0, int64_t u1) {
    std::vector<float> scratch;
    for (int64_t u = u0; u < u1; u++) row_head<0>(a, u, scratch);
}

#ifdef ROWS_X86
__attribute__((target("avx2"))) void units256(const Rows& a, int64_t u0, int64_t u1) {
    std::vector<float> scratch;
    for (int64_t u = u0; u < u1; u++) row_head<1>(a, u, scratch);
}
__attribute__((target("avx512f"))) void units512(const Rows& a, int64_t u0, int64_t u1) {
    std::vector<float> scratch;
    for (int64_t u = u0; u < u1; u++) row_head<2>(a, u, scratch);
}
#endif

int rows_best() {
#ifdef ROWS_X86
    static const int best = __builtin_cpu_supports("avx512f") ? 2
                            : __builtin_cpu_supports("avx2") ? 1
                                                             : 0;
    return best;
#else
    return 0;
#endif
}

}  // namespace

// rowattn.attend_rows: q [B, H, S, Dh] float32 over keys, values [B, KV, L, Dh] float32 (any
// strides but a contiguous head dimension) under mask [S, L] bool -> [B, H, S, Dh]. isa: 2
// AVX-512, 1 AVX2, 0 plain, -1 the widest (capped at the widest).
Tensor row_attention(const Tensor& q_, const Tensor& keys, const Tensor& values,
                     const Tensor& mask_, double scale, int64_t isa) {
    TORCH_CHECK(q_.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes() &&
                    q_.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                    values.scalar_type() == at::kFloat && !q_.is_cuda() && !keys.is_cuda() &&
                    !values.is_cuda(),
                "row attention: want q [B, H, S, Dh], keys and values [B, KV, L, Dh], float32, "
                "on the CPU");
    const int64_t b = q_.size(0), h = q_.size(1), s = q_.size(2), dh = q_.size(3);
    const int64_t kv = keys.size(1), l = keys.size(2);
    TORCH_CHECK(keys.size(0) == b && keys.size(3) == dh && dh > 0 && dh % LANES == 0 && kv > 0 &&
                    h % kv == 0 && s > 0 && s <= l && keys.stride(3) == 1 &&
                    values.stride(3) == 1,
                "row attention: shapes do not fit (Dh a multiple of 16, H of KV, S <= L)");
    TORCH_CHECK(mask_.scalar_type() == at::kBool && mask_.dim() == 2 && mask_.size(0) == s &&
                    mask_.size(1) == l,
                "row attention: want a bool mask [S, L]");
    const Tensor q = q_.contiguous(), mask = mask_.contiguous();
    Tensor out = at::empty({b, h, s, dh}, q.options());
    const Rows a{q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                 mask.data_ptr<bool>(), out.data_ptr<float>(), b, h, kv, s, l, dh,
                 keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0),
                 values.stride(1), values.stride(2), static_cast<float>(scale)};
    const int use = isa < 0 ? rows_best() : std::min<int>(static_cast<int>(isa), rows_best());
    // a task of at least ~64k multiply-adds: a short decode stays on one thread
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, 2 * l * dh));
    at::parallel_for(0, b * h * s, grain, [&](int64_t u0, int64_t u1) {
#ifdef ROWS_X86
        if (use == 2) return units512(a, u0, u1);
        if (use == 1) return units256(a, u0, u1);
#endif
        units_plain(a, u0, u1);
    });
    return out;
}

}  // namespace shard_native
