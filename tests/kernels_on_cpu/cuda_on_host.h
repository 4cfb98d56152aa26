// cuda_on_host.h: a small CUDA execution model for the host, so that g++ compiles the package's
// kernels and their launchers (csrc/<op>/kernel.cu, kernel.cuh) unchanged and runs them on the
// CPU, under ThreadSanitizer, AddressSanitizer and UBSan. Test infrastructure only
// (tests/kernels_on_cpu/); force-included (-include) ahead of every source it compiles.
//
// What it models:
//   - launch(kernel, grid, block, shared_bytes, args...) stands in for kernel<<<grid, block,
//     shared_bytes>>>(args...) (csrc/common/launch.h calls it where nvcc would launch): one OS
//     thread per CUDA thread of a block (threads kept from launch to launch: Workers),
//     kConcurrentBlocks blocks at once; threadIdx, blockIdx, blockDim, gridDim. The blocks, in
//     order or shuffled by the case's block order seed, are dealt to kConcurrentBlocks slots in
//     turn, and each slot runs its blocks one after another. Slots never synchronise with one
//     another, so ThreadSanitizer reports conflicting accesses by blocks in different slots (two
//     blocks writing one element, one reading what another writes): races between blocks. An
//     invalid configuration (CUDA's limits) runs nothing and is returned by cudaGetLastError(), as
//     on a GPU. Every valid launch is recorded (kernel name, grid, block) for the drivers to report.
//   - static __shared__ variables: the harness (tests/helpers/kernels_on_cpu.py) rewrites each
//     declaration `__shared__ T name[dims];` into a static array of kConcurrentBlocks copies and a
//     reference `name` to the copy of the block's slot (block_slot), so every block running at
//     once has its own; `__shared__` is left undefined here, so a declaration the rewrite misses
//     does not compile. Extern dynamic shared memory of shared_bytes bytes per block through
//     dynamic_shared(). atomicAdd (64-bit unsigned) as the host's atomic addition.
//   - __syncthreads(): a barrier of the whole block. A thread leaves the block when it returns;
//     a barrier reached after some threads returned, a thread returning while others wait, and
//     threads waiting at different __syncthreads() calls are reported errors.
//   - warps of 32 lanes (linear thread index / 32): __shfl_sync, __shfl_xor_sync,
//     __shfl_down_sync, __ballot_sync, __any_sync, __match_any_sync and __syncwarp exchange values
//     through a per-warp barrier, one exchange each (__popc and __ffs are the host's bit counts); a
//     mask naming absent lanes, lanes that returned, or not the calling lane, and lanes of one warp passing
//     different masks or waiting at different calls are reported errors.
//   - a barrier waited on longer than CUDA_ON_HOST_TIMEOUT_S seconds (default 60) is a reported
//     deadlock. Every reported error prints "cuda_on_host error: ..." and exits with status 70.
//   - CUDA's own vector_types.h (float4, dim3), cuda_fp16.h / cuda_bf16.h host conversions, the
//     host's math library, __ldg; and the runtime calls the launch helpers make (cudaGetDevice,
//     cudaDeviceGetAttribute, cudaOccupancyMaxActiveBlocksPerMultiprocessor, cudaGetLastError)
//     against a configurable stand-in device (SMs, resident threads per SM).
//   All synchronisation is std::mutex and release / acquire atomics (waiting threads sleep in a
//   futex), so ThreadSanitizer sees the happens-before edges a barrier or a shuffle gives, and
//   reports accesses no barrier orders.
// What it does not model: races between blocks that share a slot (two blocks a slot apart run one
// after the other; with the shuffled orders of several cases most pairs meet in different slots),
// code generation (register allocation, nvcc's optimisations, spills), uninitialised shared memory
// (statics start at zero and keep the previous block's values in their slot), memory spaces and
// caches, the GPU's fp32 last-bit differences (nvcc contracts a * b + c into fma; fast-math
// intrinsics), warps whose lanes run disjoint shuffles at the same time (reported as an error
// here), and kernels running at once: a launch returns when its kernel has run, and launches from
// several host threads take turns.
#pragma once

