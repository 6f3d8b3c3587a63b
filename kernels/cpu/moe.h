/* Internal: the two tables' router ops of a sparse layer (moe.c; kernels.h
 * has their contract). */
#pragma once
#include "kernels.h"

void mrl_cpu_ref_moe_route(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                           const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k, int norm);
void mrl_cpu_fast_moe_route(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                            const int16_t *replay, int64_t replay_stride, int64_t T, int E, int k, int norm);
void mrl_cpu_ref_moe_route_grouped(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                                   const float *bias, const int16_t *replay, int64_t replay_stride, int64_t T, int E,
                                   int k, int groups, int topk_group, int norm, float scale);
void mrl_cpu_fast_moe_route_grouped(float *prob, int32_t *sel, float *w, int32_t *how, const float *logits,
                                    const float *bias, const int16_t *replay, int64_t replay_stride, int64_t T, int E,
                                    int k, int groups, int topk_group, int norm, float scale);
void mrl_cpu_moe_group(int32_t *eoff, int32_t *row, int32_t *tok, const int32_t *sel, int64_t A, int E, int k);
