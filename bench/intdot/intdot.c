/* Integer-dot products of stored int4/int8 weights (issue 42): an experiment, bench/intdot.py.
 *
 * The arithmetic is defined by bench/intdot.py's reference (torch, eager); this file computes
 * the same bytes faster. Each activation row is quantized per block of 32 columns to int8
 * (d = amax / 127, q = round-half-even(x / d)). A block splits into L lanes of 32 / L columns
 * (int4: L = 4, int8: L = 8); each lane's integer dot product p of codes and q, and its sum
 * of q, qs, are exact. A lane's term is
 *
 *     t = (scale[n, g] * d[m, b]) * p + (offset[n, g] * d[m, b]) * qs
 *
 * Sixteen float32 accumulators take the terms of 16 / L blocks at a time (block-major), in
 * block order, the last group of blocks padded with zero terms; the 16 are then summed as a
 * tree (8 + 8, 4 + 4, 2 + 2, 1 + 1). Every float operation is one IEEE float32 operation
 * (built with -ffp-contract=off: no fused multiply-add), so the bytes depend on neither the
 * instruction set (the AVX-512 VNNI and the plain loops below agree) nor the thread count nor
 * the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define INTDOT_VNNI 1
#else
#define INTDOT_VNNI 0
#endif

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define BLOCK 32

int intdot_vnni(void) { return INTDOT_VNNI; }

#define LANES 16

/* One row of K activations to int8 per block: q (natural order), the even and odd columns
 * of each block apart (qe, qo: 16 each, for the nibble halves), d per block, and per lane of
 * each block its sum of q (qs4: 4 lanes of 8 columns, qs8: 8 lanes of 4). */
static void quantize_row(const float *x, int64_t k, int8_t *q, int8_t *qe, int8_t *qo,
                         float *d, int32_t *qs4, int32_t *qs8) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const float *xb = x + b * BLOCK;
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < BLOCK; j++) {
            float a = fabsf(xb[j]);
            if (!isfinite(a)) finite = 0;
            else if (a > amax) amax = a;
        }
        float db = finite ? amax / 127.0f : NAN;
        for (int j = 0; j < BLOCK; j++) {
            int v = 0;
            if (finite && amax > 0.0f) {
                float r = nearbyintf(xb[j] / db);
                v = r > 127.0f ? 127 : (r < -127.0f ? -127 : (int)r);
            }
            q[b * BLOCK + j] = (int8_t)v;
        }
        for (int j = 0; j < BLOCK / 2; j++) {
            qe[b * 16 + j] = q[b * BLOCK + 2 * j];
            qo[b * 16 + j] = q[b * BLOCK + 2 * j + 1];
        }
        for (int l = 0; l < 8; l++) {
            int32_t s = 0;
            for (int j = 0; j < 4; j++) s += q[b * BLOCK + 4 * l + j];
            qs8[b * 8 + l] = s;
        }
        for (int l = 0; l < 4; l++) qs4[b * 4 + l] = qs8[b * 8 + 2 * l] + qs8[b * 8 + 2 * l + 1];
        d[b] = db;
    }
}

/* The 16 accumulators' tree sum. */
static float tree16(const float *acc) {
    float h[8];
    for (int i = 0; i < 8; i++) h[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) h[i] = h[i] + h[i + 4];
    for (int i = 0; i < 2; i++) h[i] = h[i] + h[i + 2];
    return h[0] + h[1];
}