#if defined(__CUDACC__)
#error "cuda_on_host.h is for host compilers; nvcc compiles the kernels itself"
#endif

// Tells csrc/common/launch.h to launch through cuda_on_host::launch.
#define CUDA_ON_HOST 1

// A hint to nvcc's register allocation (code generation is not modelled); nvcc still checks it.
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

// The built-in variables, per OS thread (= CUDA thread).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace cuda_on_host {

constexpr int kConcurrentBlocks = 2;  // blocks running at once: the slots of a launch
inline thread_local int block_slot = 0;  // the slot of the block this thread belongs to

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "cuda_on_host error: block (%u,%u,%u) thread (%u,%u,%u): %s\n", blockIdx.x, blockIdx.y,
               blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, what.c_str());
  std::fflush(stderr);
  std::_Exit(70);
}

inline std::chrono::seconds timeout() {
  const char* s = std::getenv("CUDA_ON_HOST_TIMEOUT_S");
  return std::chrono::seconds(s ? std::atoi(s) : 60);
}

struct Site {  // where a barrier or shuffle was called from
  const char* file = nullptr;
  int line = 0;
  bool operator!=(const Site& o) const { return line != o.line || std::strcmp(file, o.file) != 0; }
  std::string str() const { return std::string(file) + ":" + std::to_string(line); }
};

// What the threads that wait at a barrier or shuffle wait on: a counter the last thread to arrive
// advances, read with acquire and advanced with release, so ThreadSanitizer orders what that thread
// wrote before the wait's end. Waiters sleep in a futex on the counter itself: a condition
// variable's notify_all would wake each into a contest for its mutex, which with hundreds of
// threads on two cores took most of a case's time in futex calls.
struct Generation {
  std::atomic<uint32_t> value{0};

  uint32_t now() const { return value.load(std::memory_order_acquire); }

  void advance() {
    value.fetch_add(1, std::memory_order_release);
    syscall(SYS_futex, &value, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  // Returns once the counter is past mine; fails as a deadlock after the timeout.
  void wait_past(uint32_t mine, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (now() == mine) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) fail(std::string("deadlock: timed out waiting at ") + what);
      const timespec wait{time_t(left.count() / 1000000000), long(left.count() % 1000000000)};
      syscall(SYS_futex, &value, FUTEX_WAIT_PRIVATE, mine, &wait, nullptr, 0);
    }
  }

  // Returns once the counter is past mine, however long that takes: an idle worker waiting for a
  // launch, or a launch waiting for its blocks (whose own waits time out).
  void wait_past_untimed(uint32_t mine) {
    while (now() == mine) syscall(SYS_futex, &value, FUTEX_WAIT_PRIVATE, mine, nullptr, nullptr, 0);
  }
};

// The OS threads that run the CUDA threads of launches, kept from one launch to the next, and from
// one case to the next of a driver serving many: ThreadSanitizer takes about 2 ms to create a
// thread, a second for a launch of two blocks of 256. The work is handed out under a mutex and
// collected through a Generation, so ThreadSanitizer orders the workers after what the launching
// thread wrote before, and the launching thread after everything the workers wrote.
class Workers {
 public:
  ~Workers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      started_.advance();
    }
    for (auto& t : threads_) t.join();
  }

  // Runs task(i) for every i < n, each on a thread of its own, all at once; returns when all returned.
  // Launches from several host threads take their turns.
  void run(size_t n, const std::function<void(size_t)>& task) {
    const std::lock_guard<std::mutex> turn(launching_);
    std::unique_lock<std::mutex> lock(mu_);
    while (threads_.size() < n) {
      const size_t i = threads_.size();
      threads_.emplace_back([this, i, seen = started_.now()] { serve(i, seen); });
    }
    task_ = &task;
    active_ = running_ = n;
    const uint32_t done = finished_.now();
    started_.advance();  // under the mutex: a worker that wakes reads the task of the count it sees
    lock.unlock();
    finished_.wait_past_untimed(done);
  }

 private:
  void serve(size_t i, uint32_t seen) {
    for (;;) {
      started_.wait_past_untimed(seen);
      std::unique_lock<std::mutex> lock(mu_);
      seen = started_.now();
      if (stopping_) return;
      if (i >= active_) continue;  // a launch of fewer threads
      const std::function<void(size_t)>& task = *task_;
      lock.unlock();
      task(i);
      lock.lock();
      if (--running_ == 0) finished_.advance();
    }
  }

  std::mutex launching_, mu_;
  Generation started_, finished_;
  std::vector<std::thread> threads_;
  const std::function<void(size_t)>* task_ = nullptr;
  size_t active_ = 0, running_ = 0;
  bool stopping_ = false;
};
inline Workers workers;

