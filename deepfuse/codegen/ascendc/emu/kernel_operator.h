// deepfuse's CPU emulation of the AscendC API subset its emitted kernels use. NOT the hardware:
// a strict model of the rules a kernel must keep on Ascend 950 (arch 3510), so generated kernels
// compile with g++ and are checked numerically and for misuse:
//   - the unified buffer (UB) holds at most UB_BYTES (248 KB by default) of queue/buffer space;
//   - DataCopy moves whole 32-byte blocks: a count whose bytes are not a multiple of 32 is the
//     hardware's silent round-down, reported here as an error (use DataCopyPad for tails);
//   - UB tensors start 32-byte aligned; a GM<->UB copy and every vector operand need alignment;
//   - a queue holds at most its depth of enqueued tensors; DeQue needs a prior EnQue;
//   - a tensor allocated from a queue must go back (FreeTensor) before it is allocated again;
//   - hand-overs between the scalar, vector and copy pipes through TBuf memory need
//     SetFlag/WaitFlag (see HardEvent below); queue tensors are synchronised by EnQue/DeQue.
// Errors throw deepfuse_emu::Error; run_blocks() returns 3 with last_error() set.
// Each instruction runs to completion: pipe timing and concurrency, and the cube unit's fractal
// layouts (lib/matmul_intf.h computes in ND), are not modelled.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
typedef uint8_t* GM_ADDR;

namespace deepfuse_emu {
struct Error : std::runtime_error {
  explicit Error(const std::string& m) : std::runtime_error(m) {}
};
inline size_t& ub_limit() { static size_t v = 248 * 1024; return v; }
inline int64_t& block_idx() { static int64_t v = 0; return v; }
inline int64_t& block_num() { static int64_t v = 1; return v; }
constexpr size_t BLOCK = 32;
// unsynchronised hand-overs between the AI core's pipes (scalar S, vector V, copy-in MTE2,
// copy-out MTE3) that the kernel has not yet waited for: a bit per HardEvent
// per UB buffer (its TQue / TBuf), the events written there and not yet waited for
inline std::map<const void*, unsigned>& pending() { static std::map<const void*, unsigned> v; return v; }
}  // namespace deepfuse_emu

namespace AscendC {
using deepfuse_emu::Error;
using half = _Float16;
// bf16 in 16 bits: from float rounding to nearest even (NaN kept quiet), to float exactly
struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
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
typedef int event_t;
inline const char* event_name(HardEvent e) {
  switch (e) {
    case HardEvent::V_S: return "V_S"; case HardEvent::S_V: return "S_V"; case HardEvent::MTE2_V: return "MTE2_V";
    case HardEvent::V_MTE3: return "V_MTE3"; case HardEvent::S_MTE3: return "S_MTE3";
    case HardEvent::MTE3_S: return "MTE3_S"; default: return "MTE3_V";
  }
}
inline void raise_event(const void* buf, HardEvent e) { deepfuse_emu::pending()[buf] |= (unsigned)e; }
inline void need_synced(const void* buf, HardEvent e, const std::string& what) {
  auto it = deepfuse_emu::pending().find(buf);
  if (it != deepfuse_emu::pending().end() && (it->second & (unsigned)e))
    throw Error(what + " without a WaitFlag<HardEvent::" + event_name(e) + ">: a pipe race on the hardware");
}
inline unsigned& flags_set() { static unsigned v = 0; return v; }
template <HardEvent E>
void SetFlag(event_t) { flags_set() |= (unsigned)E; }
template <HardEvent E>
void WaitFlag(event_t) {
  if (!(flags_set() & (unsigned)E)) throw Error(std::string("WaitFlag<") + event_name(E) + "> without its SetFlag");
  flags_set() &= ~(unsigned)E;
  for (auto& kv : deepfuse_emu::pending()) kv.second &= ~(unsigned)E;
}
enum PipeType { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
template <PipeType P>
void PipeBarrier() { if (P == PIPE_ALL) deepfuse_emu::pending().clear(); }

inline int64_t GetBlockIdx() { return deepfuse_emu::block_idx(); }
inline int64_t GetBlockNum() { return deepfuse_emu::block_num(); }

// TPosition: where a tensor lives (GM; the vector unit's UB queues; the cube unit's L1 / L0 levels)
enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, CO1, CO2 };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE, CAST_RINT };

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(T* p, uint32_t n, const void* owner, bool queued = false)
      : ptr_(p), size_(n), owner_(owner), queued_(queued) {}
  T GetValue(uint32_t i) const {
    check(i);
    need_synced(owner_, HardEvent::V_S, "a scalar GetValue of a vector op's result");
    return ptr_[i];
  }
  void SetValue(uint32_t i, T v) {
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
    if (ptr_ == nullptr) throw Error("use of an unallocated LocalTensor");
    if (i >= size_) throw Error("LocalTensor index " + std::to_string(i) + " past its " + std::to_string(size_) + " elements");
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
    if (off > size_) throw Error("GlobalTensor offset " + std::to_string(off) + " past its " + std::to_string(size_) + " elements");
    GlobalTensor g; g.ptr_ = ptr_ + off; g.size_ = size_ - off; return g;
  }
  T GetValue(uint64_t i) const { if (i >= size_) throw Error("GlobalTensor read out of range"); return ptr_[i]; }
  void SetValue(uint64_t i, T v) const { if (i >= size_) throw Error("GlobalTensor write out of range"); ptr_[i] = v; }
  T* data() const { return ptr_; }
  uint64_t GetSize() const { return size_; }

 private:
  T* ptr_ = nullptr;
  uint64_t size_ = 0;
};

