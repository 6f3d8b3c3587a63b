/* Internal: the two tables' MLA ops (mla.c; kernels.h has their contract). */
#pragma once
#include "kernels.h"

void mrl_cpu_ref_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                         const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                         int dv, int hd, int interleave);
void mrl_cpu_fast_mla_qkv(float *q, float *k, float *v, const float *qf, const float *kv, const float *kr,
                          const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn, int dr,
                          int dv, int hd, int interleave);
void mrl_cpu_ref_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                             const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn,
                             int dr, int dvd, int hd, int interleave);
void mrl_cpu_fast_mla_qkv_bwd(float *dqf, float *dkv, float *dkr, const float *dq, const float *dk, const float *dv,
                              const int32_t *pos, const float *cos_t, const float *sin_t, int64_t T, int H, int dn,
                              int dr, int dvd, int hd, int interleave);
mrl_status mrl_cpu_ref_mla_paged_attn(const mrl_paged_attn *a);
mrl_status mrl_cpu_fast_mla_paged_attn(const mrl_paged_attn *a);
void mrl_cpu_ref_latent_kv_write(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W,
                                 int bf16);
void mrl_cpu_fast_latent_kv_write(void *cache, const float *rows, const int32_t *slot_mapping, int64_t T, int W,
                                  int bf16);
