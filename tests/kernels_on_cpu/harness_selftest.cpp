// Checks of cuda_on_host.h itself and of the launch helpers of csrc/common/cuda_utils.cuh, one scenario
// per run (argv[1]). The scenarios named bad_* must end in a reported error (exit 70); the others
// print "ok" after checking their results.
#include <atomic>
#include <iostream>

#include "cuda_on_host.h"
#include "common/cuda_utils.cuh"

using cuda_on_host::launch;
using namespace fused_rl_ops;

namespace {

void check(bool ok, const std::string& what) {
  if (!ok) cuda_on_host::fail("selftest: " + what);
}

// out[t] for every thread t of one block: a shuffle of each kind (xor, down and indexed, over
// groups of 8 lanes), a value passed through static and dynamic shared memory across a
// __syncthreads(), and blockIdx.
__global__ void exchange_kernel(int* out) {
  __shared__ int staged[64];
  int* dyn = static_cast<int*>(cuda_on_host::dynamic_shared());
  const int t = threadIdx.x, lane = t % 32;
  const int x = __shfl_xor_sync(0xffffffffu, lane, 1);
  const int d = __shfl_down_sync(0xffffffffu, lane, 2, 8);
  const int s = __shfl_sync(0xffffffffu, lane, 3, 8);
  staged[t] = 1000 * t;
  dyn[t] = t + 1;
  __syncthreads();
  out[blockIdx.x * 64 + t] = x + 100 * d + 10000 * s + staged[63 - t] + 1000000 * dyn[63 - t];
}

void good_exchanges() {
  std::vector<int> out(3 * 64, -1);
  cuda_on_host::set_block_order_seed(5);
  launch(exchange_kernel, dim3(3), dim3(64), 64 * sizeof(int), out.data());
  check(cudaGetLastError() == cudaSuccess, "launch");
  for (int b = 0; b < 3; ++b) {
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32, group = lane / 8 * 8;
      const int d = lane % 8 + 2 < 8 ? lane + 2 : lane;
      const int expected = (lane ^ 1) + 100 * d + 10000 * (group + 3) + 1000 * (63 - t) + 1000000 * (64 - t);
      check(out[b * 64 + t] == expected, "exchange result of thread " + std::to_string(t));
    }
  }
}

