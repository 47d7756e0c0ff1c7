// deepfuse's emulation of CANN's kernel_tiling/kernel_tiling.h: TCubeTiling, the tiling a host
// computes for a Matmul object. deepfuse fills these fields (by their CANN names) itself; the
// real struct has more fields, which deepfuse's host code leaves zero.
#pragma once
#include "deepfuse_emu/types.h"

struct TCubeTiling {
  int32_t usedCoreNum, M, N, Ka, Kb, singleCoreM, singleCoreN, singleCoreK, baseM, baseN, baseK;
  int32_t depthA1, depthB1, stepM, stepN, stepKa, stepKb, isBias, iterateOrder, dbL0A, dbL0B, dbL0C;
};
