// deepfuse's emulator runtime (see deepfuse_emu/runtime.h and host/acl/acl.h): the running
// block's cores and indices per kernel mode, its unified buffer, the pipe hand-over bookkeeping,
// the streams that queue launches and copies, and the error text. Compiled apart from the
// kernels, with the host's C++ library, so that the kernels never see it. One launch runs at a
// time (no threads): the emulator is a test tool, not a device.
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "acl/acl.h"
#include "deepfuse_emu/runtime.h"

namespace deepfuse_emu {
namespace {
Block g_block{Core::AIV, 0, 1, 0, 1, 1};
size_t g_ub_limit = 248 * 1024;
std::vector<uint8_t> g_ub;
std::map<const void*, unsigned> g_pending;  // per UB buffer, the events raised and not yet waited for
unsigned g_flags = 0;                       // events set (SetFlag) and not yet waited for
std::set<int64_t> g_busy_cubes;             // cube cores that computed a Matmul in the last launch
int64_t g_blocks_run = 0;
std::string g_error;

struct Stream {
  std::deque<std::function<void()>> tasks;  // each throws Error on a violation
};
Stream g_default_stream;
std::set<Stream*> g_streams;
std::map<uintptr_t, size_t> g_pinned;  // aclrtMallocHost allocations: start -> bytes

const char* core_name(Core c) { return c == Core::AIC ? "cube (AIC)" : "vector (AIV)"; }

void run_kernel(Mode mode, uint32_t blocks, void (*run)(void*), void* ctx) {
  g_busy_cubes.clear();
  g_blocks_run = 0;
  int64_t ratio = mode == Mode::MIX_1_2 ? 2 : 1;
  Core core = mode == Mode::AIC_ONLY ? Core::AIC : Core::AIV;
  for (int64_t b = 0; b < (int64_t)blocks * ratio; b++) {
    g_block = Block{core, b, (int64_t)blocks, b % ratio, ratio, ratio};
    g_pending.clear();
    g_flags = 0;
    g_ub.assign(g_ub_limit + 32, 0);
    g_blocks_run++;
    run(ctx);
  }
}

Stream* stream_of(aclrtStream s) {
  if (s == nullptr) return &g_default_stream;
  return g_streams.count((Stream*)s) ? (Stream*)s : nullptr;
}

bool pinned(const void* p, size_t n) {
  auto it = g_pinned.upper_bound((uintptr_t)p);
  if (it == g_pinned.begin()) return false;
  --it;
  return (uintptr_t)p + n <= it->first + it->second;
}
}  // namespace

void fail(const char* fmt, ...) {
  Error e;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e.what, sizeof(e.what), fmt, ap);
  va_end(ap);
  throw e;
}

const Block& block() { return g_block; }

void need_core(Core core, const char* what) {
  if (g_block.core != core)
    fail("%s on a %s core: a kernel running on the %s cores has no %s work (declare its mode: __vector__, "
         "__cube__ or __mix__)", what, core_name(g_block.core), core_name(g_block.core),
         core == Core::AIV ? "vector" : "cube");
}

uint8_t* ub_arena() {
  uint8_t* p = g_ub.data();
  return p + (32 - (uintptr_t)p % 32) % 32;
}
size_t ub_limit() { return g_ub_limit; }

void raise_event(const void* owner, unsigned events) { g_pending[owner] |= events; }
bool is_pending(const void* owner, unsigned event) {
  auto it = g_pending.find(owner);
  return it != g_pending.end() && (it->second & event);
}
void set_flag(unsigned event) { g_flags |= event; }
bool wait_flag(unsigned event) {
  if (!(g_flags & event)) return false;
  g_flags &= ~event;
  for (auto& kv : g_pending) kv.second &= ~event;
  return true;
}
void barrier_all() { g_pending.clear(); }

void cube_work(int matmul) {
  if (matmul == 1 && g_block.core != Core::AIC)
    fail("a Matmul built with ASCENDC_CUBE_ONLY computes on the cube core it runs on; block %ld runs on a %s core",
         (long)g_block.idx, core_name(g_block.core));
  if (matmul == 2 && g_block.core != Core::AIV) fail("the mixed-mode Matmul client runs on a vector core");
  g_busy_cubes.insert(g_block.core == Core::AIC ? g_block.idx : g_block.idx / g_block.ratio);
}

Mode kernel_mode(int qualifier, int matmul) {
  if (qualifier == 1 && matmul == 2)
    fail("a __cube__ kernel whose Matmul is the mixed-mode vector-side client: #define ASCENDC_CUBE_ONLY before "
         "#include \"lib/matmul_intf.h\"");
  if (qualifier == 2 && matmul != 0) fail("a __vector__ kernel with a Matmul object: the cube unit is not a vector core's");
  if (qualifier == 3) return Mode::MIX_1_1;
  if (qualifier == 4 || (qualifier == 0 && matmul == 2)) return Mode::MIX_1_2;
  if (qualifier == 1 || matmul == 1) return Mode::AIC_ONLY;
  return Mode::AIV_ONLY;
}