/* One output: weight row w (its scales s, offsets o or NULL) against one quantized row. */
static float dot_plain(const uint8_t *w, int kind, const float *s, const float *o, int64_t per,
                       int64_t nb, const int8_t *q, const float *d, const int32_t *qs4,
                       const int32_t *qs8) {
    const int lpb = kind == 4 ? 4 : 8, bpc = LANES / lpb;
    const int32_t *qs = kind == 4 ? qs4 : qs8;
    float acc[LANES] = {0};
    for (int64_t c = 0; c * bpc < nb; c++) {
        for (int lane = 0; lane < LANES; lane++) {
            int64_t b = c * bpc + lane / lpb;
            int l = lane % lpb;
            float t = 0.0f;
            if (b < nb) {
                int32_t p = 0;
                if (kind == 4) {
                    for (int j = 0; j < 4; j++) {
                        uint8_t byte = w[16 * b + 4 * l + j];
                        p += (int32_t)(byte & 15) * q[BLOCK * b + 8 * l + 2 * j] +
                             (int32_t)(byte >> 4) * q[BLOCK * b + 8 * l + 2 * j + 1];
                    }
                } else {
                    for (int j = 0; j < 4; j++)
                        p += (int32_t)((const int8_t *)w)[BLOCK * b + 4 * l + j] *
                             q[BLOCK * b + 4 * l + j];
                }
                float sd = s[b / per] * d[b];
                t = sd * (float)p;
                if (o) {
                    float od = o[b / per] * d[b];
                    t = t + od * (float)qs[b * lpb + l];
                }
            }
            acc[lane] = acc[lane] + t;
        }
    }
    return tree16(acc);
}

#if INTDOT_VNNI
/* What dot_vnni needs of one quantized row, laid out by lane: d and qs (as floats) of each
 * group of 16 / L blocks, the last group padded with zeros. */
typedef struct {
    const int8_t *q, *qe, *qo;
    const float *dl, *qsl;
} vnni_row;

/* dot_plain with AVX-512 VNNI, for TILE rows (or fewer: count) at once, so each weight load
 * and unpack serves them all: one 64-byte load of codes is a group of 16 / L blocks. gidx maps
 * a lane to its scale among those loaded for its group (up to sn of them, from group b / per). */
#define TILE 4
static inline __attribute__((always_inline)) void dot_vnni(const uint8_t *w, int kind, const void *s, const void *o, int half, int64_t per,
                     int64_t nb, int64_t ng, const vnni_row *rows, int count, __m512i gidx,
                     int sn, float *out) {
    const int lpb = kind == 4 ? 4 : 8, bpc = LANES / lpb;
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0, c = 0; b < nb; b += bpc, c++) {
        int64_t left = nb - b < bpc ? nb - b : bpc;
        __mmask64 bytes = left == bpc ? ~(__mmask64)0
                                      : (((__mmask64)1 << ((kind == 4 ? 16 : 32) * left)) - 1);
        __m512i lo, hi;
        if (kind == 4) {
            __m512i v = _mm512_maskz_loadu_epi8(bytes, w + 16 * b);
            lo = _mm512_and_si512(v, low);
            hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        } else {
            lo = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, w + BLOCK * b), flip);
            hi = lo;
        }
        int64_t g = per == 1 ? b : b / per; /* no division in the common case */
        int64_t have = ng - g < sn ? ng - g : sn; /* never past the row */
        __mmask8 sm = (__mmask8)((1u << have) - 1);
        __m128 s4, o4 = _mm_setzero_ps();
        if (half) { /* halves widen exactly */
            s4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(sm, (const uint16_t *)s + g));
            if (o) o4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(sm, (const uint16_t *)o + g));
        } else {
            s4 = _mm_maskz_loadu_ps(sm, (const float *)s + g);
            if (o) o4 = _mm_maskz_loadu_ps(sm, (const float *)o + g);
        }
        __m512 sl = _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(s4));
        __m512 ol = _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(o4));
        for (int r = 0; r < count; r++) {
            __m512i p;
            __m512 qsl = _mm512_loadu_ps(rows[r].qsl + 16 * c);
            if (kind == 4) {
                p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                        _mm512_maskz_loadu_epi8(bytes, rows[r].qe + 16 * b));
                p = _mm512_dpbusd_epi32(p, hi, _mm512_maskz_loadu_epi8(bytes, rows[r].qo + 16 * b));
            } else {
                p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                        _mm512_maskz_loadu_epi8(bytes, rows[r].q + BLOCK * b));
                /* the +128 taken off: 128 * qs (exact: qs is a small integer as a float) */
                p = _mm512_sub_epi32(p, _mm512_slli_epi32(_mm512_cvtps_epi32(qsl), 7));
            }
            __m512 dl = _mm512_loadu_ps(rows[r].dl + 16 * c);
            __m512 t = _mm512_mul_ps(_mm512_mul_ps(sl, dl), _mm512_cvtepi32_ps(p));
            if (o) t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_mul_ps(ol, dl), qsl));
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
    for (int r = 0; r < count; r++) { /* tree16's sums, in its order, in registers */
        __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
        __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
        __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        out[r] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    }
}
#endif

