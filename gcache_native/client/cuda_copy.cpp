// cuda_copy: a batch of host <-> device copies queued on a CUDA stream in one call, the GIL
// released: the vLLM connector's GPU mover when vLLM's own swap_blocks_batch is not in the
// process (gcache/integrations/vllm/transfer/movers/cuda.py).
//
// No CUDA header and no CUDA library at build time: the functions come from the CUDA libraries
// the process has already loaded (torch or cupy load them), found at first use by name among the
// loaded objects (dl_iterate_phdr, dlopen RTLD_NOLOAD, dlsym). The module loads on machines
// without CUDA; a call there says that no CUDA runtime is loaded.
//
// Two methods:
//  - "loop": cudaMemcpyAsync(dst, src, size, cudaMemcpyDefault, stream) per range, from the
//    loaded libcudart (the runtime binds the device's primary context itself).
//  - "batch": cuMemcpyBatchAsync (CUDA >= 12.8 drivers), one driver call for the whole batch,
//    asked of the loaded libcuda through cuGetProcAddress at ABI version 12080 (the 12.8
//    signature, with failIdx; CUDA 13 headers rename the newer one to _v2), as vLLM does.
#include <dlfcn.h>
#include <link.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using Stream = void*;

// The few CUDA declarations used, spelled as CUDA 12.8 / 13.0 headers have them.
constexpr int kCudaMemcpyDefault = 4;
constexpr int kSrcAccessOrderStream = 1;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
constexpr int kSrcAccessOrderAny = 3;     // CU_MEMCPY_SRC_ACCESS_ORDER_ANY
constexpr int kBatchAbiVersion = 12080;   // cuMemcpyBatchAsync as CUDA 12.8 declared it

struct MemLocation {
  int type;
  int id;
};
struct MemcpyAttributes {  // CUmemcpyAttributes_v1
  int src_access_order;
  MemLocation src_loc_hint;
  MemLocation dst_loc_hint;
  unsigned int flags;
};

using MemcpyAsyncFn = int (*)(void*, const void*, size_t, int, Stream);
using ErrorStringFn = const char* (*)(int);
using BatchFn = int (*)(uint64_t*, uint64_t*, size_t*, size_t, MemcpyAttributes*, size_t*, size_t, size_t*, Stream);
using GetProcAddressV2Fn = int (*)(const char*, void**, int, uint64_t, int*);
using GetProcAddressFn = int (*)(const char*, void**, int, uint64_t);
using CtxGetCurrentFn = int (*)(void**);
using StreamGetCtxFn = int (*)(Stream, void**);
using CtxSetCurrentFn = int (*)(void*);
using DriverErrorNameFn = int (*)(int, const char**);

struct Runtime {  // from libcudart
  std::string path;
  MemcpyAsyncFn memcpy_async = nullptr;
  ErrorStringFn error_string = nullptr;
};

struct Driver {  // from libcuda
  std::string path;
  BatchFn batch = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  StreamGetCtxFn stream_get_ctx = nullptr;
  CtxSetCurrentFn ctx_set_current = nullptr;
  DriverErrorNameFn error_name = nullptr;
};

// The first loaded object whose file name starts with `prefix` ("libcudart.so", "libcuda.so").
std::string loaded_library(const char* prefix) {
  struct Search {
    const char* prefix;
    std::string found;
  } search{prefix, {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name == nullptr || info->dlpi_name[0] == '\0') return 0;
        const char* slash = std::strrchr(info->dlpi_name, '/');
        const char* base = slash ? slash + 1 : info->dlpi_name;
        if (std::strncmp(base, s->prefix, std::strlen(s->prefix)) == 0) {
          s->found = info->dlpi_name;
          return 1;
        }
        return 0;
      },
      &search);
  return search.found;
}

void* loaded_handle(const std::string& path) {
  return path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
}

std::mutex resolve_mutex;
Runtime runtime_cache;
Driver driver_cache;

// Resolved again until found (the first call may come before torch has loaded CUDA), then kept.
const Runtime& runtime() {
  std::lock_guard<std::mutex> lock(resolve_mutex);
  if (runtime_cache.memcpy_async == nullptr) {
    Runtime r;
    r.path = loaded_library("libcudart.so");
    if (void* h = loaded_handle(r.path)) {
      r.memcpy_async = reinterpret_cast<MemcpyAsyncFn>(dlsym(h, "cudaMemcpyAsync"));
      r.error_string = reinterpret_cast<ErrorStringFn>(dlsym(h, "cudaGetErrorString"));
    }
    if (r.memcpy_async != nullptr) runtime_cache = r;
  }
  return runtime_cache;
}

