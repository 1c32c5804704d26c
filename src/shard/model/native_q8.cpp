// The q8 product (issue 42): an int8 weight in groups (GGUF's Q8_0, Q5_*, Q6_K, MXFP4) times
// rows rounded to 16-bit integers per group, in the order shard/model/q8.py states; its torch
// reference gives the same bytes. Built into the one extension with native_step.cpp (which
// registers it and calls it for the native forward's int8 products).
//
// The codes are packed once (q8.py): blocks of W = 16 outputs (the last may be narrower),
// each [K / 4][width][4] bytes, every code stored plus 128 (an unsigned byte), so that one
// AVX-512 VNNI instruction multiplies 4 columns of 16 outputs by 4 broadcast bytes of a row.
// A row value q (|q| <= 32767) is two bytes, q = 256 h + l (h signed, l unsigned): the codes
// plus 128 times h (the bias -128 sum(h) undoes the 128), the codes times l, and
// m = 256 m_h + m_l. The integer sums are exact in any order (|m| < 2^31 for groups up to
// 256 columns), so the only rounding is per group and output, one order for every version
// (built with -ffp-contract=off: never fused): t = (scale * d) * float(m) (+ offset * u);
// acc = acc + t over the groups left to right from -0.0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

using at::Tensor;

namespace shard_native {

namespace {

constexpr int W = 16;  // outputs a packed block
constexpr int64_t MAX_GROUP = 256;
constexpr int32_t LEVELS = 32767;  // a row value's largest magnitude
constexpr int64_t AHEAD = 4;  // blocks a prefetch reaches ahead

struct Q8 {
    const int16_t* q;       // [R, K]: the rows rounded to 16-bit integers
    const int8_t* hi;       // [R, K]: q >> 8 (arithmetic)
    const uint8_t* lo;      // [R, K]: q & 255
    const float* d;         // [R, G]: their scale per group
    const int32_t* bias;    // [R, G]: -128 times the sum of hi over the group
    const uint8_t* packed;  // the codes plus 128, in blocks (file comment)
    const float* scale;     // [N, G] in blocks of [G][width]
    const float* offset;    // [N, G] in blocks as scale, or null
    const float* u;         // [R, G]: d times the sum of q (offsets only)
    float* out;             // [R, N]
    int64_t r, k, group, n;
};

// Rows [r0, r0 + RT) of block b, any width, in plain C++.
template <int RT>
void block_plain(const Q8& a, int64_t b, int64_t r0) {
    const int64_t groups = a.k / a.group, steps = a.group / 4;
    const int64_t width = std::min<int64_t>(W, a.n - b * W);
    const uint8_t* p = a.packed + b * W * a.k;
    const float* s = a.scale + b * W * groups;
    float acc[RT][W];
    int32_t sum[RT][W];
    for (int rr = 0; rr < RT; rr++)
        for (int o = 0; o < W; o++) acc[rr][o] = -0.0f;
    for (int64_t g = 0; g < groups; g++) {
        for (int rr = 0; rr < RT; rr++)
            for (int o = 0; o < W; o++) sum[rr][o] = 0;
        for (int64_t j = 0; j < steps; j++) {
            const uint8_t* w = p + (g * steps + j) * width * 4;
            for (int rr = 0; rr < RT; rr++) {
                const int16_t* q = a.q + (r0 + rr) * a.k + g * a.group + 4 * j;
                for (int64_t o = 0; o < width; o++)
                    sum[rr][o] += (w[4 * o] - 128) * q[0] + (w[4 * o + 1] - 128) * q[1] +
                                  (w[4 * o + 2] - 128) * q[2] + (w[4 * o + 3] - 128) * q[3];
            }
        }
        for (int rr = 0; rr < RT; rr++) {
            const float d = a.d[(r0 + rr) * groups + g];
            for (int64_t o = 0; o < width; o++) {
                float t = (s[g * width + o] * d) * static_cast<float>(sum[rr][o]);
                if (a.offset != nullptr)
                    t = t + a.offset[b * W * groups + g * width + o] * a.u[(r0 + rr) * groups + g];
                acc[rr][o] = acc[rr][o] + t;
            }
        }
    }
    for (int rr = 0; rr < RT; rr++)
        std::memcpy(a.out + (r0 + rr) * a.n + b * W, acc[rr], width * sizeof(float));
}

#if defined(__x86_64__) && defined(__GNUC__)
#define Q8_X86 1

// Rows [r0, r0 + RT) of a full block b: one 16-lane register a row holds its 16 outputs.
// J: the 4-column steps of a group when known at compile time (8: groups of 32), else 0.
template <int RT, int J>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block512(const Q8& a, int64_t b,
                                                                       int64_t r0) {
    const int64_t groups = a.k / a.group, steps = J > 0 ? J : a.group / 4;
    const uint8_t* p = a.packed + b * W * a.k;
    const float* s = a.scale + b * W * groups;
    const float* off = a.offset != nullptr ? a.offset + b * W * groups : nullptr;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 acc[RT];
    __m512i high[RT], low[RT];  // the sums of the high and low bytes (exact: order is free)
    for (int rr = 0; rr < RT; rr++) acc[rr] = _mm512_set1_ps(-0.0f);
    for (int64_t g = 0; g < groups; g++) {
        for (int rr = 0; rr < RT; rr++) {
            high[rr] = _mm512_set1_epi32(a.bias[(r0 + rr) * groups + g]);
            low[rr] = _mm512_setzero_si512();
        }
        const uint8_t* pg = p + g * steps * 64;
        const int8_t* hg = a.hi + r0 * a.k + g * a.group;
        const uint8_t* lg = a.lo + r0 * a.k + g * a.group;
        // several rows compute long enough to fetch ahead: the group of the block AHEAD
        // blocks on, into L2 (Gemma 3's head, 9 rows, one thread, measured with 8-bit rows:
        // 13 ms instead of 18; one row is faster without)
        if (a.r > 1 && r0 == 0 && (b + 1 + AHEAD) * W <= a.n)
            for (int64_t j = 0; j < steps; j++)
                _mm_prefetch(reinterpret_cast<const char*>(pg + AHEAD * W * a.k + j * 64),
                             _MM_HINT_T1);
        for (int64_t j = 0; j < steps; j++) {
            const __m512i biased = _mm512_loadu_si512(pg + j * 64);  // code + 128, unsigned
            const __m512i codes = _mm512_xor_si512(biased, flip);    // the code, signed
            for (int rr = 0; rr < RT; rr++) {
                int32_t h4, l4;
                std::memcpy(&h4, hg + rr * a.k + 4 * j, 4);
                std::memcpy(&l4, lg + rr * a.k + 4 * j, 4);
                high[rr] = _mm512_dpbusd_epi32(high[rr], biased, _mm512_set1_epi32(h4));
                low[rr] = _mm512_dpbusd_epi32(low[rr], _mm512_set1_epi32(l4), codes);
            }
        }
        const __m512 sv = _mm512_loadu_ps(s + g * W);
        for (int rr = 0; rr < RT; rr++) {
            const __m512 sd = _mm512_mul_ps(sv, _mm512_set1_ps(a.d[(r0 + rr) * groups + g]));
            const __m512i whole = _mm512_add_epi32(_mm512_slli_epi32(high[rr], 8), low[rr]);
            const __m512 m = _mm512_cvtepi32_ps(whole);
            __m512 t = _mm512_mul_ps(sd, m);
            if (off != nullptr)
                t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_loadu_ps(off + g * W),
                                                   _mm512_set1_ps(a.u[(r0 + rr) * groups + g])));
            acc[rr] = _mm512_add_ps(acc[rr], t);
        }
    }
    for (int rr = 0; rr < RT; rr++) _mm512_storeu_ps(a.out + (r0 + rr) * a.n + b * W, acc[rr]);
}

