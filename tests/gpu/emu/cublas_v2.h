// A stand-in for <cublas_v2.h> (tests/gpu/emu): cublasGemmEx is in cublasLt.h here.
#pragma once
#include "cublasLt.h"