// ---- unified buffer: TPipe hands out 32-byte aligned regions; TQue/TBuf own them ----------
class TPipe;
inline TPipe*& current_pipe() { static TPipe* p = nullptr; return p; }

class TPipe {
 public:
  TPipe() : ub_(deepfuse_emu::ub_limit() + deepfuse_emu::BLOCK) { current_pipe() = this; }
  uint8_t* carve(size_t bytes, const char* what) {
    size_t aligned = (bytes + deepfuse_emu::BLOCK - 1) / deepfuse_emu::BLOCK * deepfuse_emu::BLOCK;
    if (used_ + aligned > deepfuse_emu::ub_limit())
      throw Error(std::string("unified buffer overflow: ") + what + " asks " + std::to_string(aligned) + " bytes, " +
                  std::to_string(deepfuse_emu::ub_limit() - used_) + " of " + std::to_string(deepfuse_emu::ub_limit()) + " left");
    uint8_t* base = ub_.data() + (deepfuse_emu::BLOCK - (uintptr_t)ub_.data() % deepfuse_emu::BLOCK) % deepfuse_emu::BLOCK;
    uint8_t* p = base + used_;
    used_ += aligned;
    return p;
  }
  template <class Q>
  void InitBuffer(Q& q, int num, uint32_t bytes) { q.init(*this, num, bytes); }
  template <class B>
  void InitBuffer(B& buf, uint32_t bytes) { buf.init(*this, 1, bytes); }
  size_t used() const { return used_; }
  event_t FetchEventID(HardEvent) { return 0; }

 private:
  std::vector<uint8_t> ub_;
  size_t used_ = 0;
};

inline TPipe* GetTPipePtr() { return current_pipe(); }

template <QuePosition POS, int DEPTH>
class TQue {
 public:
  void init(TPipe& pipe, int num, uint32_t bytes) {
    if (num < 1 || num > 2) throw Error("TQue buffer count must be 1 or 2 (double buffering), got " + std::to_string(num));
    for (int i = 0; i < num; i++) slots_.push_back({pipe.carve(bytes, "TQue"), bytes, false});
  }
  template <typename T>
  LocalTensor<T> AllocTensor() {
    for (auto& s : slots_)
      if (!s.busy) { s.busy = true; return LocalTensor<T>((T*)s.ptr, s.bytes / sizeof(T), this, true); }
    throw Error("AllocTensor on a queue whose buffers are all in use (FreeTensor missing?)");
  }
  template <typename T>
  void EnQue(const LocalTensor<T>& t) {
    if (t.owner() != this) throw Error("EnQue of a tensor from another queue");
    if ((int)queued_.size() >= DEPTH) throw Error("EnQue past the queue depth " + std::to_string(DEPTH));
    queued_.push_back((uint8_t*)t.data());
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    if (queued_.empty()) throw Error("DeQue before EnQue: the queue is empty");
    uint8_t* p = queued_.front();
    queued_.pop_front();
    for (auto& s : slots_)
      if (s.ptr == p) return LocalTensor<T>((T*)p, s.bytes / sizeof(T), this, true);
    throw Error("DeQue of an unknown buffer");
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>& t) {
    for (auto& s : slots_)
      if (s.ptr == (uint8_t*)t.data()) {
        if (!s.busy) throw Error("FreeTensor of a buffer that is not allocated");
        s.busy = false;
        return;
      }
    throw Error("FreeTensor of a tensor from another queue");
  }

