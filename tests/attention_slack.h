/* The bound on attention's rounding in a low precision, shared by the CPU's kernel test
 * (test_kernels_lowp.c) and the GPU's (test_cuda.c). */
#ifndef TDM_ATTENTION_SLACK_H
#define TDM_ATTENTION_SLACK_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* The slack of attention in a low precision that rounds P and dS before their products, as
 * the CPU's bf16 path (cpu_attention.c) and the GPU's bf16 and f16 paths (cuda_attention.cu)
 * do, element by element, from a reference in double on the f32 twin's values: u (2^-8 for
 * bf16, 2^-11 for f16) of each term P and dS enter, and the products sum in another order
 * than sgemm's (eps, at least 4 (2 max(T, hs) + 8) 2^-24, of each term's magnitude, which also
 * covers the scores' own reordering as it moves P). Where d_from_y, the backward's row sums
 * D = sum P dP come from the rounded output as rowsum(dy y), as the GPU's fused kernels take
 * them (cuda_flash.cu, FlashAttention-2's way): u of each term dy y more. qkv [B, T, 3C] and
 * dy [B, T, C] f32; fills sy [B, T, C], slse [B, nh, T], sg [B, T, 3C]. */
static inline void attention_slack(const float *qkv, const float *dy, int64_t B, int64_t T,
                                   int64_t C, int64_t nh, double u, bool d_from_y, double *sy,
                                   double *slse, double *sg) {
    const int64_t hs = C / nh, C3 = 3 * C;
    const double scale = 1.0 / sqrt((double)hs);
    const double eps = fmax(1e-5, 4 * (2 * (double)(T > hs ? T : hs) + 8) * 0x1p-24);
    double *P = malloc(sizeof(double) * (size_t)(T * T)),
           *dP = malloc(sizeof(double) * (size_t)(T * T));
    double *dot = malloc(sizeof(double) * (size_t)T), *ddot = malloc(sizeof(double) * (size_t)T);
    for (int64_t i = 0; i < B * T * C3; i++) sg[i] = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < nh; h++) {
            const float *q = qkv + b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
            const float *g = dy + b * T * C + h * hs;
            for (int64_t t = 0; t < T; t++) {
                double mx = -INFINITY, sum = 0, worst = 0;
                for (int64_t j = 0; j <= t; j++) {
                    double sc = 0, mag = 0, dp = 0;
                    for (int64_t i = 0; i < hs; i++) {
                        sc += (double)q[t * C3 + i] * k[j * C3 + i];
                        mag += fabs((double)q[t * C3 + i] * k[j * C3 + i]);
                        dp += (double)g[t * C + i] * v[j * C3 + i];
                    }
                    P[t * T + j] = sc * scale, dP[t * T + j] = dp;
                    mx = fmax(mx, sc * scale), worst = fmax(worst, mag * scale);
                }
                for (int64_t j = 0; j <= t; j++) sum += exp(P[t * T + j] - mx);
                dot[t] = 0;
                for (int64_t j = 0; j <= t; j++) {
                    P[t * T + j] = exp(P[t * T + j] - mx) / sum;
                    dot[t] += P[t * T + j] * dP[t * T + j];
                }
                double lse = mx + log(sum);
                slse[(b * nh + h) * T + t] = (2 * hs + 8) * 0x1p-24 * worst + 0x1p-22 * fabs(lse);
                ddot[t] = 0;
                for (int64_t c = 0; c < hs; c++) {
                    double acc = 0; /* >= |y_tc| */
                    for (int64_t j = 0; j <= t; j++)
                        acc += P[t * T + j] * fabs((double)v[j * C3 + c]);
                    sy[b * T * C + t * C + h * hs + c] = (u + eps) * acc;
                    if (d_from_y) ddot[t] += u * fabs((double)g[t * C + c]) * acc;
                }
            }
            /* dS = P (dP - dot); its perturbation is within eps of P (|dP| + |dot|) */
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j <= t; j++) {
                    double p = P[t * T + j], ds = fabs(p * (dP[t * T + j] - dot[t]));
                    double dmag = p * (fabs(dP[t * T + j]) + fabs(dot[t]));
                    double err = u * ds + eps * dmag + p * ddot[t];
                    for (int64_t c = 0; c < hs; c++) {
                        double *gq = sg + b * T * C3 + h * hs + c;
                        gq[t * C3] += scale * err * fabs((double)k[j * C3 + c]);
                        gq[j * C3 + C] += scale * err * fabs((double)q[t * C3 + c]);
                        gq[j * C3 + 2 * C] += (u + eps) * p * fabs((double)g[t * C + c]);
                    }
                }
        }
    free(P), free(dP), free(dot), free(ddot);
}

#endif
