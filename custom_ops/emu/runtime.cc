// Runtime of the Metal kernel emulator: runs one dispatch of an emulated kernel
// on the CPU with Metal's execution model.
//
// - Threadgroups run one after another (in linear, reverse or shuffled order);
//   the threads of a threadgroup run concurrently on real OS threads (a pool
//   that grows to the largest threadgroup seen) and really wait for each other
//   at threadgroup_barrier and in SIMD-group functions.
// - dispatchThreads semantics by default: the grid is in threads and edge
//   threadgroups are smaller (no thread outside the grid exists), with
//   [[threads_per_threadgroup]] giving that threadgroup's actual size, as
//   Metal does with nonuniform threadgroups. dispatchThreadgroups semantics on
//   request (grid in threadgroups, all threadgroups full).
// - Threadgroup memory (arguments and variables declared in the kernel) is
//   filled with 0xFF bytes at the start of every threadgroup: reading it
//   before writing gives NaN in any floating type.
// - Divergent barriers are errors, not hangs: a thread returning while others
//   wait at a barrier, threads waiting at different barriers, a SIMD-group
//   split between a SIMD-group function and a barrier or between two
//   SIMD-group functions. A timeout catches the rest (e.g. infinite loops).
//
// Built once into an object file by emu.py and linked into every emulated
// kernel library; the extern "C" functions at the end are what Python calls.
#include "emu_runtime.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <semaphore>
#include <string>
#include <vector>

namespace tfm_emu {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Kernel registry (filled by static initializers of the kernel library).

struct Registry {
  std::vector<const KernelEntry*> kernels;
  std::string errors;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: no exit-time races
  return *r;
}

const KernelEntry* find_kernel(const char* name) {
  for (const KernelEntry* e : registry().kernels)
    if (std::strcmp(e->name, name) == 0) return e;
  return nullptr;
}

// ---------------------------------------------------------------------------
// Threadgroup execution state.

struct Abort {};  // unwinds an emulated thread out of the kernel after a failure

std::string site_str(const Site& s) {
  return std::string(s.op) + " at " + s.file + ":" + std::to_string(s.line) + ":" + std::to_string(s.column);
}

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.column == b.column && std::strcmp(a.op, b.op) == 0 &&
         std::strcmp(a.file, b.file) == 0;
}

struct SimdGroup {
  uint32_t alive = 0;       // lanes that exist and have not returned
  uint32_t arrived = 0;     // lanes waiting in the current SIMD-group function
  uint32_t at_barrier = 0;  // lanes waiting at threadgroup_barrier
  uint64_t generation = 0;
  Site site{};
  uint32_t active[2] = {0, 0};
  alignas(64) unsigned char slots[2][kSimdWidth][kSimdSlotBytes];
  std::condition_variable cv;
};

struct ThreadgroupVariable {
  const void* tag;
  void* ptr;
  size_t size;
};

struct Threadgroup {
  std::mutex mu;
  uint32_t n = 0;       // threads in this threadgroup
  uint32_t size[3] = {1, 1, 1};
  uint32_t tgid[3] = {0, 0, 0};
  uint32_t exited = 0;
  uint32_t barrier_waiting = 0;
  uint64_t barrier_generation = 0;
  Site barrier_site{};
  std::condition_variable barrier_cv;
  SimdGroup simd[kMaxThreadsPerThreadgroup / kSimdWidth];
  uint32_t nsimd = 0;
  unsigned char* arena = nullptr;  // kMaxThreadgroupMemory bytes for kernel-declared variables
  size_t arena_used = 0;
  size_t argument_bytes = 0;       // threadgroup memory passed as arguments
  std::vector<ThreadgroupVariable> variables;
  Clock::time_point deadline;
  bool failed = false;
  std::string error;
};

struct Lane {
  Threadgroup* tg;
  uint32_t index;
  uint32_t simd_id;
  uint32_t simd_lane;
};

thread_local Lane* t_lane = nullptr;

