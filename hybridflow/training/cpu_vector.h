/* What the trainer's CPU kernels share (cpu_attention.c, cpu_lm_head.c, cpu_layer_ops.c): 16-lane float32 vectors in
 * GCC's vector extensions (one AVX-512 register), their loads and stores from float32 or bf16, reductions in a fixed
 * lane order, and exp. */
#ifndef HYBRIDFLOW_CPU_VECTOR_H
#define HYBRIDFLOW_CPU_VECTOR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define V 16 /* float32 lanes of a vector */

typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));

static inline vf vload(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}
static inline void vstore(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
/* NaN passes through both (a comparison with NaN is false, so a is kept) */
static inline vf vmax(vf a, vf b) { return vselect(a < b, b, a); }
static inline vf vmin(vf a, vf b) { return vselect(a > b, b, a); }
static inline float hsum(vf x) { /* the lanes in order */
    float s = 0.0f;
    for (int i = 0; i < V; i++) s += x[i];
    return s;
}
static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* exp for float32 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial); below -87
 * (an underflow, or -inf: a masked key) exactly 0. */
static inline vf vexp(vf x) {
    const vi dead = x < vsplat(-87.0f);
    x = vmin(vmax(x, vsplat(-87.0f)), vsplat(88.0f));
    const vf magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    const vf t = x * 1.44269504088896341f + magic;
    const vf n = t - magic;
    const vi e = (vi)t - (vi)magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    return vselect(dead, vsplat(0.0f), p * (vf)((e + 127) << 23));
}

/* Elements i .. i + 15 of a bf16 (bf16 != 0) or float32 array of n, as float32; lanes past n 0. */
static inline vf load_lanes(const void *p, int bf16, int64_t i, int64_t n) {
    if (i + V <= n) {
        if (bf16) {
            vh h;
            memcpy(&h, (const uint16_t *)p + i, sizeof h);
            return (vf)(__builtin_convertvector(h, vu) << 16);
        }
        return vload((const float *)p + i);
    }
    vf x = vsplat(0.0f);
    for (int64_t j = 0; i + j < n; j++) {
        if (bf16) {
            const uint32_t bits = (uint32_t)((const uint16_t *)p)[i + j] << 16;
            memcpy(&x[j], &bits, 4);
        } else {
            x[j] = ((const float *)p)[i + j];
        }
    }
    return x;
}

/* v into elements i .. min(i + 16, n) - 1 of a bf16 (rounded to nearest even, a NaN kept a quiet NaN, as torch's
 * .to(bfloat16)) or float32 array. */
static inline void store_lanes(void *p, int bf16, int64_t i, int64_t n, vf v) {
    const int64_t count = n - i < V ? n - i : V;
    if (bf16) {
        const vu bits = (vu)v;
        vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        const vi nan = v != v;
        rounded = (vu)(((vi)rounded & ~nan) | (nan & 0x7FC0));
        const vh h = __builtin_convertvector(rounded, vh);
        if (count == V) /* a constant size: one vector store (a variable one calls memcpy) */
            memcpy((uint16_t *)p + i, &h, V * 2);
        else
            memcpy((uint16_t *)p + i, &h, count * 2);
    } else if (count == V) {
        memcpy((float *)p + i, &v, V * 4);
    } else {
        memcpy((float *)p + i, &v, count * 4);
    }
}

#endif