void enqueue(void* stream, int qualifier, int matmul, uint32_t blocks, void (*run)(void*), void* ctx,
             void (*release)(void*)) {
  std::shared_ptr<void> owned(ctx, release);
  Stream* s = stream_of(stream);
  if (s == nullptr) {  // reported by the next synchronisation of the default stream
    g_default_stream.tasks.push_back([] { fail("a kernel launched on a stream that aclrtCreateStream did not make"); });
    return;
  }
  s->tasks.push_back([=] { run_kernel(kernel_mode(qualifier, matmul), blocks, run, owned.get()); });
}

bool enqueue_task(void* stream, void (*run)(void*), void* ctx, void (*release)(void*)) {
  std::shared_ptr<void> owned(ctx, release);
  Stream* s = stream_of(stream);
  if (s == nullptr) return false;
  s->tasks.push_back([=] { run(owned.get()); });
  return true;
}
}  // namespace deepfuse_emu

using deepfuse_emu::Stream;

extern "C" {
const char* deepfuse_emu_error(void) { return deepfuse_emu::g_error.c_str(); }
void deepfuse_emu_set_ub(size_t bytes) { deepfuse_emu::g_ub_limit = bytes; }
// of the last kernel run: the cube cores that computed a Matmul, and the blocks the body ran on
int64_t deepfuse_emu_busy_cubes(void) { return (int64_t)deepfuse_emu::g_busy_cubes.size(); }
int64_t deepfuse_emu_blocks_run(void) { return deepfuse_emu::g_blocks_run; }

aclError aclrtSynchronizeStream(aclrtStream stream) {
  Stream* s = deepfuse_emu::stream_of(stream);
  if (s == nullptr) return ACL_ERROR_INVALID_PARAM;
  while (!s->tasks.empty()) {
    std::function<void()> task = std::move(s->tasks.front());
    s->tasks.pop_front();
    try {
      task();
    } catch (const deepfuse_emu::Error& e) {
      deepfuse_emu::g_error = e.what;
      s->tasks.clear();
      return ACL_ERROR_RT_AICORE_EXCEPTION;
    } catch (const std::exception& e) {
      deepfuse_emu::g_error = e.what();
      s->tasks.clear();
      return ACL_ERROR_RT_AICORE_EXCEPTION;
    }
  }
  return ACL_SUCCESS;
}

aclError aclrtCreateStream(aclrtStream* stream) {
  if (stream == nullptr) return ACL_ERROR_INVALID_PARAM;
  Stream* s = new Stream;
  deepfuse_emu::g_streams.insert(s);
  *stream = s;
  return ACL_SUCCESS;
}

aclError aclrtDestroyStream(aclrtStream stream) {
  Stream* s = (Stream*)stream;
  if (!deepfuse_emu::g_streams.erase(s)) return ACL_ERROR_INVALID_PARAM;
  delete s;
  return ACL_SUCCESS;
}

aclError aclrtMemcpy2dAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                            aclrtMemcpyKind kind, aclrtStream stream) {
  Stream* s = deepfuse_emu::stream_of(stream);
  if (dst == nullptr || src == nullptr || s == nullptr || width > dpitch || width > spitch ||
      kind != ACL_MEMCPY_DEVICE_TO_DEVICE)
    return ACL_ERROR_INVALID_PARAM;
  s->tasks.push_back([=] {
    for (size_t i = 0; i < height; i++) std::memcpy((uint8_t*)dst + i * dpitch, (const uint8_t*)src + i * spitch, width);
  });
  return ACL_SUCCESS;
}

aclError aclrtMallocHost(void** hostPtr, size_t size) {
  if (hostPtr == nullptr || size == 0) return ACL_ERROR_INVALID_PARAM;
  void* p = aligned_alloc(64, (size + 63) / 64 * 64);
  if (p == nullptr) return ACL_ERROR_INVALID_PARAM;
  deepfuse_emu::g_pinned[(uintptr_t)p] = size;
  *hostPtr = p;
  return ACL_SUCCESS;
}

aclError aclrtFreeHost(void* hostPtr) {
  if (!deepfuse_emu::g_pinned.erase((uintptr_t)hostPtr)) return ACL_ERROR_INVALID_PARAM;
  free(hostPtr);
  return ACL_SUCCESS;
}

aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind) {
  if (dst == nullptr || src == nullptr || count > destMax) return ACL_ERROR_INVALID_PARAM;
  std::memcpy(dst, src, count);  // now: not ordered with the kernels queued on any stream
  return ACL_SUCCESS;
}

aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  Stream* s = deepfuse_emu::stream_of(stream);
  if (dst == nullptr || src == nullptr || count > destMax || s == nullptr || kind == ACL_MEMCPY_HOST_TO_HOST)
    return ACL_ERROR_INVALID_PARAM;
  s->tasks.push_back([=] { std::memcpy(dst, src, count); });  // reads src when the stream reaches it
  const void* host = kind == ACL_MEMCPY_HOST_TO_DEVICE ? src : kind == ACL_MEMCPY_DEVICE_TO_HOST ? dst : nullptr;
  if (host != nullptr && !deepfuse_emu::pinned(host, count)) return aclrtSynchronizeStream(stream);
  return ACL_SUCCESS;
}
}
