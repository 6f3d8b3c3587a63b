/* Internal: the two tables' AdamW ops (adamw.c): the scalar loop in one
 * pass (reference), the ISA set's loop over slices on the cores (fast). */
#pragma once
#include "kernels.h"

void mrl_cpu_ref_adamw(const mrl_adamw_args *a);
void mrl_cpu_fast_adamw(const mrl_adamw_args *a);
