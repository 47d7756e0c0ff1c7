// deepfuse's CPU emulation of the AscendC API subset its emitted kernels use. A TEST TOOL, NOT
// THE HARDWARE: a strict model of the rules a kernel must keep on Ascend 950 (arch 3510), so
// generated kernels compile with g++ and are checked numerically and for misuse. Declarations
// follow Huawei's public AscendC headers (asc-devkit: include/basic_api/*.h) where deepfuse uses
// them; the behaviour is deepfuse's own model.
//
// A kernel sees only these headers: it is compiled with -nostdinc and `double` poisoned, so host
// C++ (<cmath>, sqrt(double), INFINITY, std::) fails to compile here as it would for the AI core.
// Checked:
//   - the unified buffer (UB) holds at most ub_limit() (248 KB by default) of queue/buffer space;
//   - DataCopy moves whole 32-byte blocks: a count whose bytes are not a multiple of 32 is the
//     hardware's silent round-down, reported here as an error (use DataCopyPad for tails);
//   - UB tensors start 32-byte aligned; a GM<->UB copy and every vector operand need alignment;
//   - a queue holds at most its depth of enqueued tensors; DeQue needs a prior EnQue;
//   - a tensor allocated from a queue must go back (FreeTensor) before it is allocated again;
//   - hand-overs between the scalar, vector and copy pipes through TBuf memory need
//     SetFlag/WaitFlag (see HardEvent below); queue tensors are synchronised by EnQue/DeQue;
//   - ReduceSum's operand overlap rule (only dst and sharedTmpBuffer may overlap) and its
//     sharedTmpBuffer size (kernel_vector.h);
//   - kernel modes: a __cube__ kernel has no vector work, a __vector__ kernel no Matmul, and
//     GetBlockIdx ranges as the launch's mode defines (deepfuse_emu/runtime.h);
//   - launches queue on their stream and run at aclrtSynchronizeStream, after the copies queued
//     before them; a blocking aclrtMemcpy is not ordered with them (host/acl/acl.h).
// NOT modelled (a kernel can be wrong here and pass):
//   - cores run one after another, so races between cores (two blocks writing one GM range, one
//     reading what another has not written yet) are invisible;
//   - GM addresses and copy offsets are not checked for alignment, only UB ones;
//   - event ids: SetFlag / WaitFlag are tracked per HardEvent kind whatever the id;
//   - each instruction runs to completion: pipe timing and concurrency; the cube unit's fractal
//     layouts (lib/matmul_intf.h computes in ND); a mixed kernel's own AIC-side code (the MIX
//     modes model the Matmul API's AIV client with its AIC server only).
// Errors throw deepfuse_emu::Error; the stream's synchronisation reports the message.
#pragma once
#include "deepfuse_emu/runtime.h"

#define __aicore__
#define __global__
#define __gm__
#define __cube__
#define __vector__
#define __mix__(cube, vec)
#define GM_ADDR __gm__ uint8_t*

namespace AscendC {
using deepfuse_emu::fail;
using half = _Float16;
// bf16 in 16 bits: from float rounding to nearest even (NaN kept quiet), to float exactly
struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
  }
};

// ---- pipe synchronisation: SetFlag/WaitFlag on a HardEvent hands work from one pipe to another.
// Queue tensors are synchronised by EnQue/DeQue; TBuf tensors and scalar reads are not, so:
// a scalar GetValue after a vector op needs V_S; a vector op after a scalar SetValue needs S_V;
// a vector op after a GM->UB copy into a TBuf needs MTE2_V; a UB->GM copy of a TBuf tensor after a
// vector op needs V_MTE3 (S_MTE3 after a scalar SetValue); and the reverse: a TBuf being copied
// out must not be overwritten by the scalar unit before MTE3_S, nor by the vector unit before
// MTE3_V. The emulator reports each missing wait.
enum class HardEvent : unsigned { V_S = 1, S_V = 2, MTE2_V = 4, V_MTE3 = 8, S_MTE3 = 16, MTE3_S = 32, MTE3_V = 64 };
enum event_t : int { EVENT_ID0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7 };
using TEventID = int8_t;
inline const char* event_name(HardEvent e) {
  switch (e) {
    case HardEvent::V_S: return "V_S"; case HardEvent::S_V: return "S_V"; case HardEvent::MTE2_V: return "MTE2_V";
    case HardEvent::V_MTE3: return "V_MTE3"; case HardEvent::S_MTE3: return "S_MTE3";
    case HardEvent::MTE3_S: return "MTE3_S"; default: return "MTE3_V";
  }
}
inline void raise_event(const void* buf, HardEvent e) { deepfuse_emu::raise_event(buf, (unsigned)e); }
// `what` happens to a buffer with event e pending; `op` names the vector op doing it, if one is
inline void need_synced(const void* buf, HardEvent e, const char* what, const char* op = nullptr) {
  if (deepfuse_emu::is_pending(buf, (unsigned)e))
    fail("%s%s%s without a WaitFlag<HardEvent::%s>: a pipe race on the hardware", op ? "vector " : "", op ? op : "",
         what, event_name(e));
}
template <HardEvent E>
void SetFlag(int32_t) { deepfuse_emu::set_flag((unsigned)E); }
template <HardEvent E>
void WaitFlag(int32_t) {
  if (!deepfuse_emu::wait_flag((unsigned)E)) fail("WaitFlag<%s> without its SetFlag", event_name(E));
}
enum pipe_t { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
template <pipe_t P>
void PipeBarrier() {
  static_assert(P != PIPE_S, "PipeBarrier does not synchronise PIPE_S: use SetFlag/WaitFlag");
  if (P == PIPE_ALL) deepfuse_emu::barrier_all();
}

inline int64_t GetBlockIdx() { return deepfuse_emu::block().idx; }
inline int64_t GetBlockNum() { return deepfuse_emu::block().num; }
inline int64_t GetSubBlockIdx() { return deepfuse_emu::block().sub_idx; }
inline int64_t GetSubBlockNum() { return deepfuse_emu::block().sub_num; }
inline int64_t GetTaskRatio() { return deepfuse_emu::block().ratio; }

// TPosition: where a tensor lives (GM; the vector unit's UB queues; the cube unit's L1 / L0 levels)
enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, CO1, CO2 };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE, CAST_RINT };