// __syncthreads() of one block.
struct BlockBarrier {
  std::mutex mu;
  Generation generation;
  int threads = 0, live = 0, arrived = 0;
  Site site;

  void sync(Site at) {
    std::unique_lock<std::mutex> lock(mu);
    if (live != threads)
      fail("__syncthreads() at " + at.str() + " reached after " + std::to_string(threads - live) + " of " +
           std::to_string(threads) + " threads returned");
    if (arrived == 0) site = at;
    else if (site != at) fail("threads wait at different __syncthreads(): " + site.str() + " and " + at.str());
    if (++arrived == threads) {
      arrived = 0;
      generation.advance();
      return;
    }
    const uint32_t mine = generation.now();
    lock.unlock();
    generation.wait_past(mine, "__syncthreads()");
  }

  void thread_returned() {
    std::lock_guard<std::mutex> lock(mu);
    --live;
    if (arrived > 0)
      fail("thread returned while " + std::to_string(arrived) + " threads wait at __syncthreads() at " + site.str());
  }
};

// What an exchange of a warp hands each lane of its mask: the value of the lane it names (a
// shuffle), the lanes whose value is not 0 (a ballot), or those whose value equals its own (a match).
enum class Exchange { kShuffle, kBallot, kMatchAny };

// One warp's exchanges: every lane of the mask deposits its value and source lane; the last to
// arrive hands each lane its result.
struct Warp {
  std::mutex mu;
  Generation generation;
  unsigned present = 0, returned = 0, arrived = 0, mask = 0;
  Site site;
  uint64_t value[32] = {}, result[32] = {};
  int source[32] = {};

  uint64_t exchange(int lane, unsigned m, uint64_t v, int src, Exchange kind, Site at) {
    std::unique_lock<std::mutex> lock(mu);
    const unsigned bit = 1u << lane;
    if (!(m & bit))
      fail("lane " + std::to_string(lane) + " calls a *_sync at " + at.str() + " whose mask leaves it out");
    if (m & ~present) fail("*_sync mask at " + at.str() + " names lanes absent from this warp");
    if (m & returned) fail("*_sync mask at " + at.str() + " names lanes that returned");
    if (arrived == 0) {
      mask = m;
      site = at;
    } else if (m != mask || site != at) {
      fail("lanes of one warp at different *_sync calls or masks: " + site.str() + " and " + at.str());
    }
    if (!(m & (1u << src))) fail("*_sync at " + at.str() + " reads lane " + std::to_string(src) + ", outside its mask");
    value[lane] = v;
    source[lane] = src;
    arrived |= bit;
    if (arrived == mask) {
      for (int l = 0; l < 32; ++l)
        if (mask & (1u << l)) result[l] = outcome(kind, l);
      arrived = 0;
      generation.advance();
      return result[lane];
    }
    const uint32_t mine = generation.now();
    lock.unlock();
    generation.wait_past(mine, "a warp shuffle");
    return result[lane];  // written for this lane before the generation advanced
  }