template <int J>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void blocks512(const Q8& a, int64_t b0,
                                                                        int64_t b1) {
    const int64_t tiles = (a.r + 7) / 8;  // up to 8 rows a pass over a block, balanced: 9 = 4 + 5
    for (int64_t b = b0; b < b1; b++) {
        if ((b + 1) * W > a.n) {  // the narrower last block
            for (int64_t r0 = 0; r0 < a.r; r0++) block_plain<1>(a, b, r0);
            continue;
        }
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t rt = (a.r - r0) / (tiles - t);
            switch (rt) {
                case 8: block512<8, J>(a, b, r0); break;
                case 7: block512<7, J>(a, b, r0); break;
                case 6: block512<6, J>(a, b, r0); break;
                case 5: block512<5, J>(a, b, r0); break;
                case 4: block512<4, J>(a, b, r0); break;
                case 3: block512<3, J>(a, b, r0); break;
                case 2: block512<2, J>(a, b, r0); break;
                default: block512<1, J>(a, b, r0); break;
            }
            r0 += rt;
        }
    }
}

// Rows [r0, r0 + RT) of a full block b on AVX2 (no VNNI): the codes widened to 16 bits, each
// row's 4 values broadcast, _mm256_madd_epi16 (exact: |pair| < 2^24); 4 outputs' pairs a
// register, folded at the group's end. The same integers, so the same bytes.
template <int RT>
__attribute__((target("avx2"))) void block256(const Q8& a, int64_t b, int64_t r0) {
    const int64_t groups = a.k / a.group, steps = a.group / 4;
    const uint8_t* p = a.packed + b * W * a.k;
    const float* s = a.scale + b * W * groups;
    const float* off = a.offset != nullptr ? a.offset + b * W * groups : nullptr;
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    __m256 acc[RT][2];
    for (int rr = 0; rr < RT; rr++) acc[rr][0] = acc[rr][1] = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < groups; g++) {
        __m256i pairs[RT][4];
        for (int rr = 0; rr < RT; rr++)
            for (int h = 0; h < 4; h++) pairs[rr][h] = _mm256_setzero_si256();
        for (int64_t j = 0; j < steps; j++) {
            const uint8_t* w = p + (g * steps + j) * 64;
            __m256i c[4];  // outputs 4h..4h+3, 4 columns each, as 16-bit codes
            for (int h = 0; h < 4; h++)
                c[h] = _mm256_cvtepi8_epi16(_mm_xor_si128(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * h)), flip));
            for (int rr = 0; rr < RT; rr++) {
                int64_t q4;
                std::memcpy(&q4, a.q + (r0 + rr) * a.k + g * a.group + 4 * j, 8);
                const __m256i qv = _mm256_set1_epi64x(q4);
                for (int h = 0; h < 4; h++)
                    pairs[rr][h] = _mm256_add_epi32(pairs[rr][h], _mm256_madd_epi16(c[h], qv));
            }
        }
        for (int rr = 0; rr < RT; rr++) {
            const float d = a.d[(r0 + rr) * groups + g];
            for (int half = 0; half < 2; half++) {
                const __m256i m = _mm256_permutevar8x32_epi32(
                    _mm256_hadd_epi32(pairs[rr][2 * half], pairs[rr][2 * half + 1]), order);
                const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(s + g * W + 8 * half),
                                                _mm256_set1_ps(d));
                __m256 t = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(m));
                if (off != nullptr)
                    t = _mm256_add_ps(
                        t, _mm256_mul_ps(_mm256_loadu_ps(off + g * W + 8 * half),
                                         _mm256_set1_ps(a.u[(r0 + rr) * groups + g])));
                acc[rr][half] = _mm256_add_ps(acc[rr][half], t);
            }
        }
    }
    for (int rr = 0; rr < RT; rr++)
        for (int half = 0; half < 2; half++)
            _mm256_storeu_ps(a.out + (r0 + rr) * a.n + b * W + 8 * half, acc[rr][half]);
}