Lane& current_lane(const char* what) {
  if (t_lane == nullptr) {
    std::fprintf(stderr, "tfm_emu: %s called outside an emulated kernel thread\n", what);
    std::abort();
  }
  return *t_lane;
}

void fail_locked(Threadgroup& tg, const std::string& message) {
  if (!tg.failed) {
    tg.failed = true;
    tg.error = "threadgroup (" + std::to_string(tg.tgid[0]) + "," + std::to_string(tg.tgid[1]) + "," +
               std::to_string(tg.tgid[2]) + "): " + message;
  }
  tg.barrier_cv.notify_all();
  for (uint32_t s = 0; s < tg.nsimd; ++s) tg.simd[s].cv.notify_all();
}

[[noreturn]] void fail_and_abort(Threadgroup& tg, const std::string& message) {
  fail_locked(tg, message);
  throw Abort();
}

template <class Done>
void wait_for(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Threadgroup& tg, Done done,
              const Site& site, const Lane& lane) {
  while (!done() && !tg.failed) {
    if (cv.wait_until(lock, tg.deadline) == std::cv_status::timeout && !done() && !tg.failed) {
      fail_locked(tg, "timed out: thread " + std::to_string(lane.index) + " waited in " + site_str(site) +
                          " until the dispatch deadline (a thread never arrived: infinite loop?)");
    }
  }
  if (tg.failed) throw Abort();
}

std::string thread_str(const Lane& lane) {
  return "thread " + std::to_string(lane.index) + " (SIMD-group " + std::to_string(lane.simd_id) + ", lane " +
         std::to_string(lane.simd_lane) + ")";
}

void complete_simd_locked(SimdGroup& sg) {
  sg.active[sg.generation & 1] = sg.arrived;
  sg.arrived = 0;
  ++sg.generation;
  sg.cv.notify_all();
}

void lane_exit(Lane& lane) {
  Threadgroup& tg = *lane.tg;
  std::lock_guard<std::mutex> lock(tg.mu);
  ++tg.exited;
  SimdGroup& sg = tg.simd[lane.simd_id];
  sg.alive &= ~(1u << lane.simd_lane);
  if (tg.failed) return;
  if (tg.barrier_waiting > 0) {
    fail_locked(tg, thread_str(lane) + " returned while " + std::to_string(tg.barrier_waiting) +
                        " thread(s) wait in " + site_str(tg.barrier_site) +
                        ": every thread of a threadgroup must reach each threadgroup_barrier "
                        "(barrier in divergent control flow?)");
    return;
  }
  // Returned lanes are inactive: a SIMD-group function the others wait in
  // completes without them, as on the GPU.
  if (sg.arrived != 0 && sg.arrived == sg.alive) complete_simd_locked(sg);
}

// ---------------------------------------------------------------------------
// Worker pool: one OS thread per thread of the largest threadgroup seen.

class Pool {
 public:
  typedef void (*LaneFn)(void* ctx, uint32_t index);

  bool ensure(uint32_t n, std::string* error) {
    while (workers_.size() < n) {
      Worker* w = new Worker();
      w->pool = this;
      w->index = static_cast<uint32_t>(workers_.size());
      pthread_attr_t attr;
      pthread_attr_init(&attr);
      pthread_attr_setstacksize(&attr, 512 * 1024);
      pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
      // Workers never handle signals (Python's handlers run on the main thread).
      sigset_t all, old;
      sigfillset(&all);
      pthread_sigmask(SIG_SETMASK, &all, &old);
      const int rc = pthread_create(&w->thread, &attr, &Pool::worker_main, w);
      pthread_sigmask(SIG_SETMASK, &old, nullptr);
      pthread_attr_destroy(&attr);
      if (rc != 0) {
        delete w;
        *error = "could not start emulator thread " + std::to_string(workers_.size()) + ": " + std::strerror(rc);
        return false;
      }
      workers_.push_back(w);
    }
    return true;
  }