  uint64_t outcome(Exchange kind, int lane) const {
    if (kind == Exchange::kShuffle) return value[source[lane]];
    uint64_t lanes = 0;
    for (int l = 0; l < 32; ++l) {
      const bool counted = kind == Exchange::kBallot ? value[l] != 0 : value[l] == value[lane];
      if (mask & (1u << l) && counted) lanes |= uint64_t(1) << l;
    }
    return lanes;
  }

  void lane_returned(int lane) {
    std::lock_guard<std::mutex> lock(mu);
    returned |= 1u << lane;
    if (arrived & ~returned && mask & (1u << lane))
      fail("lane " + std::to_string(lane) + " returned while its warp waits at a *_sync naming it at " + site.str());
  }
};

// The state of the block now running, shared by its threads.
struct Block {
  BlockBarrier barrier;
  std::vector<Warp> warps;
  std::vector<unsigned char> dynamic_shared;

  void reset(int threads, size_t shared_bytes) {
    barrier.threads = barrier.live = threads;
    barrier.arrived = 0;
    warps = std::vector<Warp>((threads + 31) / 32);
    for (int t = 0; t < threads; t += 32) warps[t / 32].present = threads - t >= 32 ? ~0u : (1u << (threads - t)) - 1;
    dynamic_shared.assign(shared_bytes, 0xff);
  }
};

inline thread_local Block* current_block = nullptr;
inline thread_local int current_thread = 0;  // linear index within the block

inline int lane() { return current_thread % 32; }
inline Warp& warp() { return current_block->warps[current_thread / 32]; }

// Bitwise copies of shuffled values (at most 8 bytes, as CUDA's shuffles take).
template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// One shuffle of the calling lane: v goes to the warp, the value of lane source(lane) comes back.
template <typename T, typename Source>
T shuffle(unsigned mask, T v, int width, Site at, const Source& source) {
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail("shuffle width " + std::to_string(width) + " is not a power of 2 in [1, 32]");
  return from_bits<T>(warp().exchange(lane(), mask, to_bits(v), source(lane()), Exchange::kShuffle, at));
}

// The stand-in device the runtime calls answer for (what a test sets), and the launch error
// cudaGetLastError() returns.
struct Device {
  int sms = 132, threads_per_sm = 2048;
  cudaError_t error = cudaSuccess;  // returned by cudaDeviceGetAttribute when set
};
inline std::mutex runtime_mu;
inline std::vector<Device> devices(1);
inline thread_local int current_device = 0;  // per host thread, as in CUDA
inline cudaError_t get_device_error = cudaSuccess;  // returned by cudaGetDevice when set
inline cudaError_t last_error = cudaSuccess;
inline unsigned block_order_seed = 0;  // 0: blocks in order

inline void set_block_order_seed(unsigned seed) { block_order_seed = seed; }

// A launch the kernels ran: the kernel's name with its template arguments (its symbol, read back
// with dladdr: the executable is linked with -rdynamic; "unnamed" for a kernel of internal
// linkage, which has none), the grid and the block.
struct LaunchRecord {
  std::string kernel;
  dim3 grid, block;
};
inline std::vector<LaunchRecord> launches;

// Starts a driver's next case (one process serves many): its stand-in device added as a device of
// its own and made current, so that the launch helpers' caches, kept per device, start empty for it
// as in a new process; its block order; no launches recorded and no launch error.
inline void begin_case(int sms, int threads_per_sm, unsigned order_seed) {
  std::lock_guard<std::mutex> lock(runtime_mu);
  devices.push_back({sms, threads_per_sm});
  current_device = int(devices.size()) - 1;
  block_order_seed = order_seed;
  launches.clear();
  last_error = cudaSuccess;
}

template <typename Fn>
std::string kernel_name(Fn* kernel) {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(kernel), &info) || !info.dli_sname) return "unnamed";
  int status = 0;
  char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = status == 0 ? demangled : info.dli_sname;
  std::free(demangled);
  // Without the parameter list: the first '(' outside the template arguments (an enum argument
  // demangles as "(Type)0").
  int depth = 0;
  size_t parameters = 0;
  while (parameters < name.size() && !(name[parameters] == '(' && depth == 0)) {
    depth += name[parameters] == '<' ? 1 : name[parameters] == '>' ? -1 : 0;
    ++parameters;
  }
  name = name.substr(0, parameters);
  const size_t scope = name.rfind("::", name.find('<'));          // without the namespaces
  return scope == std::string::npos ? name : name.substr(scope + 2);
}