const Driver& driver() {
  std::lock_guard<std::mutex> lock(resolve_mutex);
  if (driver_cache.batch == nullptr) {
    Driver d;
    d.path = loaded_library("libcuda.so");
    if (void* h = loaded_handle(d.path)) {
      void* fn = nullptr;
      if (auto v2 = reinterpret_cast<GetProcAddressV2Fn>(dlsym(h, "cuGetProcAddress_v2"))) {
        int status = 0;
        if (v2("cuMemcpyBatchAsync", &fn, kBatchAbiVersion, 0, &status) != 0) fn = nullptr;
      } else if (auto v1 = reinterpret_cast<GetProcAddressFn>(dlsym(h, "cuGetProcAddress"))) {
        if (v1("cuMemcpyBatchAsync", &fn, kBatchAbiVersion, 0) != 0) fn = nullptr;
      }
      d.batch = reinterpret_cast<BatchFn>(fn);
      d.ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(h, "cuCtxGetCurrent"));
      d.stream_get_ctx = reinterpret_cast<StreamGetCtxFn>(dlsym(h, "cuStreamGetCtx"));
      d.ctx_set_current = reinterpret_cast<CtxSetCurrentFn>(dlsym(h, "cuCtxSetCurrent"));
      d.error_name = reinterpret_cast<DriverErrorNameFn>(dlsym(h, "cuGetErrorName"));
      if (d.ctx_get_current == nullptr || d.stream_get_ctx == nullptr || d.ctx_set_current == nullptr) {
        d.batch = nullptr;
      }
    }
    if (d.batch != nullptr) driver_cache = d;
  }
  return driver_cache;
}

struct Ranges {
  const uint64_t* dst;
  const uint64_t* src;
  const uint64_t* len;
  py::ssize_t n;
};

Ranges checked(const U64Array& dsts, const U64Array& srcs, const U64Array& sizes) {
  if (dsts.ndim() != 1 || srcs.ndim() != 1 || sizes.ndim() != 1 || dsts.size() != srcs.size() ||
      dsts.size() != sizes.size()) {
    throw std::invalid_argument("cuda_copy_ranges: dsts, srcs and sizes must be 1-D arrays of one length");
  }
  Ranges r{dsts.data(), srcs.data(), sizes.data(), dsts.size()};
  for (py::ssize_t i = 0; i < r.n; ++i) {
    if (r.len[i] != 0 && (r.dst[i] == 0 || r.src[i] == 0)) {
      throw std::invalid_argument("cuda_copy_ranges: a null address");
    }
  }
  return r;
}

std::string runtime_error_text(const Runtime& rt, int code) {
  const char* text = rt.error_string ? rt.error_string(code) : nullptr;
  return std::to_string(code) + (text ? std::string(" (") + text + ")" : std::string());
}

void copy_loop(const Ranges& r, Stream stream) {
  const Runtime& rt = runtime();
  if (rt.memcpy_async == nullptr) {
    throw std::runtime_error(
        "cuda_copy_ranges: no CUDA runtime (libcudart) is loaded in this process; it needs a GPU and a CUDA "
        "library that loads it (import torch and use a CUDA device first)");
  }
  py::ssize_t failed = -1;
  int code = 0;
  {
    py::gil_scoped_release release;
    for (py::ssize_t i = 0; i < r.n; ++i) {
      if (r.len[i] == 0) continue;
      code = rt.memcpy_async(reinterpret_cast<void*>(r.dst[i]), reinterpret_cast<const void*>(r.src[i]), r.len[i],
                             kCudaMemcpyDefault, stream);
      if (code != 0) {
        failed = i;
        break;
      }
    }
  }
  if (failed >= 0) {
    throw std::runtime_error("cuda_copy_ranges: cudaMemcpyAsync of range " + std::to_string(failed) +
                             " failed: " + runtime_error_text(rt, code));
  }
}

std::string driver_error_text(const Driver& d, int code) {
  const char* name = nullptr;
  if (d.error_name != nullptr) d.error_name(code, &name);
  return std::to_string(code) + (name ? std::string(" (") + name + ")" : std::string());
}