 private:
  struct Slot { uint8_t* ptr; uint32_t bytes; bool busy; };
  std::vector<Slot> slots_;
  std::deque<uint8_t*> queued_;
};

// a queue whose buffers are copied in and straight out again (no vector stage)
template <QuePosition SRC, QuePosition DST, int DEPTH>
class TQueBind : public TQue<SRC, DEPTH> {};

template <QuePosition POS>
class TBuf {
 public:
  void init(TPipe& pipe, int, uint32_t bytes) { ptr_ = pipe.carve(bytes, "TBuf"); bytes_ = bytes; }
  template <typename T>
  LocalTensor<T> Get() const { return LocalTensor<T>((T*)ptr_, bytes_ / sizeof(T), this); }
  template <typename T>
  LocalTensor<T> Get(uint32_t count) const {
    if (count * sizeof(T) > bytes_) throw Error("TBuf::Get of " + std::to_string(count) + " elements past its " + std::to_string(bytes_) + " bytes");
    return LocalTensor<T>((T*)ptr_, count, this);
  }

 private:
  uint8_t* ptr_ = nullptr;
  uint32_t bytes_ = 0;
};

// ---- data movement -------------------------------------------------------------------------
inline void check_ub_aligned(const void* p, const char* what) {
  if ((uintptr_t)p % deepfuse_emu::BLOCK != 0) throw Error(std::string(what) + ": unified-buffer address not 32-byte aligned");
}
// a vector op reads its sources (scalar writes and TBuf copy-ins must be waited for) and
// writes its destination (scalar reads and TBuf copy-outs of it must then wait)
template <typename T>
void vec_src(const LocalTensor<T>& t, const char* op) {
  need_synced(t.owner(), HardEvent::S_V, std::string("vector ") + op + " of a scalar SetValue's data");
  need_synced(t.owner(), HardEvent::MTE2_V, std::string("vector ") + op + " of data copied into a TBuf");
}
template <typename T>
void vec_dst(const LocalTensor<T>& t, const char* op) {
  vec_src(t, op);
  need_synced(t.owner(), HardEvent::MTE3_V, std::string("vector ") + op + " into a TBuf still being copied out");
  raise_event(t.owner(), HardEvent::V_S);
  raise_event(t.owner(), HardEvent::V_MTE3);
}
template <typename T>
void copied_in(const LocalTensor<T>& dst) {
  if (!dst.queued()) raise_event(dst.owner(), HardEvent::MTE2_V);
}
template <typename T>
void copying_out(const LocalTensor<T>& src) {
  if (src.queued()) return;
  need_synced(src.owner(), HardEvent::V_MTE3, "a copy-out of a vector op's result from a TBuf");
  need_synced(src.owner(), HardEvent::S_MTE3, "a copy-out of a scalar SetValue's data from a TBuf");
  raise_event(src.owner(), HardEvent::MTE3_S);
  raise_event(src.owner(), HardEvent::MTE3_V);
}

template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
  if (count * sizeof(T) % deepfuse_emu::BLOCK != 0)
    throw Error("DataCopy of " + std::to_string(count) + " elements (" + std::to_string(count * sizeof(T)) +
                " bytes) is not whole 32-byte blocks: the hardware rounds it down silently; use DataCopyPad");
  check_ub_aligned(dst.data(), "DataCopy GM->UB");
  if (count > dst.GetSize() || count > src.GetSize()) throw Error("DataCopy GM->UB past a tensor's end");
  std::memcpy(dst.data(), src.data(), count * sizeof(T));
  copied_in(dst);
}
template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  if (count * sizeof(T) % deepfuse_emu::BLOCK != 0)
    throw Error("DataCopy of " + std::to_string(count) + " elements (" + std::to_string(count * sizeof(T)) +
                " bytes) is not whole 32-byte blocks: the hardware rounds it down silently; use DataCopyPad");
  check_ub_aligned(src.data(), "DataCopy UB->GM");
  copying_out(src);
  if (count > src.GetSize() || count > dst.GetSize()) throw Error("DataCopy UB->GM past a tensor's end");
  std::memcpy(dst.data(), src.data(), count * sizeof(T));
}

