// Shared part of the kernel drivers (<op>_driver.cpp): serves the cases tests/helpers/kernels_on_cpu.py
// writes, one after another. Each line of standard input names a case directory and an output
// directory, tab-separated; the driver calls one of the op's launchers (csrc/<op>/kernel.cu,
// compiled into the driver) through cuda_on_host.h, writes the buffers and the launches to the output
// directory, and prints "done". The case's standard error goes to OUT_DIR/stderr.txt; an error
// (the model's, a sanitizer's) ends the process, as it would end a process of its own. Run one by
// hand with: printf '%s\t%s\n' CASE_DIR OUT_DIR | DRIVER
//
// case.txt, one entry a line:
//   kernel NAME                      which launcher the driver calls
//   device SMS THREADS_PER_SM        the stand-in device the launcher sizes its grid for
//   block_order_seed S               run the blocks in a shuffled order (0: in order)
//   int NAME VALUE / float NAME VALUE    scalar arguments
//   buffer NAME DTYPE COUNT OFFSET   NAME.bin holds COUNT elements (f32, f64, bf16, f16, i64); the
//                                    driver places them OFFSET elements past a 16-byte boundary
//                                    and with nothing after them, so a read past the end is an
//                                    AddressSanitizer report; written back to NAME.out after
// OUT_DIR/launches.txt has a line "launch KERNEL<TEMPLATE ARGS> GRID_X Y Z BLOCK_X Y Z" for each
// kernel the launcher started.
#pragma once

#include "common/math.h"
#include "cuda_on_host.h"
#include "vocab_parallel/logit_map.h"

#include <fcntl.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

namespace driver {

struct Buffer {
  std::string dtype;
  size_t count = 0, elem = 0;
  std::unique_ptr<unsigned char[]> storage;
  unsigned char* data = nullptr;
};

inline size_t elem_size(const std::string& dtype) {
  if (dtype == "f32") return 4;
  if (dtype == "bf16" || dtype == "f16") return 2;
  if (dtype == "i64" || dtype == "f64") return 8;
  cuda_on_host::fail("unknown dtype " + dtype);
}

class Case {
 public:
  explicit Case(std::string dir) : dir_(std::move(dir)) {
    std::ifstream in(dir_ + "/case.txt");
    if (!in) cuda_on_host::fail("cannot read " + dir_ + "/case.txt");
    std::string key;
    while (in >> key) {
      if (key == "kernel") in >> kernel;
      else if (key == "device") in >> sms_ >> threads_per_sm_;
      else if (key == "block_order_seed") in >> block_order_seed_;
      else if (key == "int" || key == "float") {
        std::string name;
        in >> name >> scalars_[name];
      } else if (key == "buffer") {
        std::string name, dtype;
        size_t count, offset;
        in >> name >> dtype >> count >> offset;
        buffers_[name] = read_buffer(name, dtype, count, offset);
      } else {
        cuda_on_host::fail("case.txt: unknown entry " + key);
      }
    }
    cuda_on_host::begin_case(sms_, threads_per_sm_, block_order_seed_);
  }

  template <typename T>
  T* buf(const std::string& name) {
    const auto it = buffers_.find(name);
    if (it == buffers_.end()) cuda_on_host::fail("case has no buffer " + name);
    if (it->second.elem != sizeof(T)) cuda_on_host::fail("buffer " + name + " is " + it->second.dtype);
    return reinterpret_cast<T*>(it->second.data);
  }
  bool has(const std::string& name) const { return buffers_.count(name) > 0; }
  void* raw(const std::string& name) {
    const auto it = buffers_.find(name);
    if (it == buffers_.end()) cuda_on_host::fail("case has no buffer " + name);
    return it->second.data;
  }

  bool has_scalar(const std::string& name) const { return scalars_.count(name) > 0; }
  int64_t i(const std::string& name) const { return static_cast<int64_t>(scalar(name)); }
  float f(const std::string& name) const { return static_cast<float>(scalar(name)); }
  double d(const std::string& name) const { return scalar(name); }

  fused_rl_ops::DType dtype() const { return static_cast<fused_rl_ops::DType>(i("dtype")); }

  void write_back(const std::string& out_dir) const {
    for (const auto& [name, b] : buffers_) {
      std::ofstream out(out_dir + "/" + name + ".out", std::ios::binary);
      out.write(reinterpret_cast<const char*>(b.data), std::streamsize(b.count * b.elem));
    }
  }

  std::string kernel;

 private:
  double scalar(const std::string& name) const {
    const auto it = scalars_.find(name);
    if (it == scalars_.end()) cuda_on_host::fail("case has no scalar " + name);
    return it->second;
  }