  // Runs fn(ctx, i) for i in [0, n) on n workers; false if not all finished by deadline.
  bool run(uint32_t n, LaneFn fn, void* ctx, Clock::time_point deadline) {
    fn_ = fn;
    ctx_ = ctx;
    remaining_.store(n, std::memory_order_relaxed);
    for (uint32_t i = 0; i < n; ++i) workers_[i]->go.release();
    return done_.try_acquire_until(deadline);
  }

 private:
  struct Worker {
    Pool* pool;
    uint32_t index;
    pthread_t thread;
    std::binary_semaphore go{0};
  };

  static void* worker_main(void* arg) {
    Worker* w = static_cast<Worker*>(arg);
    for (;;) {
      w->go.acquire();
      Pool* pool = w->pool;
      pool->fn_(pool->ctx_, w->index);
      if (pool->remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) pool->done_.release();
    }
    return nullptr;
  }

  std::vector<Worker*> workers_;
  LaneFn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint32_t> remaining_{0};
  std::binary_semaphore done_{0};
};

// Everything a running dispatch touches. Leaked (with its threads) if a
// dispatch times out, since stuck threads may still reference it.
struct Engine {
  Pool pool;
  Threadgroup tg;
  std::vector<unsigned char*> tg_buffers;
  Engine() { tg.arena = static_cast<unsigned char*>(std::aligned_alloc(64, kMaxThreadgroupMemory)); }
};

std::mutex g_dispatch_mutex;
Engine* g_engine = nullptr;

struct DispatchContext {
  const KernelEntry* kernel;
  Threadgroup* tg;
  void* const* args;
  uint32_t nominal[3];
};

void run_lane(void* ctx_ptr, uint32_t index) {
  DispatchContext& ctx = *static_cast<DispatchContext*>(ctx_ptr);
  Threadgroup& tg = *ctx.tg;
  Lane lane{&tg, index, index / kSimdWidth, index % kSimdWidth};
  t_lane = &lane;
  const uint32_t lid[3] = {index % tg.size[0], (index / tg.size[0]) % tg.size[1], index / (tg.size[0] * tg.size[1])};
  uint32_t b[kNumBuiltinWords];
  for (int d = 0; d < 3; ++d) {
    b[0 + d] = tg.tgid[d] * ctx.nominal[d] + lid[d];  // thread_position_in_grid
    b[3 + d] = lid[d];                                 // thread_position_in_threadgroup
    b[6 + d] = tg.tgid[d];                             // threadgroup_position_in_grid
    b[9 + d] = tg.size[d];                             // threads_per_threadgroup (actual)
  }
  b[12] = lane.simd_lane;  // thread_index_in_simdgroup
  b[13] = lane.simd_id;    // simdgroup_index_in_threadgroup
  try {
    ctx.kernel->invoke(ctx.kernel->fn, ctx.args, b);
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(tg.mu);
    fail_locked(tg, thread_str(lane) + ": C++ exception in the kernel: " + e.what());
  } catch (...) {
    std::lock_guard<std::mutex> lock(tg.mu);
    fail_locked(tg, thread_str(lane) + ": C++ exception in the kernel");
  }
  lane_exit(lane);
  t_lane = nullptr;
}

void set_error(char* err, int errlen, const std::string& message) {
  if (err == nullptr || errlen <= 0) return;
  std::snprintf(err, static_cast<size_t>(errlen), "%s", message.c_str());
}