// a UB -> UB move, on the vector pipe
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  vec_src(src, "DataCopy UB->UB"); vec_dst(dst, "DataCopy UB->UB");
  if (count * sizeof(T) % deepfuse_emu::BLOCK != 0) throw Error("DataCopy UB->UB of a count that is not whole 32-byte blocks");
  check_ub_aligned(dst.data(), "DataCopy UB->UB");
  check_ub_aligned(src.data(), "DataCopy UB->UB");
  if (count > dst.GetSize() || count > src.GetSize()) throw Error("DataCopy UB->UB past a tensor's end");
  std::memmove(dst.data(), src.data(), count * sizeof(T));
}

struct DataCopyExtParams {
  uint16_t blockCount; uint32_t blockLen; uint32_t srcStride; uint32_t dstStride; uint32_t rsv;
};
template <typename T>
struct DataCopyPadExtParams { bool isPad; uint8_t leftPadding; uint8_t rightPadding; T paddingValue; };

// blockCount rows of blockLen bytes; GM strides in bytes, UB rows padded to 32 bytes
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  check_ub_aligned(dst.data(), "DataCopyPad GM->UB");
  uint32_t row = (p.blockLen + deepfuse_emu::BLOCK - 1) / deepfuse_emu::BLOCK * deepfuse_emu::BLOCK;
  if ((uint64_t)p.blockCount * row > dst.GetSize() * sizeof(T)) throw Error("DataCopyPad GM->UB past the UB tensor");
  const uint8_t* s = (const uint8_t*)src.data();
  uint8_t* d = (uint8_t*)dst.data();
  for (uint32_t r = 0; r < p.blockCount; r++) {
    uint64_t off = (uint64_t)r * (p.blockLen + p.srcStride);
    if ((off + p.blockLen) > src.GetSize() * sizeof(T)) throw Error("DataCopyPad GM->UB reads past the global tensor");
    std::memcpy(d + r * row, s + off, p.blockLen);
    if (pad.isPad)
      for (uint32_t b = p.blockLen; b < row; b += sizeof(T)) *(T*)(d + r * row + b) = pad.paddingValue;
  }
  copied_in(dst);
}
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  check_ub_aligned(src.data(), "DataCopyPad UB->GM");
  copying_out(src);
  uint32_t row = (p.blockLen + deepfuse_emu::BLOCK - 1) / deepfuse_emu::BLOCK * deepfuse_emu::BLOCK;
  if ((uint64_t)p.blockCount * row > src.GetSize() * sizeof(T)) throw Error("DataCopyPad UB->GM past the UB tensor");
  uint8_t* d = (uint8_t*)dst.data();
  const uint8_t* s = (const uint8_t*)src.data();
  for (uint32_t r = 0; r < p.blockCount; r++) {
    uint64_t off = (uint64_t)r * (p.blockLen + p.dstStride);
    if ((off + p.blockLen) > dst.GetSize() * sizeof(T)) throw Error("DataCopyPad UB->GM writes past the global tensor");
    std::memcpy(d + off, s + r * row, p.blockLen);
  }
}

// scalar writes to GM go through the data cache; a kernel flushes them before its consumers run
enum class CacheLine { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
template <typename T, CacheLine C>
void DataCacheCleanAndInvalid(const GlobalTensor<T>&) {}

}  // namespace AscendC

#include "kernel_vector.h"  // the vector unit's ops

// the launch loop: runs a kernel once per block index, as the AI cores would
namespace deepfuse_emu {
inline std::string& last_error() { static std::string v; return v; }
// each block starts with its own pipes idle (no pending hand-overs, no flags set)
template <typename F>
void launch(int64_t blocks, F&& body) {
  block_num() = blocks;
  for (int64_t b = 0; b < blocks; b++) {
    block_idx() = b;
    pending().clear();
    AscendC::flags_set() = 0;
    body();
  }
}
// a kernel launch over `blocks` AI cores: 0 on success, 3 with last_error() set on a violation
template <typename F>
uint32_t run_blocks(int64_t blocks, F&& body) {
  try {
    launch(blocks, body);
  } catch (const std::exception& e) {
    last_error() = e.what();
    return 3;
  }
  return 0;
}
}  // namespace deepfuse_emu