inline cudaError_t record(cudaError_t err) {
  std::lock_guard<std::mutex> lock(runtime_mu);
  last_error = err;
  return err;
}

// Runs kernel(args...) over grid x block: the blocks dealt to kConcurrentBlocks slots in turn, each
// slot with its own block.x * block.y * block.z threads, which run the slot's blocks one after
// another, meeting at a rendezvous between blocks. The slots share nothing but the kernel's
// arguments, which they only read.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, Args&&... args) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    record(cudaErrorInvalidConfiguration);
    return;
  }
  if (shared_bytes > 48 * 1024) {
    record(cudaErrorInvalidValue);
    return;
  }
  const std::tuple<Params...> params(std::forward<Args>(args)...);  // converted as a launch converts
  {
    const std::lock_guard<std::mutex> lock(runtime_mu);
    launches.push_back({kernel_name(kernel), grid, block});
  }
  std::vector<uint64_t> order(uint64_t(grid.x) * grid.y * grid.z);
  std::iota(order.begin(), order.end(), 0);
  if (block_order_seed) std::shuffle(order.begin(), order.end(), std::mt19937(block_order_seed));

  struct Slot {
    Block state;
    std::mutex mu;  // rendezvous between the slot's blocks
    Generation finished_blocks;
    size_t done = 0;
  };
  const size_t slots = std::min<size_t>(order.size(), kConcurrentBlocks);
  std::vector<std::unique_ptr<Slot>> slot_states;
  for (size_t s = 0; s < slots; ++s) {
    slot_states.push_back(std::make_unique<Slot>());
    slot_states.back()->state.reset(int(threads), shared_bytes);
  }
  auto run = [&](size_t s, int t) {
    Slot& slot = *slot_states[s];
    current_block = &slot.state;
    current_thread = t;
    block_slot = int(s);
    blockDim = block;
    gridDim = grid;
    threadIdx = uint3{unsigned(t % block.x), unsigned(t / block.x % block.y), unsigned(t / (block.x * block.y))};
    for (size_t k = s, mine = 0; k < order.size(); k += slots, ++mine) {
      const uint64_t b = order[k];
      blockIdx = uint3{unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / (uint64_t(grid.x) * grid.y))};
      std::apply(kernel, params);
      slot.state.barrier.thread_returned();
      slot.state.warps[t / 32].lane_returned(t % 32);
      std::unique_lock<std::mutex> lock(slot.mu);
      if (++slot.done == threads) {  // the last thread out resets the block for the slot's next
        slot.done = 0;
        slot.state.reset(int(threads), shared_bytes);
        slot.finished_blocks.advance();
      } else {
        lock.unlock();
        slot.finished_blocks.wait_past(uint32_t(mine), "the end of a block");
      }
    }
    current_block = nullptr;
  };
  workers.run(slots * threads, [&](size_t i) { run(i / threads, int(i % threads)); });
  record(cudaSuccess);
}

inline void* dynamic_shared() { return current_block->dynamic_shared.data(); }

}  // namespace cuda_on_host