__attribute__((target("avx2"))) void blocks256(const Q8& a, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        if ((b + 1) * W > a.n) {  // the narrower last block
            for (int64_t r0 = 0; r0 < a.r; r0++) block_plain<1>(a, b, r0);
            continue;
        }
        int64_t r0 = 0;
        for (; r0 + 2 <= a.r; r0 += 2) block256<2>(a, b, r0);
        if (r0 < a.r) block256<1>(a, b, r0);
    }
}
#endif

void blocks_plain(const Q8& a, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        int64_t r0 = 0;
        for (; r0 + 4 <= a.r; r0 += 4) block_plain<4>(a, b, r0);
        for (; r0 < a.r; r0++) block_plain<1>(a, b, r0);
    }
}

void blocks(const Q8& a, int64_t b0, int64_t b1, int isa) {
#ifdef Q8_X86
    if (isa == 1) return blocks256(a, b0, b1);
    if (isa == 2) {
        const int64_t steps = a.group / 4;
        return steps == 8 ? blocks512<8>(a, b0, b1)
               : steps == 4 ? blocks512<4>(a, b0, b1)
                            : blocks512<0>(a, b0, b1);
    }
#endif
    blocks_plain(a, b0, b1);
}

// A row's group rounded to 16-bit integers (q8.py states it): amax the largest |x| (NaN if any
// is), d = amax / 32767, q = round-half-even(clamp(x * (d != 0 ? 1 / d : 0), -32767, 32767))
// with NaN taken as 0, split into bytes hi = q >> 8, lo = q & 255; bias = -128 sum(hi); total
// = sum(q).
void quantize(const float* x, int64_t n, int16_t* q, int8_t* hi, uint8_t* lo, float* d,
              int32_t* bias, int32_t* total) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float v = std::fabs(x[i]);
        if (v > amax || std::isnan(v)) amax = std::isnan(amax) ? amax : v;
    }
    const float scale = amax / static_cast<float>(LEVELS);
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0, high = 0;
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] * inv;
        if (std::isnan(y)) y = 0.0f;
        y = std::min(std::max(y, -static_cast<float>(LEVELS)), static_cast<float>(LEVELS));
        const int32_t c = static_cast<int32_t>(std::nearbyint(y));
        q[i] = static_cast<int16_t>(c);
        hi[i] = static_cast<int8_t>(c >> 8);  // arithmetic: floor(c / 256)
        lo[i] = static_cast<uint8_t>(c & 255);
        sum += c;
        high += c >> 8;
    }
    *d = scale;
    *bias = -128 * high;
    *total = sum;
}

