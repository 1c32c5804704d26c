/* A whole Llama-family decode step in C (issue 42): an experiment, bench/native_step.py.
 *
 * What a step costs when nothing but arithmetic and memory traffic is left: one call a layer
 * runs the norm, the q/k/v product, rotary (rotate-half), the cache write, attention over the
 * cache, the output product, the residual, the second norm, the gate/up product, SiLU, the
 * down product and the residual; the products are intdot.c's (included below). One row, one
 * sequence, float32 activations and cache. Not bit-defined against shard's forward (it is a
 * measurement of the ceiling, checked against shard's greedy tokens only).
 */
#include "intdot.c"

typedef struct {
    const void *codes;
    const float *scale, *offset;
    int64_t n, k, group;
    int kind;
} product;

static void run(const product *p, const float *x, float *y, int threads) {
    intdot_mm(x, 1, p->k, p->codes, p->kind, p->scale, p->offset, p->n, p->group, y, threads,
              0);
}

static void rmsnorm(const float *x, const float *w, float eps, int64_t d, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) out[i] = w[i] * (x[i] * r);
}

static void rotate(float *v, const float *cos_, const float *sin_, int64_t dh) {
    int64_t h = dh / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cos_[i] - b * sin_[i];
        v[i + h] = b * cos_[i] + a * sin_[i];
    }
}

/* One layer at position pos. x [d] in place. kc, vc: this layer's cache [kv, max_len, dh].
 * scratch: at least 4 * (d + (heads + 2 * kv) * dh + 2 * ffn + max_len) floats. */
int native_layer(float *x, int64_t pos, const product *qkv, const product *o,
                 const product *gate_up, const product *down, const float *norm1,
                 const float *norm2, float eps, int64_t d, int64_t heads, int64_t kv,
                 int64_t dh, int64_t ffn, float *kc, float *vc, int64_t max_len,
                 const float *cos_, const float *sin_, float *scratch, int threads) {
    float *h = scratch, *q = h + d, *att = q + (heads + 2 * kv) * dh, *mid = att + heads * dh;
    float *gu = mid + d, *act = gu + 2 * ffn, *scores = act + ffn;
    rmsnorm(x, norm1, eps, d, h);
    run(qkv, h, q, threads);
    float *k = q + heads * dh, *v = k + kv * dh;
    for (int64_t i = 0; i < heads; i++) rotate(q + i * dh, cos_, sin_, dh);
    for (int64_t i = 0; i < kv; i++) {
        rotate(k + i * dh, cos_, sin_, dh);
        memcpy(kc + (i * max_len + pos) * dh, k + i * dh, (size_t)dh * sizeof(float));
        memcpy(vc + (i * max_len + pos) * dh, v + i * dh, (size_t)dh * sizeof(float));
    }
    const float scale = 1.0f / sqrtf((float)dh);
    for (int64_t i = 0; i < heads; i++) {
        const int64_t g = i / (heads / kv);
        const float *qi = q + i * dh, *kg = kc + g * max_len * dh, *vg = vc + g * max_len * dh;
        float top = -INFINITY;
        for (int64_t t = 0; t <= pos; t++) {
            float s = 0.0f;
            for (int64_t j = 0; j < dh; j++) s += qi[j] * kg[t * dh + j];
            scores[t] = s * scale;
            if (scores[t] > top) top = scores[t];
        }
        float sum = 0.0f;
        for (int64_t t = 0; t <= pos; t++) {
            scores[t] = expf(scores[t] - top);
            sum += scores[t];
        }
        float *out = att + i * dh;
        for (int64_t j = 0; j < dh; j++) out[j] = 0.0f;
        for (int64_t t = 0; t <= pos; t++) {
            float w = scores[t] / sum;
            for (int64_t j = 0; j < dh; j++) out[j] += w * vg[t * dh + j];
        }
    }
    run(o, att, mid, threads);
    for (int64_t i = 0; i < d; i++) x[i] += mid[i];
    rmsnorm(x, norm2, eps, d, h);
    run(gate_up, h, gu, threads);
    for (int64_t i = 0; i < ffn; i++) {
        float g = gu[i];
        act[i] = g / (1.0f + expf(-g)) * gu[ffn + i];
    }
    run(down, act, mid, threads);
    for (int64_t i = 0; i < d; i++) x[i] += mid[i];
    return 0;
}

/* Every layer, then the final norm and the head's logits. layers: n_layers blocks of
 * (qkv, o, gate_up, down) products; norms: n_layers pairs of [d]. */
int native_step(float *x, int64_t pos, int64_t n_layers, const product *layers,
                const float *const *norms, const float *final_norm, const product *head,
                float eps, int64_t d, int64_t heads, int64_t kv, int64_t dh, int64_t ffn,
                float *kcache, float *vcache, int64_t max_len, const float *cos_,
                const float *sin_, float *scratch, float *logits, int threads) {
    const int64_t per_layer = kv * max_len * dh;
    for (int64_t l = 0; l < n_layers; l++) {
        const product *p = layers + 4 * l;
        native_layer(x, pos, p, p + 1, p + 2, p + 3, norms[2 * l], norms[2 * l + 1], eps, d,
                     heads, kv, dh, ffn, kcache + l * per_layer, vcache + l * per_layer,
                     max_len, cos_, sin_, scratch, threads);
    }
    rmsnorm(x, final_norm, eps, d, scratch);
    run(head, scratch, logits, threads);
    return 0;
}
