// deepfuse's emulator: what the emulated AscendC API asks of the emulator runtime
// (runtime/runtime.cpp, compiled apart, with the host's C++ library). Kernels reach this only
// through kernel_operator.h; everything that needs the host library (strings, containers,
// streams, error text) lives behind these declarations.
#pragma once
#include "deepfuse_emu/types.h"

namespace deepfuse_emu {
// a violation of the API's rules: fail() formats it and throws; the launch reports it
struct Error {
  char what[512];
};
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// the cores a kernel starts on (GetBlockIdx semantics per mode, as the AscendC docs define them):
//   AIV_ONLY  (__vector__)                 blockDim vector cores, GetBlockIdx in [0, blockDim)
//   AIC_ONLY  (__cube__)                   blockDim cube cores, GetBlockIdx in [0, blockDim)
//   MIX_1_1   (__mix__(1, 1))              blockDim groups of 1 AIC + 1 AIV, both in [0, blockDim)
//   MIX_1_2   (__mix__(1, 2), and the high-level Matmul API without ASCENDC_CUBE_ONLY)
//             blockDim groups of 1 AIC + 2 AIV: the AIV side runs with GetBlockIdx in
//             [0, 2 * blockDim), GetSubBlockIdx 0 / 1, and AIV i's Matmul runs on cube core i / 2
enum class Mode : int { AIV_ONLY, AIC_ONLY, MIX_1_1, MIX_1_2 };
enum class Core : int { AIV, AIC };
struct Block {
  Core core;
  int64_t idx, num, sub_idx, sub_num, ratio;
};
const Block& block();  // the block running now
void need_core(Core core, const char* what);  // fails unless the running block is on `core`

uint8_t* ub_arena();  // the running vector core's unified buffer: 32-byte aligned, ub_limit() bytes
size_t ub_limit();

// pipe hand-overs: events raised on a UB buffer (its TQue / TBuf) and not yet waited for
void raise_event(const void* owner, unsigned events);
bool is_pending(const void* owner, unsigned event);
void set_flag(unsigned event);
bool wait_flag(unsigned event);  // false without a SetFlag; else clears the event everywhere
void barrier_all();

// a Matmul computes on the cube core that runs (matmul 1: ASCENDC_CUBE_ONLY) or serves (matmul 2:
// the mixed client) this block
void cube_work(int matmul);

// a kernel launch queued on `stream` (nullptr: the default stream); it runs at
// aclrtSynchronizeStream, in queue order with the stream's copies. Its mode comes from its
// entry's qualifier (0 none, 1 __cube__, 2 __vector__, 3 __mix__(1, 1), 4 __mix__(1, 2)) and
// its Matmul objects (0 none, 1 ASCENDC_CUBE_ONLY, 2 the mixed client); a contradiction fails the launch
void enqueue(void* stream, int qualifier, int matmul, uint32_t blocks, void (*run)(void*), void* ctx,
             void (*release)(void*));

// host side only (the emulated HCCL, runtime/hccl.cpp): a task queued on `stream` that runs
// run(ctx) at aclrtSynchronizeStream, in order with the stream's kernels and copies (a fail()
// inside fails the synchronisation with its message); false for a stream aclrtCreateStream did
// not make (ctx is released then)
bool enqueue_task(void* stream, void (*run)(void*), void* ctx, void (*release)(void*));
}  // namespace deepfuse_emu
