/* Internal: the AdamW element loop, scalar and vectorised. */
#pragma once
#include <stdint.h>
#include "moonrl/optim.h"

/* fp32 coefficients of one step, rounded as PyTorch rounds its scalars. */
typedef struct mrl_adamw_coeffs {
    float decay;      /* 1 - lr * wd (1 for no-decay) */
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float bc2_sqrt;   /* sqrt(1 - beta2^t) */
    float eps;
    float neg_step;   /* -lr / (1 - beta1^t) */
} mrl_adamw_coeffs;

void mrl_adamw_coeffs_init(mrl_adamw_coeffs *c, const mrl_adamw_config *cfg, double lr, int64_t step, int decay);

typedef void (*mrl_adamw_kernel_fn)(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);

void mrl_adamw_kernel_scalar(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);
void mrl_adamw_kernel_avx2(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);
void mrl_adamw_kernel_avx512(float *p, const float *g, float *m, float *v, int64_t n, const mrl_adamw_coeffs *c);
/* The fastest kernel this CPU runs. */
mrl_adamw_kernel_fn mrl_adamw_kernel_best(void);