// The runtime calls of the launch helpers (csrc/common/cuda_utils.cuh), answered for the stand-in devices.
extern "C" inline cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> lock(cuda_on_host::runtime_mu);
  const cudaError_t err = cuda_on_host::last_error;
  cuda_on_host::last_error = cudaSuccess;
  return err;
}
extern "C" inline cudaError_t cudaGetDevice(int* device) {
  std::lock_guard<std::mutex> lock(cuda_on_host::runtime_mu);
  if (cuda_on_host::get_device_error != cudaSuccess) return cuda_on_host::get_device_error;
  *device = cuda_on_host::current_device;
  return cudaSuccess;
}
// The stand-in's occupancy: its resident threads per SM over the block's (register and shared
// memory use are not modelled), as many blocks as a kernel of few registers gets. Counted
// (cuda_on_host::occupancy_queries), so that a test sees the launch helpers cache the answers.
namespace cuda_on_host {
inline int occupancy_queries = 0;
}
extern "C" inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* kernel,
                                                                           int block_size, size_t shared_bytes) {
  std::lock_guard<std::mutex> lock(cuda_on_host::runtime_mu);
  const int device = cuda_on_host::current_device;
  if (device < 0 || device >= int(cuda_on_host::devices.size())) return cudaErrorInvalidDevice;
  const cuda_on_host::Device& d = cuda_on_host::devices[device];
  if (d.error != cudaSuccess) return d.error;
  if (!kernel || block_size < 1 || block_size > 1024 || shared_bytes > 48 * 1024) return cudaErrorInvalidValue;
  ++cuda_on_host::occupancy_queries;
  *blocks = d.threads_per_sm / block_size;
  return cudaSuccess;
}
extern "C" inline cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  std::lock_guard<std::mutex> lock(cuda_on_host::runtime_mu);
  if (device < 0 || device >= int(cuda_on_host::devices.size())) return cudaErrorInvalidDevice;
  const cuda_on_host::Device& d = cuda_on_host::devices[device];
  if (d.error != cudaSuccess) return d.error;
  if (attr == cudaDevAttrMultiProcessorCount) *value = d.sms;
  else if (attr == cudaDevAttrMaxThreadsPerMultiProcessor) *value = d.threads_per_sm;
  else cuda_on_host::fail("cudaDeviceGetAttribute: attribute " + std::to_string(int(attr)) + " is not modelled");
  return cudaSuccess;
}

// The device functions the kernels call. Site defaults to the caller's file and line.
inline void __syncthreads(cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  cuda_on_host::current_block->barrier.sync(at);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  cuda_on_host::warp().exchange(cuda_on_host::lane(), mask, 0, cuda_on_host::lane(), cuda_on_host::Exchange::kShuffle,
                                at);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32,
              cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  return cuda_on_host::shuffle(mask, v, width, at,
                               [&](int lane) { return lane / width * width + (src_lane & (width - 1)); });
}

// A source past the caller's group of `width` lanes gives the caller's own value (CUDA's rule).
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  return cuda_on_host::shuffle(mask, v, width, at, [&](int lane) {
    const int src = lane ^ lane_mask;
    return src >= (lane / width + 1) * width || src < 0 || src > 31 ? lane : src;
  });
}

template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  return cuda_on_host::shuffle(mask, v, width, at,
                               [&](int lane) { return lane % width + int(delta) < width ? lane + int(delta) : lane; });
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

// A vote of the lanes of mask: bit l set where lane l's predicate holds. One exchange, checked as a
// shuffle is.
inline unsigned __ballot_sync(unsigned mask, int predicate, cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  return unsigned(cuda_on_host::warp().exchange(cuda_on_host::lane(), mask, predicate != 0, cuda_on_host::lane(),
                                                cuda_on_host::Exchange::kBallot, at));
}

inline int __any_sync(unsigned mask, int predicate, cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  return __ballot_sync(mask, predicate, at) != 0;
}

// The lanes of mask whose value equals the caller's (bitwise): one exchange, checked as a shuffle is.
template <typename T>
unsigned __match_any_sync(unsigned mask, T value, cuda_on_host::Site at = {__builtin_FILE(), __builtin_LINE()}) {
  return unsigned(cuda_on_host::warp().exchange(cuda_on_host::lane(), mask, cuda_on_host::to_bits(value),
                                                cuda_on_host::lane(), cuda_on_host::Exchange::kMatchAny, at));
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// An atomic read-modify-write of the host's (ThreadSanitizer orders it against other atomics and
// reports it racing with plain accesses no barrier orders).
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
}