#ifdef Q8_X86
// quantize for groups without a NaN, 16 values at a time: the same operations (max is exact
// in any order, the clamp and the conversion, round half to even, are per value), so the same
// bytes; a group with a NaN goes to quantize, which takes it in order.
__attribute__((target("avx512f"))) void quantize512(const float* x, int64_t n, int16_t* q,
                                                    int8_t* hi, uint8_t* lo, float* d,
                                                    int32_t* bias, int32_t* total) {
    __m512 top = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, _mm512_abs_ps(v));
    }
    if (nan != 0) return quantize(x, n, q, hi, lo, d, bias, total);
    const float amax = _mm512_reduce_max_ps(top);
    const float scale = amax / static_cast<float>(LEVELS);
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m512 vinv = _mm512_set1_ps(inv), most = _mm512_set1_ps(static_cast<float>(LEVELS)),
                 least = _mm512_set1_ps(-static_cast<float>(LEVELS));
    __m512i sum = _mm512_setzero_si512(), high = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv);
        y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), y, _mm512_setzero_ps());
        y = _mm512_min_ps(_mm512_max_ps(y, least), most);
        const __m512i c = _mm512_cvtps_epi32(y);  // the current rounding: nearest, ties to even
        const __m512i h = _mm512_srai_epi32(c, 8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(c));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i),
                         _mm512_cvtepi32_epi8(_mm512_and_si512(c, _mm512_set1_epi32(255))));
        sum = _mm512_add_epi32(sum, c);
        high = _mm512_add_epi32(high, h);
    }
    *d = scale;
    *bias = -128 * _mm512_reduce_add_epi32(high);
    *total = _mm512_reduce_add_epi32(sum);
}
#endif

}  // namespace

// The widest version this CPU runs: 2 AVX-512 with VNNI, 1 AVX2, 0 plain C++.
int64_t q8_best() {
#ifdef Q8_X86
    static const int best = __builtin_cpu_supports("avx512f") &&
                                    __builtin_cpu_supports("avx512bw") &&
                                    __builtin_cpu_supports("avx512vnni")
                                ? 2
                            : __builtin_cpu_supports("avx2") ? 1
                                                             : 0;
    return best;
#else
    return 0;
#endif
}