template <typename T>
class LocalTensor {
 public:
  using PrimType = T;
  LocalTensor() = default;
  LocalTensor(T* p, uint32_t n, const void* owner, bool queued = false)
      : ptr_(p), size_(n), owner_(owner), queued_(queued) {}
  T GetValue(uint32_t i) const {
    check(i);
    need_synced(owner_, HardEvent::V_S, "a scalar GetValue of a vector op's result");
    return ptr_[i];
  }
  void SetValue(uint32_t i, T v) const {
    check(i);
    need_synced(owner_, HardEvent::MTE3_S, "a scalar SetValue into a TBuf still being copied out");
    ptr_[i] = v;
    raise_event(owner_, HardEvent::S_V);
    raise_event(owner_, HardEvent::S_MTE3);
  }
  bool queued() const { return queued_; }
  T* data() const { return ptr_; }
  uint32_t GetSize() const { return size_; }
  const void* owner() const { return owner_; }
  LocalTensor operator[](uint32_t off) const { check(off); return LocalTensor(ptr_ + off, size_ - off, owner_, queued_); }
  template <typename U>
  LocalTensor<U> ReinterpretCast() const { return LocalTensor<U>((U*)ptr_, size_ * sizeof(T) / sizeof(U), owner_, queued_); }

 private:
  void check(uint32_t i) const {
    if (ptr_ == nullptr) fail("use of an unallocated LocalTensor");
    if (i >= size_) fail("LocalTensor index %u past its %u elements", i, size_);
  }
  T* ptr_ = nullptr;
  uint32_t size_ = 0;
  const void* owner_ = nullptr;
  bool queued_ = false;
};

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(__gm__ T* p, uint64_t n) { ptr_ = p; size_ = n; }
  GlobalTensor operator[](uint64_t off) const {
    if (off > size_) fail("GlobalTensor offset %lu past its %lu elements", (unsigned long)off, (unsigned long)size_);
    GlobalTensor g; g.ptr_ = ptr_ + off; g.size_ = size_ - off; return g;
  }
  T GetValue(uint64_t i) const { if (i >= size_) fail("GlobalTensor read out of range"); return ptr_[i]; }
  void SetValue(uint64_t i, T v) const { if (i >= size_) fail("GlobalTensor write out of range"); ptr_[i] = v; }
  T* data() const { return ptr_; }
  uint64_t GetSize() const { return size_; }

 private:
  T* ptr_ = nullptr;
  uint64_t size_ = 0;
};

// ---- unified buffer: TPipe hands out 32-byte aligned regions; TQue/TBuf own them ----------
class TPipe;
template <TPosition POS>
class TBuf;
inline TPipe*& current_pipe() { static TPipe* p = nullptr; return p; }
inline bool vector_position(TPosition p) { return p == TPosition::VECIN || p == TPosition::VECOUT || p == TPosition::VECCALC; }

class TPipe {
 public:
  TPipe() {
    if (current_pipe() != nullptr) fail("a second TPipe in one kernel: TPipe owns the core's buffers, create it once");
    current_pipe() = this;
  }
  ~TPipe() { current_pipe() = nullptr; }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;
  uint8_t* carve(size_t bytes, const char* what) {
    deepfuse_emu::need_core(deepfuse_emu::Core::AIV, "a unified-buffer TQue / TBuf");
    size_t aligned = (bytes + 31) / 32 * 32, limit = deepfuse_emu::ub_limit();
    if (used_ + aligned > limit)
      fail("unified buffer overflow: %s asks %lu bytes, %lu of %lu left", what, (unsigned long)aligned,
           (unsigned long)(limit - used_), (unsigned long)limit);
    uint8_t* p = deepfuse_emu::ub_arena() + used_;
    used_ += aligned;
    return p;
  }
  template <class Q>
  void InitBuffer(Q& q, uint8_t num, uint32_t bytes) { q.init(*this, num, bytes); }
  template <TPosition POS>
  void InitBuffer(TBuf<POS>& buf, uint32_t bytes) { buf.init(*this, 1, bytes); }
  size_t used() const { return used_; }
  TEventID FetchEventID(HardEvent) { return 0; }