/* kind | HALF_SCALES: scale and offset are IEEE half floats (uint16), widened per row; the
 * arithmetic is unchanged where the values are halves exactly (GGUF Q4_0/Q4_1/Q8_0 store
 * theirs as halves). */
#define HALF_SCALES 0x100

/* Rows ahead whose codes and scales a row's loop prefetches. */
#define PREFETCH_ROWS 8

static float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0 && man == 0) bits = sign;
    else if (exp == 0) { /* subnormal: normalise */
        exp = 113;
        while (!(man & 1024)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 1023) << 13);
    } else if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* y[M, N] = x[M, K] @ w[N, K]^T, w = scale * code + offset per group (module comment).
 * kind 4: codes uint8 [N, K / 2], two a byte, the even column in the low nibble;
 * kind 8: codes int8 [N, K]. scale, offset: float32 [N, K / group]; offset may be NULL.
 * plain != 0 takes the plain loops even where VNNI is built (bench/intdot.py compares the
 * two). kind may carry HALF_SCALES: scale and offset are then halves.
 * Returns 0; -1 when the arguments do not fit (K or group not a multiple of 32), -2 when
 * memory runs out. */
int intdot_mm(const float *x, int64_t m, int64_t k, const void *codes, int kind,
              const float *scale, const float *offset, int64_t n, int64_t group, float *y,
              int threads, int plain) {
    const int half = (kind & HALF_SCALES) != 0;
    kind &= ~HALF_SCALES;
    if (k <= 0 || k % BLOCK || group <= 0 || group % BLOCK || k % group ||
        (kind != 4 && kind != 8) || m < 0 || n < 0)
        return -1;
    const int64_t nb = k / BLOCK, ng = k / group, per = group / BLOCK;
    int8_t *q = malloc((size_t)(m * k * 2 + 64));
    float *d = malloc((size_t)(m * nb + 4) * sizeof(float));
    int32_t *qs = malloc((size_t)(m * nb * 12 + 16) * sizeof(int32_t));
    if (!q || !d || !qs) {
        free(q), free(d), free(qs);
        return -2;
    }
    int8_t *qe = q + m * k, *qo = qe + m * k / 2;
    int32_t *qs4 = qs, *qs8 = qs + m * nb * 4;
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, k, q + r * k, qe + r * k / 2, qo + r * k / 2, d + r * nb,
                     qs4 + r * nb * 4, qs8 + r * nb * 8);
    const int64_t row_bytes = kind == 4 ? k / 2 : k;
    const int lpb = kind == 4 ? 4 : 8, bpc = LANES / lpb;
    /* the vectors take a group's scales with one load where groups and lane groups nest */
    const int nests = (bpc % per == 0) || (per % bpc == 0);
    float *lanes = NULL;
#if INTDOT_VNNI
    const int64_t nc = (nb + bpc - 1) / bpc;
    int sn = per >= bpc ? 1 : (int)(bpc / per);
    int32_t gi[LANES];
    for (int lane = 0; lane < LANES; lane++) gi[lane] = per >= bpc ? 0 : (lane / lpb) / (int)per;
    __m512i gidx = _mm512_loadu_si512(gi);
    if (!plain && nests) {
        lanes = calloc((size_t)(m * nc * 32 + 16), sizeof(float));
        if (!lanes) {
            free(q), free(d), free(qs);
            return -2;
        }
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < nb; b++)
                for (int l = 0; l < lpb; l++) {
                    int64_t at = r * nc * 16 + (b / bpc) * 16 + (b % bpc) * lpb + l;
                    lanes[at] = d[r * nb + b];
                    lanes[m * nc * 16 + at] = (float)(kind == 4 ? qs4 : qs8)[(r * nb + b) * lpb + l];
                }
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *w = (const uint8_t *)codes + i * row_bytes;
        const float *s = scale + i * ng;
        const float *o = offset ? offset + i * ng : NULL;