// Blocks run kConcurrentBlocks at a time, and every block once: two blocks that wait for each
// other finish only when they run at once; then every thread of 7 blocks in a shuffled order
// counts itself.
__global__ void meeting_kernel(std::atomic<int>* arrived) {
  if (threadIdx.x != 0) return;
  arrived->fetch_add(1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (arrived->load() < 2) {
    if (std::chrono::steady_clock::now() > deadline) cuda_on_host::fail("selftest: the blocks did not run at once");
    std::this_thread::yield();
  }
}

__global__ void count_kernel(int* out) { out[blockIdx.x * blockDim.x + threadIdx.x] += 1; }

void concurrent_blocks() {
  std::atomic<int> arrived{0};
  launch(meeting_kernel, dim3(2), dim3(32), 0, &arrived);
  check(cudaGetLastError() == cudaSuccess && arrived == 2, "two blocks meeting");
  std::vector<int> out(7 * 64, 0);
  cuda_on_host::set_block_order_seed(3);
  launch(count_kernel, dim3(7), dim3(64), 0, out.data());
  for (size_t k = 0; k < out.size(); ++k) check(out[k] == 1, "thread " + std::to_string(k) + " ran once");
}

__global__ void noop_kernel() {}

void bad_launch_configs_are_errors() {
  launch(noop_kernel, dim3(1), dim3(1025), 0);
  check(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads");
  check(cudaGetLastError() == cudaSuccess, "cudaGetLastError clears the error");
  launch(noop_kernel, dim3(1), dim3(32), 64 * 1024);
  check(cudaGetLastError() == cudaErrorInvalidValue, "64 KiB of dynamic shared memory");
}

// Launch shapes of cuda_utils.cuh against the stand-in devices: read per device, from the
// device's own properties, errors returned.
__global__ void small_kernel() {}
__global__ void other_kernel() {}

void device_sizes() {
  cuda_on_host::devices = {{132, 2048}, {84, 1536}};
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;  // the current device is per host thread, as in CUDA
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&wrong, k] {
      cuda_on_host::current_device = k % 2;
      DeviceSize size;
      unsigned grid = 0;
      if (current_device_size(size) != cudaSuccess || size.sms != (k % 2 ? 84 : 132)) ++wrong;
      if (grid_for(small_kernel, 100000, 256, 0, grid) != cudaSuccess || grid != (k % 2 ? 84 * 6 : 132 * 8)) ++wrong;
    });
  }
  for (auto& t : threads) t.join();
  check(wrong == 0, "current_device_size and grid_for from several threads");
  unsigned grid = 0;
  cuda_on_host::current_device = 1;
  const int queries = cuda_on_host::occupancy_queries;
  check(grid_for(small_kernel, 10000, 256, 0, grid) == cudaSuccess && grid == 84 * 6, "grid_for, device 1");
  check(cuda_on_host::occupancy_queries == queries, "the occupancy cached per kernel, device and block");
  check(grid_for(small_kernel, 10000, dim3(32, 16), 0, grid) == cudaSuccess && grid == 84 * 3, "a larger block");
  check(grid_for(other_kernel, 10000, 256, 0, grid) == cudaSuccess && grid == 84 * 6, "another kernel");
  check(cuda_on_host::occupancy_queries == queries + 2, "asked for each new kernel and block");
  const RowLaunch cfg = row_launch(10000, 64, 256);
  check(cfg.block.x == 64 && cfg.block.y == 4 && cfg.work_blocks == 2500, "row_launch");
  cuda_on_host::current_device = 0;
  check(grid_for(small_kernel, 3, 256, 0, grid) == cudaSuccess && grid == 3, "grid_for below the device's capacity");
  check(grid_for(small_kernel, 10000, 1024, 0, grid) == cudaSuccess && grid == 132 * 2, "1024 threads a block");
  // Errors: from cudaGetDevice, and from the queries of a device not yet cached.
  DeviceSize size;
  cuda_on_host::get_device_error = cudaErrorNoDevice;
  check(current_device_size(size) == cudaErrorNoDevice, "cudaGetDevice's error returned");
  check(grid_for(small_kernel, 10, 256, 0, grid) == cudaErrorNoDevice, "cudaGetDevice's error from grid_for");
  cuda_on_host::get_device_error = cudaSuccess;
  cuda_on_host::devices.push_back({16, 2048, cudaErrorInvalidDevice});
  cuda_on_host::current_device = 2;
  check(current_device_size(size) == cudaErrorInvalidDevice, "cudaDeviceGetAttribute's error returned");
  check(grid_for(small_kernel, 10, 256, 0, grid) == cudaErrorInvalidDevice, "and from grid_for");
  cuda_on_host::current_device = 100;
  check(current_device_size(size) == cudaErrorInvalidDevice, "device 100 is an error, not a guess");
}

// Planted synchronisation errors, each of which the model must report.
__global__ void early_return_kernel() {
  if (threadIdx.x >= 16) return;
  __syncthreads();
}
__global__ void two_barriers_kernel() {
  if (threadIdx.x % 2) __syncthreads();
  else __syncthreads();
}
__global__ void shuffle_kernel(int lanes_that_return) {
  if (int(threadIdx.x) >= 32 - lanes_that_return) return;
  (void)__shfl_xor_sync(0xffffffffu, 1, 1);
}
__global__ void deadlock_kernel() {
  if (threadIdx.x < 16) (void)__shfl_xor_sync(0xffffffffu, 1, 1);
  else __syncthreads();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc == 2 ? argv[1] : "";
  if (scenario == "good_exchanges") good_exchanges();
  else if (scenario == "bad_launch_configs_are_errors") bad_launch_configs_are_errors();
  else if (scenario == "device_sizes") device_sizes();
  else if (scenario == "concurrent_blocks") concurrent_blocks();
  else if (scenario == "bad_barrier_after_return") launch(early_return_kernel, dim3(1), dim3(64), 0);
  else if (scenario == "bad_barriers_at_two_places") launch(two_barriers_kernel, dim3(1), dim3(64), 0);
  else if (scenario == "bad_shuffle_absent_lanes") launch(shuffle_kernel, dim3(1), dim3(16), 0, 0);
  else if (scenario == "bad_shuffle_returned_lanes") launch(shuffle_kernel, dim3(1), dim3(32), 0, 8);
  else if (scenario == "bad_deadlock") launch(deadlock_kernel, dim3(1), dim3(32), 0);
  else cuda_on_host::fail("unknown scenario " + scenario);
  std::cout << "ok\n";
  return 0;
}