 private:
  size_t used_ = 0;
};

inline TPipe* GetTPipePtr() { return current_pipe(); }

template <TPosition POS, int32_t DEPTH>
class TQue {
  static_assert(DEPTH >= 1 && DEPTH <= 8, "queue depth");

 public:
  void init(TPipe& pipe, int num, uint32_t bytes) {
    if (num < 1 || num > 2) fail("TQue buffer count must be 1 or 2 (double buffering), got %d", num);
    for (int i = 0; i < num; i++) slots_[i] = {pipe.carve(bytes, "TQue"), bytes, false};
    nslots_ = num;
  }
  template <typename T>
  LocalTensor<T> AllocTensor() {
    for (int i = 0; i < nslots_; i++)
      if (!slots_[i].busy) { slots_[i].busy = true; return LocalTensor<T>((T*)slots_[i].ptr, slots_[i].bytes / sizeof(T), this, true); }
    fail("AllocTensor on a queue whose buffers are all in use (FreeTensor missing?)");
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) {
    if (t.owner() != this) fail("EnQue of a tensor from another queue");
    if (count_ >= DEPTH) fail("EnQue past the queue depth %d", (int)DEPTH);
    queued_[(head_ + count_++) % DEPTH] = (uint8_t*)t.data();
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    if (count_ == 0) fail("DeQue before EnQue: the queue is empty");
    uint8_t* p = queued_[head_];
    head_ = (head_ + 1) % DEPTH;
    count_--;
    for (int i = 0; i < nslots_; i++)
      if (slots_[i].ptr == p) return LocalTensor<T>((T*)p, slots_[i].bytes / sizeof(T), this, true);
    fail("DeQue of an unknown buffer");
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>& t) {
    for (int i = 0; i < nslots_; i++)
      if (slots_[i].ptr == (uint8_t*)t.data()) {
        if (!slots_[i].busy) fail("FreeTensor of a buffer that is not allocated");
        slots_[i].busy = false;
        return;
      }
    fail("FreeTensor of a tensor from another queue");
  }

 private:
  struct Slot { uint8_t* ptr; uint32_t bytes; bool busy; };
  Slot slots_[2] = {};
  int nslots_ = 0;
  uint8_t* queued_[DEPTH] = {};
  int head_ = 0, count_ = 0;
};

// a queue whose buffers are copied in and straight out again (no vector stage)
template <TPosition SRC, TPosition DST, int32_t DEPTH>
class TQueBind : public TQue<SRC, DEPTH> {};

template <TPosition POS>
class TBuf {
 public:
  void init(TPipe& pipe, int, uint32_t bytes) { ptr_ = pipe.carve(bytes, "TBuf"); bytes_ = bytes; }
  template <typename T>
  LocalTensor<T> Get() const { return LocalTensor<T>((T*)ptr_, bytes_ / sizeof(T), this); }
  template <typename T>
  LocalTensor<T> Get(uint32_t count) const {
    if (count * sizeof(T) > bytes_) fail("TBuf::Get of %u elements past its %u bytes", count, bytes_);
    return LocalTensor<T>((T*)ptr_, count, this);
  }

 private:
  uint8_t* ptr_ = nullptr;
  uint32_t bytes_ = 0;
};

// scalar writes to GM go through the data cache; a kernel flushes them before its consumers run
enum class CacheLine { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
template <typename T, CacheLine C>
void DataCacheCleanAndInvalid(const GlobalTensor<T>&) {}

}  // namespace AscendC

#include "kernel_data_copy.h"  // DataCopy, DataCopyPad and their parameter structs
#include "kernel_vector.h"     // the vector unit's ops

namespace deepfuse_emu {
// what a kernel's `name<<<blockDim, 0, stream>>>(args...)` becomes in the emulator (emulate.py
// rewrites the launch): the kernel and its arguments, copied, queued on the stream
template <class... P, class... A>
void launch_kernel(int qualifier, int matmul, uint32_t blocks, uint32_t, void* stream, void (*kernel)(P...), A... args) {
  auto call = [=]() { kernel(args...); };
  using Call = decltype(call);
  enqueue(stream, qualifier, matmul, blocks, [](void* c) { (*(Call*)c)(); }, new Call(call),
          [](void* c) { delete (Call*)c; });
}
}  // namespace deepfuse_emu