void copy_batch(const Ranges& r, Stream stream, bool src_access_any) {
  const Driver& d = driver();
  if (d.batch == nullptr) {
    throw std::runtime_error(
        "cuda_copy_ranges: cuMemcpyBatchAsync is not available: no CUDA driver (libcuda) is loaded in this process, "
        "or it is older than CUDA 12.8");
  }
  // The legacy default stream (0, or cudaStreamLegacy = 1) is refused by cuMemcpyBatchAsync.
  if (reinterpret_cast<uintptr_t>(stream) <= 2) {
    throw std::invalid_argument("cuda_copy_ranges: the batch method needs a created stream, not a default stream");
  }
  if (r.n == 0) return;
  MemcpyAttributes attr{};
  attr.src_access_order = src_access_any ? kSrcAccessOrderAny : kSrcAccessOrderStream;
  size_t attr_index = 0;
  size_t fail_index = 0;
  int code = 0;
  std::string where;
  {
    py::gil_scoped_release release;
    void* ctx = nullptr;
    // A thread that never touched CUDA has no current context: take the stream's.
    if (d.ctx_get_current(&ctx) != 0 || ctx == nullptr) {
      code = d.stream_get_ctx(stream, &ctx);
      if (code == 0) code = d.ctx_set_current(ctx);
      if (code != 0) where = "binding the stream's context";
    }
    if (code == 0) {
      // The driver reads the descriptor arrays during the call; it writes none of them.
      code = d.batch(const_cast<uint64_t*>(r.dst), const_cast<uint64_t*>(r.src),
                     reinterpret_cast<size_t*>(const_cast<uint64_t*>(r.len)), static_cast<size_t>(r.n), &attr,
                     &attr_index, 1, &fail_index, stream);
      if (code != 0) where = "cuMemcpyBatchAsync (range " + std::to_string(fail_index) + ")";
    }
  }
  if (code != 0) {
    throw std::runtime_error("cuda_copy_ranges: " + where + " failed: " + driver_error_text(d, code));
  }
}

void cuda_copy_ranges(const U64Array& dsts, const U64Array& srcs, const U64Array& sizes, uint64_t stream,
                      const std::string& method, bool src_access_any) {
  static_assert(sizeof(size_t) == sizeof(uint64_t), "size_t and uint64_t must have one size");
  if (method != "loop" && method != "batch") {
    throw std::invalid_argument("cuda_copy_ranges: method must be 'loop' or 'batch', got '" + method + "'");
  }
  const Ranges r = checked(dsts, srcs, sizes);
  auto* s = reinterpret_cast<Stream>(static_cast<uintptr_t>(stream));
  if (method == "loop") {
    copy_loop(r, s);
  } else {
    copy_batch(r, s, src_access_any);
  }
}

py::dict cuda_copy_probe() {
  const Runtime& rt = runtime();
  const Driver& d = driver();
  py::dict out;
  std::string cudart = rt.path.empty() ? loaded_library("libcudart.so") : rt.path;
  std::string cuda = d.path.empty() ? loaded_library("libcuda.so") : d.path;
  out["libcudart"] = cudart.empty() ? py::object(py::none()) : py::object(py::str(cudart));
  out["libcuda"] = cuda.empty() ? py::object(py::none()) : py::object(py::str(cuda));
  out["loop"] = rt.memcpy_async != nullptr;
  out["batch"] = d.batch != nullptr;
  return out;
}

}  // namespace

void bind_cuda_copy(py::module_& m) {
  m.def("cuda_copy_ranges", &cuda_copy_ranges, py::arg("dsts"), py::arg("srcs"), py::arg("sizes"), py::arg("stream"),
        py::arg("method") = "loop", py::arg("src_access_any") = false,
        "Queues copies dsts[i] <- srcs[i] of sizes[i] bytes (host or device addresses, unified addressing) on the "
        "CUDA stream `stream` (a cudaStream_t as an int), with the GIL released. method 'loop': cudaMemcpyAsync per "
        "range (the loaded libcudart); 'batch': one cuMemcpyBatchAsync (the loaded libcuda, CUDA >= 12.8; "
        "src_access_any lets the DMA read the sources out of stream order, for host sources nothing writes). "
        "Raises RuntimeError when the process has no CUDA library loaded.");
  m.def("cuda_copy_probe", &cuda_copy_probe,
        "Which CUDA libraries the process has loaded and which copy methods they give: {'libcudart': path or None, "
        "'libcuda': path or None, 'loop': bool, 'batch': bool}.");
}