std::string json_escape(const char* s) {
  std::string out;
  for (; *s; ++s) {
    const unsigned char c = static_cast<unsigned char>(*s);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

enum ArgKind { kArgBuffer = 0, kArgBytes = 1, kArgThreadgroup = 2 };

struct BoundArguments {
  std::vector<void*> args;
  std::vector<std::vector<unsigned char>> bytes_copies;
  DispatchContext ctx{};
};

}  // namespace

// ---------------------------------------------------------------------------
// Called by metal_emu.h.

void register_kernel(const KernelEntry* entry) {
  Registry& r = registry();
  if (const KernelEntry* old = find_kernel(entry->name)) {
    r.errors += std::string("kernel host name '") + entry->name + "' is instantiated twice (" + old->file + ":" +
                std::to_string(old->line) + " and " + entry->file + ":" + std::to_string(entry->line) + ")\n";
    return;
  }
  r.kernels.push_back(entry);
}

void threadgroup_barrier(const Site& site) {
  Lane& lane = current_lane("threadgroup_barrier");
  Threadgroup& tg = *lane.tg;
  std::unique_lock<std::mutex> lock(tg.mu);
  if (tg.failed) throw Abort();
  if (tg.exited > 0) {
    fail_and_abort(tg, thread_str(lane) + " reached " + site_str(site) + " after " + std::to_string(tg.exited) +
                           " thread(s) of the threadgroup returned: every thread of a threadgroup must reach each "
                           "threadgroup_barrier (barrier in divergent control flow?)");
  }
  SimdGroup& sg = tg.simd[lane.simd_id];
  if (sg.arrived != 0) {
    fail_and_abort(tg, thread_str(lane) + " reached " + site_str(site) + " while other lanes of its SIMD-group wait in " +
                           site_str(sg.site) + " (divergent control flow)");
  }
  if (tg.barrier_waiting == 0) {
    tg.barrier_site = site;
  } else if (!same_site(tg.barrier_site, site)) {
    fail_and_abort(tg, "threads of one threadgroup wait at different barriers: " + site_str(tg.barrier_site) +
                           " and " + site_str(site) + " (" + thread_str(lane) + ")");
  }
  ++tg.barrier_waiting;
  sg.at_barrier |= 1u << lane.simd_lane;
  if (tg.barrier_waiting == tg.n) {
    tg.barrier_waiting = 0;
    ++tg.barrier_generation;
    for (uint32_t s = 0; s < tg.nsimd; ++s) tg.simd[s].at_barrier = 0;
    tg.barrier_cv.notify_all();
    return;
  }
  const uint64_t generation = tg.barrier_generation;
  wait_for(lock, tg.barrier_cv, tg, [&] { return tg.barrier_generation != generation; }, site, lane);
}

SimdExchange simd_exchange(const Site& site, const void* value, uint32_t size) {
  Lane& lane = current_lane(site.op);
  Threadgroup& tg = *lane.tg;
  std::unique_lock<std::mutex> lock(tg.mu);
  if (tg.failed) throw Abort();
  SimdGroup& sg = tg.simd[lane.simd_id];
  if (sg.at_barrier != 0) {
    fail_and_abort(tg, thread_str(lane) + " reached " + site_str(site) + " while other lanes of its SIMD-group wait in " +
                           site_str(tg.barrier_site) + " (divergent control flow)");
  }
  if (sg.arrived == 0) {
    sg.site = site;
  } else if (!same_site(sg.site, site)) {
    fail_and_abort(tg, "lanes of SIMD-group " + std::to_string(lane.simd_id) + " wait in different SIMD-group functions: " +
                           site_str(sg.site) + " and " + site_str(site) +
                           " (the emulator needs SIMD-group functions in SIMD-uniform control flow; "
                           "returned lanes are fine)");
  }
  const uint32_t parity = static_cast<uint32_t>(sg.generation & 1);
  if (size > 0) std::memcpy(sg.slots[parity][lane.simd_lane], value, size);
  sg.arrived |= 1u << lane.simd_lane;
  if (sg.arrived == sg.alive) {
    complete_simd_locked(sg);
  } else {
    const uint64_t generation = sg.generation;
    wait_for(lock, sg.cv, tg, [&] { return sg.generation != generation; }, site, lane);
  }
  return SimdExchange{&sg.slots[parity][0][0], sg.active[parity], lane.simd_lane};
}

void* threadgroup_variable(const void* tag, size_t size, size_t align) {
  Lane& lane = current_lane("threadgroup variable");
  Threadgroup& tg = *lane.tg;
  std::unique_lock<std::mutex> lock(tg.mu);
  if (tg.failed) throw Abort();
  for (const ThreadgroupVariable& v : tg.variables)
    if (v.tag == tag) return v.ptr;
  const size_t a = std::max<size_t>(align, 16);
  const size_t offset = (tg.arena_used + a - 1) / a * a;
  if (offset + size + tg.argument_bytes > kMaxThreadgroupMemory) {
    fail_and_abort(tg, "threadgroup memory exceeds " + std::to_string(kMaxThreadgroupMemory) + " bytes: " +
                           std::to_string(offset + size) + " declared in the kernel + " +
                           std::to_string(tg.argument_bytes) + " passed as arguments");
  }
  void* ptr = tg.arena + offset;
  std::memset(ptr, 0xff, size);
  tg.arena_used = offset + size;
  tg.variables.push_back(ThreadgroupVariable{tag, ptr, size});
  return ptr;
}

uint32_t current_thread_index() { return current_lane("current_thread_index").index; }

}  // namespace tfm_emu