// rows x [R, K] float32 times a packed weight (q8.py): packed uint8 [N, K], scale and offset
// float32 [N, K / group] (offset: a 0-element tensor for none), all in the packed blocks ->
// [R, N] float32.
// isa: as q8_best numbers them, -1 the widest, capped at the widest (tests run each
// against the reference).
Tensor q8_mm(const Tensor& x, const Tensor& packed, const Tensor& scale, const Tensor& offset,
             int64_t group, int64_t isa) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                    !x.is_cuda(),
                "q8: want rows [R, K] float32, contiguous, on the CPU");
    const int64_t r = x.size(0), k = x.size(1), n = packed.dim() == 2 ? packed.size(0) : 0;
    TORCH_CHECK(k > 0 && n > 0 && group > 0 && group % 16 == 0 && group <= MAX_GROUP &&
                    k % group == 0,
                "q8: group ", group, " of ", k, " columns is not one it takes");
    const int64_t groups = k / group;
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && !packed.is_cuda() &&
                    packed.numel() == n * k,
                "q8: want ", n * k, " packed codes, uint8, contiguous, on the CPU");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && !scale.is_cuda() &&
                    scale.numel() == n * groups,
                "q8: want ", n * groups, " scales, float32, contiguous, on the CPU");
    const bool has_offset = offset.numel() > 0;
    TORCH_CHECK(!has_offset || (offset.scalar_type() == at::kFloat && offset.is_contiguous() &&
                                !offset.is_cuda() && offset.numel() == n * groups),
                "q8: want ", n * groups, " offsets, float32, contiguous, on the CPU");
    Tensor q = at::empty({r, k}, x.options().dtype(at::kShort));
    Tensor hi = at::empty({r, k}, x.options().dtype(at::kChar));
    Tensor lo = at::empty({r, k}, x.options().dtype(at::kByte));
    Tensor d = at::empty({r, groups}, x.options());
    Tensor sums = at::empty({2, r, groups}, x.options().dtype(at::kInt));  // bias, sum(q)
    const float* xs = x.data_ptr<float>();
    int16_t* qs = q.data_ptr<int16_t>();
    int8_t* his = hi.data_ptr<int8_t>();
    uint8_t* los = lo.data_ptr<uint8_t>();
    float* ds = d.data_ptr<float>();
    int32_t* bs = sums.data_ptr<int32_t>();
    int32_t* ts = bs + r * groups;
    const int use = isa < 0 ? static_cast<int>(q8_best())
                            : std::min<int>(static_cast<int>(isa), q8_best());
    for (int64_t i = 0; i < r * groups; i++) {  // row i / groups, group i % groups
#ifdef Q8_X86
        if (use == 2) {
            quantize512(xs + i * group, group, qs + i * group, his + i * group, los + i * group,
                        ds + i, bs + i, ts + i);
            continue;
        }
#endif
        quantize(xs + i * group, group, qs + i * group, his + i * group, los + i * group, ds + i,
                 bs + i, ts + i);
    }
    Tensor u;
    if (has_offset) {  // d times the sum of q, per row and group (exact: below 2^24)
        u = at::empty({r, groups}, x.options());
        float* us = u.data_ptr<float>();
        for (int64_t i = 0; i < r * groups; i++) us[i] = ds[i] * static_cast<float>(ts[i]);
    }
    Tensor out = at::empty({r, n}, x.options());
    const Q8 a{qs, his, los, ds, bs, packed.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                 has_offset ? offset.data_ptr<float>() : nullptr,
                 has_offset ? u.data_ptr<float>() : nullptr, out.data_ptr<float>(),
                 r, k, group, n};
    // a task of at least ~256k multiply-adds: a small head runs on one thread
    const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, W * k * r));
    at::parallel_for(0, (n + W - 1) / W, grain,
                     [&](int64_t b0, int64_t b1) { blocks(a, b0, b1, use); });
    return out;
}

}  // namespace shard_native