  Buffer read_buffer(const std::string& name, const std::string& dtype, size_t count, size_t offset) const {
    Buffer b;
    b.dtype = dtype;
    b.count = count;
    b.elem = elem_size(dtype);
    const size_t pad = offset * b.elem, bytes = count * b.elem;
    b.storage.reset(new unsigned char[pad + bytes]);  // new[] gives 16-byte alignment on x86-64
    if (reinterpret_cast<uintptr_t>(b.storage.get()) % 16) cuda_on_host::fail("allocation not 16-byte aligned");
    b.data = b.storage.get() + pad;
    std::ifstream in(dir_ + "/" + name + ".bin", std::ios::binary);
    in.read(reinterpret_cast<char*>(b.data), std::streamsize(bytes));
    if (!in || in.gcount() != std::streamsize(bytes)) cuda_on_host::fail("short file " + name + ".bin");
    return b;
  }

  std::string dir_;
  int sms_ = 0, threads_per_sm_ = 0;
  unsigned block_order_seed_ = 0;
  std::map<std::string, double> scalars_;
  std::map<std::string, Buffer> buffers_;
};

// A case's logit map: a scalar prefix + name per option of FRL_LOGIT_MAP (the teacher's: prefix
// "teacher_"), an optional one left out for none. Every option, so that a new one needs no driver.
#define DRIVER_READ_LOGIT_MAP_OPTION(type, name, schema_type, schema_default, rule) \
  if (c.has_scalar(prefix + #name)) map.name = c.d(prefix + #name);

inline fused_rl_ops::LogitMap read_logit_map(const Case& c, const std::string& prefix = "") {
  fused_rl_ops::LogitMap map;
  FRL_LOGIT_MAP(DRIVER_READ_LOGIT_MAP_OPTION)
  return map;
}

// Fails the run when the launch helpers returned an error (the harness records CUDA's).
inline void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) cuda_on_host::fail(what + ": launch returned error " + std::to_string(int(err)));
}

// A combine case's buffers into p (an op's Params): the ranks' partials [ranks, N, ...] and out.
template <class Params>
void read_combine(Case& c, Params& p) {
  p.partials = c.buf<float>("partials");
  p.out = c.buf<float>("out");
  p.ranks = c.i("ranks");
}

// A grad_rows case's destination into p (an op's Params, its logits and cols set): in place over the
// logits (in_place 1), or columns [grads_col, grads_col + C) of grads' rows of grads_stride elements
// in dtype. Returns the gradients' dtype.
template <class Params>
fused_rl_ops::DType read_grads(Case& c, Params& p) {
  if (c.i("in_place")) {
    p.grads = c.buf<float>("logits");
    p.grads_stride = p.cols;
    return fused_rl_ops::DType::kFloat32;
  }
  const size_t elem = c.dtype() == fused_rl_ops::DType::kFloat32 ? 4 : 2;
  p.grads = static_cast<unsigned char*>(c.raw("grads")) + c.i("grads_col") * elem;
  p.grads_stride = c.i("grads_stride");
  return c.dtype();
}

// One case: run(case) calls the launcher and returns its cudaError_t.
template <typename Run>
void run_case(const std::string& case_dir, const std::string& out_dir, const Run& run) {
  Case c(case_dir);
  check(run(c), c.kernel);
  check(cudaGetLastError(), c.kernel);
  std::ofstream out(out_dir + "/launches.txt");
  for (const auto& l : cuda_on_host::launches) {
    std::string name = l.kernel;
    name.erase(std::remove(name.begin(), name.end(), ' '), name.end());
    out << "launch " << name << " " << l.grid.x << " " << l.grid.y << " " << l.grid.z << " " << l.block.x << " "
        << l.block.y << " " << l.block.z << "\n";
  }
  c.write_back(out_dir);
}

// Serves the cases named on standard input (this file's header), one process for them all: its
// threads are kept from one case to the next (cuda_on_host's Workers).
template <typename Run>
int main(int argc, char** argv, const Run& run) {
  if (argc != 1) cuda_on_host::fail(std::string("usage: printf '%s\\t%s\\n' CASE_DIR OUT_DIR | ") + argv[0]);
  std::string line;
  while (std::getline(std::cin, line)) {
    const size_t tab = line.find('\t');
    if (tab == std::string::npos) cuda_on_host::fail("not CASE_DIR<tab>OUT_DIR: " + line);
    const std::string out_dir = line.substr(tab + 1);
    const int err = open((out_dir + "/stderr.txt").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (err < 0 || dup2(err, STDERR_FILENO) < 0) cuda_on_host::fail("cannot write " + out_dir + "/stderr.txt");
    close(err);
    run_case(line.substr(0, tab), out_dir, run);
#if defined(__SANITIZE_ADDRESS__)
    // What a process of its own would find at its exit: memory the case allocated and lost.
    if (__lsan_do_recoverable_leak_check()) cuda_on_host::fail("LeakSanitizer found leaks (above)");
#endif
    std::cout << "done" << std::endl;
  }
  return 0;
}

}  // namespace driver