// ---------------------------------------------------------------------------
// C API used by emu.py (ctypes).

using namespace tfm_emu;

TFM_EMU_API int tfm_emu_abi_version() { return kAbiVersion; }

// JSON: {"abi": 1, "errors": "...", "kernels": [{"name", "file", "line", "params": [...]}]}
TFM_EMU_API const char* tfm_emu_describe() {
  static std::string* json = nullptr;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (json != nullptr) return json->c_str();
  Registry& r = registry();
  std::string s = "{\"abi\": " + std::to_string(kAbiVersion) + ", \"errors\": \"" + json_escape(r.errors.c_str()) +
                  "\", \"limits\": {\"max_total_threads_per_threadgroup\": " +
                  std::to_string(kMaxThreadsPerThreadgroup) + ", \"thread_execution_width\": " +
                  std::to_string(kSimdWidth) + ", \"max_threadgroup_memory_length\": " +
                  std::to_string(kMaxThreadgroupMemory) + ", \"max_bytes_argument\": " +
                  std::to_string(kMaxBytesArgument) + "}, \"kernels\": [";
  for (size_t i = 0; i < r.kernels.size(); ++i) {
    const KernelEntry* e = r.kernels[i];
    s += std::string(i ? ", " : "") + "{\"name\": \"" + json_escape(e->name) + "\", \"file\": \"" +
         json_escape(e->file) + "\", \"line\": " + std::to_string(e->line) + ", \"params\": [";
    for (int p = 0; p < e->nparams; ++p) {
      const ParamInfo& pi = e->params[p];
      s += std::string(p ? ", " : "") + "{\"kind\": \"" + (pi.kind == kParamPointer ? "pointer" : "reference") +
           "\", \"const\": " + (pi.is_const ? "true" : "false") + ", \"size\": " + std::to_string(pi.size) +
           ", \"align\": " + std::to_string(pi.align) + "}";
    }
    s += "]}";
  }
  s += "]}";
  json = new std::string(s);
  return json->c_str();
}