#if INTDOT_VNNI
        if (i + PREFETCH_ROWS < n) { /* a few rows ahead: the streams are short rows */
            const char *ahead = (const char *)codes + (i + PREFETCH_ROWS) * row_bytes;
            for (int64_t c = 0; c < row_bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
            int64_t sb = ng * (half ? 2 : 4);
            const char *sa = (const char *)scale + (i + PREFETCH_ROWS) * sb;
            for (int64_t c = 0; c < sb; c += 64) _mm_prefetch(sa + c, _MM_HINT_T0);
            if (offset) {
                const char *oa = (const char *)offset + (i + PREFETCH_ROWS) * sb;
                for (int64_t c = 0; c < sb; c += 64) _mm_prefetch(oa + c, _MM_HINT_T0);
            }
        }
#endif
        const void *sv = half ? (const void *)((const uint16_t *)scale + i * ng) : (const void *)s;
        const void *ov = !offset ? NULL
                         : half  ? (const void *)((const uint16_t *)offset + i * ng)
                                 : (const void *)o;
        float swide[half ? ng + 4 : 1], owide[half && offset ? ng + 4 : 1];
        if (half && !lanes) {
            const uint16_t *sh = (const uint16_t *)scale + i * ng;
            const uint16_t *oh = offset ? (const uint16_t *)offset + i * ng : NULL;
            for (int64_t g = 0; g < ng; g++) {
                swide[g] = half_to_float(sh[g]);
                if (oh) owide[g] = half_to_float(oh[g]);
            }
            s = swide;
            o = oh ? owide : NULL;
        }
#if INTDOT_VNNI
        if (lanes) {
            for (int64_t r0 = 0; r0 < m; r0 += TILE) {
                int count = m - r0 < TILE ? (int)(m - r0) : TILE;
                vnni_row rows[TILE];
                float out[TILE];
                for (int j = 0; j < count; j++) {
                    int64_t r = r0 + j;
                    rows[j] = (vnni_row){q + r * k, qe + r * k / 2, qo + r * k / 2,
                                         lanes + r * nc * 16, lanes + (m + r) * nc * 16};
                }
                /* constant counts and formats, inlined: the accumulators stay in registers
                 * and the format's branches leave the loop (the bytes are the same either
                 * way: the same operations in the same order) */
#define DOT(KIND, HALF, COUNT) \
    dot_vnni(w, KIND, sv, ov, HALF, per, nb, ng, rows, COUNT, gidx, sn, out)
#define DOTS(KIND, HALF)                \
    if (count == 1)                     \
        DOT(KIND, HALF, 1);             \
    else if (count == TILE)             \
        DOT(KIND, HALF, TILE);          \
    else                                \
        DOT(KIND, HALF, count)
                if (kind == 4 && !half)
                    DOTS(4, 0);
                else if (kind == 4)
                    DOTS(4, 1);
                else if (!half)
                    DOTS(8, 0);
                else
                    DOTS(8, 1);
#undef DOTS
#undef DOT
                for (int j = 0; j < count; j++) y[(r0 + j) * n + i] = out[j];
            }
            continue;
        }
#endif
        for (int64_t r = 0; r < m; r++)
            y[r * n + i] = dot_plain(w, kind, s, o, per, nb, q + r * k, d + r * nb,
                                     qs4 + r * nb * 4, qs8 + r * nb * 8);
    }
    free(lanes);
    (void)plain;
    free(q), free(d), free(qs);
    return 0;
}