// Runs one dispatch; returns 0 on success, else writes a message to err.
//   kinds[i]: 0 buffer (ptrs[i], sizes[i] bytes), 1 bytes (copied, like
//             setBytes), 2 threadgroup memory (sizes[i] bytes, allocated here)
//   mode:     0 dispatchThreads (grid in threads), 1 dispatchThreadgroups
//   order:    threadgroup order: 0 linear, 1 reverse, 2 shuffled with seed
TFM_EMU_API int tfm_emu_run(const char* name, int nargs, const int* kinds, void* const* ptrs, const uint64_t* sizes,
                            const uint32_t* grid, const uint32_t* threadgroup, int mode, int order, uint64_t seed,
                            double timeout_s, char* err, int errlen) {
  std::lock_guard<std::mutex> dispatch_lock(g_dispatch_mutex);
  const KernelEntry* k = find_kernel(name);
  if (k == nullptr) {
    set_error(err, errlen, std::string("no kernel named '") + name + "' in this library");
    return 1;
  }
  const std::string where = std::string("kernel '") + name + "': ";
  if (nargs != k->nparams) {
    set_error(err, errlen, where + "takes " + std::to_string(k->nparams) + " argument(s) before the builtins, got " +
                               std::to_string(nargs));
    return 1;
  }
  uint32_t tg_size[3], nominal_grid[3], ntg[3];
  uint64_t total = 1;
  for (int d = 0; d < 3; ++d) {
    if (threadgroup[d] == 0 || grid[d] == 0) {
      set_error(err, errlen, where + "grid and threadgroup sizes must be >= 1 in every dimension "
                                     "(Metal rejects empty dispatches: skip them on the host)");
      return 1;
    }
    tg_size[d] = threadgroup[d];
    total *= threadgroup[d];
    if (mode == 1) {
      ntg[d] = grid[d];
      nominal_grid[d] = grid[d] * threadgroup[d];
    } else {
      nominal_grid[d] = grid[d];
      ntg[d] = (grid[d] + threadgroup[d] - 1) / threadgroup[d];
    }
  }
  if (total > kMaxThreadsPerThreadgroup) {
    set_error(err, errlen, where + "threadgroup of " + std::to_string(total) + " threads exceeds " +
                               "maxTotalThreadsPerThreadgroup (" + std::to_string(kMaxThreadsPerThreadgroup) + ")");
    return 1;
  }
  // Bind arguments. Heap-held: threads of a timed-out dispatch may still read them.
  std::unique_ptr<BoundArguments> bound(new BoundArguments());
  std::vector<void*>& args = bound->args;
  std::vector<std::vector<unsigned char>>& bytes_copies = bound->bytes_copies;
  args.assign(static_cast<size_t>(nargs), nullptr);
  std::vector<std::pair<int, size_t>> tg_args;
  size_t tg_arg_bytes = 0;
  for (int i = 0; i < nargs; ++i) {
    const ParamInfo& p = k->params[i];
    const std::string arg = where + "argument " + std::to_string(i) + ": ";
    switch (kinds[i]) {
      case kArgBuffer:
        if (ptrs[i] == nullptr) {
          set_error(err, errlen, arg + "null buffer");
          return 1;
        }
        if (reinterpret_cast<uintptr_t>(ptrs[i]) % p.align != 0) {
          set_error(err, errlen, arg + "buffer is not aligned to " + std::to_string(p.align) + " bytes");
          return 1;
        }
        if (p.kind == kParamReference && sizes[i] < p.size) {
          set_error(err, errlen, arg + "buffer of " + std::to_string(sizes[i]) + " bytes bound to a constant T& of " +
                                     std::to_string(p.size) + " bytes");
          return 1;
        }
        args[i] = ptrs[i];
        break;
      case kArgBytes: {
        if (sizes[i] > kMaxBytesArgument) {
          set_error(err, errlen, arg + std::to_string(sizes[i]) + " bytes exceed setBytes' limit of " +
                                     std::to_string(kMaxBytesArgument) + " (use a buffer)");
          return 1;
        }
        if (p.kind == kParamReference && sizes[i] < p.size) {
          set_error(err, errlen, arg + std::to_string(sizes[i]) + " bytes bound to a constant T& of " +
                                     std::to_string(p.size) + " bytes");
          return 1;
        }
        if (p.kind == kParamPointer && !p.is_const) {
          set_error(err, errlen, arg + "bytes bound to a writable pointer (setBytes data is constant)");
          return 1;
        }
        bytes_copies.emplace_back(std::max<uint64_t>(sizes[i], 64));
        std::memcpy(bytes_copies.back().data(), ptrs[i], sizes[i]);
        args[i] = bytes_copies.back().data();
        break;
      }
      case kArgThreadgroup:
        if (p.kind != kParamPointer) {
          set_error(err, errlen, arg + "threadgroup memory bound to a reference parameter");
          return 1;
        }
        if (sizes[i] == 0 || sizes[i] % 16 != 0) {
          set_error(err, errlen, arg + "threadgroup memory length " + std::to_string(sizes[i]) +
                                     " must be a positive multiple of 16 bytes (Metal requires it)");
          return 1;
        }
        tg_args.emplace_back(i, sizes[i]);
        tg_arg_bytes += sizes[i];
        break;
      default:
        set_error(err, errlen, arg + "unknown argument kind " + std::to_string(kinds[i]));
        return 1;
    }
  }
  if (tg_arg_bytes > kMaxThreadgroupMemory) {
    set_error(err, errlen, where + std::to_string(tg_arg_bytes) + " bytes of threadgroup memory exceed " +
                               std::to_string(kMaxThreadgroupMemory));
    return 1;
  }

  if (g_engine == nullptr) g_engine = new Engine();
  Engine& engine = *g_engine;
  std::string error;
  if (!engine.pool.ensure(static_cast<uint32_t>(total), &error)) {
    set_error(err, errlen, where + error);
    return 1;
  }
  while (engine.tg_buffers.size() < tg_args.size())
    engine.tg_buffers.push_back(static_cast<unsigned char*>(std::aligned_alloc(64, kMaxThreadgroupMemory)));
  for (size_t j = 0; j < tg_args.size(); ++j) args[static_cast<size_t>(tg_args[j].first)] = engine.tg_buffers[j];

  const uint64_t count = static_cast<uint64_t>(ntg[0]) * ntg[1] * ntg[2];
  std::vector<uint64_t> sequence(count);
  std::iota(sequence.begin(), sequence.end(), 0);
  if (order == 1) {
    std::reverse(sequence.begin(), sequence.end());
  } else if (order == 2) {
    std::mt19937_64 rng(seed);
    std::shuffle(sequence.begin(), sequence.end(), rng);
  }

  Threadgroup& tg = engine.tg;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 1e9));
  bound->ctx = DispatchContext{k, &tg, args.data(), {tg_size[0], tg_size[1], tg_size[2]}};
  DispatchContext& ctx = bound->ctx;
  for (uint64_t linear : sequence) {
    {
      std::lock_guard<std::mutex> lock(tg.mu);
      const uint32_t id[3] = {static_cast<uint32_t>(linear % ntg[0]), static_cast<uint32_t>((linear / ntg[0]) % ntg[1]),
                              static_cast<uint32_t>(linear / (static_cast<uint64_t>(ntg[0]) * ntg[1]))};
      tg.n = 1;
      for (int d = 0; d < 3; ++d) {
        tg.tgid[d] = id[d];
        tg.size[d] = std::min(tg_size[d], nominal_grid[d] - id[d] * tg_size[d]);  // edge threadgroups are smaller
        tg.n *= tg.size[d];
      }
      tg.exited = 0;
      tg.barrier_waiting = 0;
      tg.nsimd = (tg.n + kSimdWidth - 1) / kSimdWidth;
      for (uint32_t s = 0; s < tg.nsimd; ++s) {
        SimdGroup& sg = tg.simd[s];
        const uint32_t lanes = std::min(kSimdWidth, tg.n - s * kSimdWidth);
        sg.alive = lanes == kSimdWidth ? ~0u : ((1u << lanes) - 1u);
        sg.arrived = 0;
        sg.at_barrier = 0;
      }
      tg.arena_used = 0;
      tg.argument_bytes = tg_arg_bytes;
      tg.variables.clear();
      tg.deadline = deadline;
      tg.failed = false;
      tg.error.clear();
      for (size_t j = 0; j < tg_args.size(); ++j) std::memset(engine.tg_buffers[j], 0xff, tg_args[j].second);
    }
    if (!engine.pool.run(tg.n, &run_lane, &ctx, deadline)) {
      std::string message;
      {
        std::lock_guard<std::mutex> lock(tg.mu);
        fail_locked(tg, "timed out after " + std::to_string(timeout_s) +
                            " s: a thread is still running (infinite loop?); "
                            "the emulator abandons its threads, results are undefined");
        message = tg.error;
      }
      g_engine = nullptr;  // leaked on purpose, with the arguments: stuck threads still use them
      bound.release();
      set_error(err, errlen, where + message);
      return 2;
    }
    std::lock_guard<std::mutex> lock(tg.mu);
    if (tg.failed) {
      set_error(err, errlen, where + tg.error);
      return 1;
    }
  }
  return 0;
}
