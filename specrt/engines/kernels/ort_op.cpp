// The ONNX Runtime operators of the kernel library (domain "specrt"), built against ONNX Runtime's
// C API headers (build.py) and loaded with SessionOptions.register_custom_ops_library:
//
//   GgufMatMul(X float [..., K]) -> Y float [..., N]     Y = X W^T (gguf_matmul.cpp)
//   GgufGather(ids int64 [...])  -> Y float [..., K]     the rows ids of W, dequantized (an embedding)
//
// W is not a graph tensor: each node names a GGUF file and the offset of its tensor's bytes
// (attributes file, offset, ggml_type, n, k), and the file is mapped once per process, read-only.
// A GgufMatMul may name several tensors of one type and k side by side (parts_offset, parts_n: n
// is their sum; a layer's q, k and v in one product, x quantized once) and the order of its output
// columns (order: column j is row order[j] of the parts side by side; llama.cpp's q and k rows put
// back in the checkpoint's order when the weight is packed, not by a Gather each step). Its output
// may go through the kernel's epilogue (gguf_epilogue.cpp) before it leaves: `bias` (floats [n])
// added, and `epilogue` "swiglu": Y [..., n/2] = silu(first half) * second half (an MLP's gate and
// up as one product, no Split, activation and Mul nodes after it).
// The embedding's rows are read in place (the page cache's pages, shared by every session and
// process); a product's weight is packed once per process into the layout its kernel streams
// (gguf_packed.cpp: the file's size, Q4_K +2.8 %), shared by every session that names the same
// tensor, and the file's pages it was packed from are let go (a tied embedding reads them back). The
// engine's loader checks the file (path, size, hash) before ONNX Runtime sees the graph; a file this
// operator cannot map or that is shorter than the node expects is an error of the first run that
// names it.

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

extern "C" {
int64_t specrt_row_bytes(int type, int64_t K);
void* specrt_weight_rows(int type, const uint8_t* const* rows, int64_t N, int64_t K);
void specrt_weight_free(void* h);
int64_t specrt_weight_packed_bytes(const void* h);
int specrt_weight_matmul_ex(const void* h, const float* x, int64_t M, float* y, int threads, const float* bias,
                            int epilogue);
int specrt_get_rows(int type, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t n, float* out);
int specrt_threads();
}

namespace {

std::mutex base_mu;
std::string base_dir;  // where a node's relative file path starts (the graph's folder; set by the loader)

struct Mapped {
  const uint8_t* data = nullptr;
  size_t size = 0;
};

// A product's weight (specrt_weight_rows), one per tensor (or tensors and order) of a file for the
// process: the sessions of an engine (and a second engine on the same GGUF) share it; freed with
// the last kernel naming it. `spans` are the tensors' bytes, let go once packed.
std::shared_ptr<void> product_weight(const std::string& key, int type, int64_t k, const std::vector<const uint8_t*>& rows,
                                     const std::vector<std::pair<const uint8_t*, int64_t>>& spans) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<void>> weights;
  std::lock_guard<std::mutex> lock(mu);
  if (auto held = weights[key].lock()) return held;
  std::shared_ptr<void> h(specrt_weight_rows(type, rows.data(), (int64_t)rows.size(), k), specrt_weight_free);
  if (h && specrt_weight_packed_bytes(h.get()) > 0) {  // its kernel reads the packed copy: drop the pages
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (auto [w, bytes] : spans) {
      uintptr_t a = ((uintptr_t)w + page - 1) / page * page, e = ((uintptr_t)w + (uintptr_t)bytes) / page * page;
      if (e > a) madvise((void*)a, e - a, MADV_DONTNEED);  // a read-only file mapping: they come back if read
    }
  }
  weights[key] = h;
  return h;
}

// file -> its read-only mapping, made once and kept for the process (the engines' weights)
Mapped map_file(const std::string& path, std::string* error) {
  static std::mutex mu;
  static std::map<std::string, Mapped> files;
  std::lock_guard<std::mutex> lock(mu);
  auto it = files.find(path);
  if (it != files.end()) return it->second;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *error = "cannot open the GGUF file " + path;
    return {};
  }
  struct stat st {};
  fstat(fd, &st);
  void* p = st.st_size > 0 ? mmap(nullptr, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (p == MAP_FAILED) {
    *error = "cannot map the GGUF file " + path;
    return {};
  }
  Mapped m{(const uint8_t*)p, (size_t)st.st_size};
  files[path] = m;
  return m;
}

// an optional list attribute (empty when the node has none)
template <class T>
std::vector<T> optional_list(const Ort::ConstKernelInfo& ki, const char* name) {
  try {
    return ki.GetAttributes<T>(name);
  } catch (const std::exception&) {
    return {};
  }
}

// the tensor(s) a node names: their bytes in the mapped file, or an error naming the node and the file
struct GgufTensor {
  int type = 0;
  int64_t n = 0, k = 0, row_bytes = 0;
  const uint8_t* w = nullptr;                             // the (first) tensor's bytes
  std::vector<std::pair<const uint8_t*, int64_t>> spans;  // each tensor's bytes
  std::vector<int64_t> offsets, ns, order;
  std::string file, error;

  GgufTensor(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    std::string node = ki.GetNodeName();
    try {
      type = (int)ki.GetAttribute<int64_t>("ggml_type");
      n = ki.GetAttribute<int64_t>("n");
      k = ki.GetAttribute<int64_t>("k");
      offsets = {ki.GetAttribute<int64_t>("offset")};
      file = ki.GetAttribute<std::string>("file");
    } catch (const std::exception& e) {
      error = node + ": " + e.what();
      return;
    }
    ns = {n};
    if (auto po = optional_list<int64_t>(ki, "parts_offset"); !po.empty())
      offsets = po, ns = optional_list<int64_t>(ki, "parts_n");
    order = optional_list<int64_t>(ki, "order");
    int64_t total = 0;
    for (int64_t p : ns) total += p;
    bool rows_known = order.empty() || (int64_t)order.size() == n;
    for (int64_t j : order) rows_known = rows_known && j >= 0 && j < n;
    if (ns.size() != offsets.size() || total != n || !rows_known) {
      error = node + ": parts_offset, parts_n and order do not agree with n " + std::to_string(n);
      return;
    }
    if (!file.empty() && file[0] != '/') {
      std::lock_guard<std::mutex> lock(base_mu);
      file = base_dir + "/" + file;
    }
    row_bytes = specrt_row_bytes(type, k);
    if (row_bytes == 0 || n <= 0) {
      error = node + ": ggml type " + std::to_string(type) + " with k " + std::to_string(k) + " is not one it takes";
      return;
    }
    Mapped m = map_file(file, &error);
    if (!m.data) {
      error = node + ": " + error;
      return;
    }
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (offsets[i] < 0 || ns[i] <= 0 || (uint64_t)offsets[i] + (uint64_t)(ns[i] * row_bytes) > m.size) {
        error = node + ": the GGUF file " + file + " is shorter than its tensor needs (changed or cut short); rebuild the engine";
        return;
      }
      spans.push_back({m.data + offsets[i], ns[i] * row_bytes});
    }
    w = spans[0].first;
  }

  // output column j's weight row (the parts side by side, in `order` where given)
  std::vector<const uint8_t*> rows() const {
    std::vector<const uint8_t*> side;
    for (auto [p, bytes] : spans)
      for (int64_t r = 0; r < bytes / row_bytes; ++r) side.push_back(p + r * row_bytes);
    if (order.empty()) return side;
    std::vector<const uint8_t*> out;
    for (int64_t j : order) out.push_back(side[(size_t)j]);  // each j checked in [0, n) above
    return out;
  }

  // what names the weight for the process: the file, the tensors, the order
  std::string key() const {
    std::string s = file + ":" + std::to_string(type) + ":" + std::to_string(k);
    for (size_t i = 0; i < offsets.size(); ++i) s += "@" + std::to_string(offsets[i]) + "x" + std::to_string(ns[i]);
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the order
    for (int64_t j : order) h = (h ^ (uint64_t)j) * 1099511628211ull;
    return s + (order.empty() ? "" : "/" + std::to_string(h));
  }
};

struct GgufMatMul {
  GgufTensor t;
  std::shared_ptr<void> weight;
  std::vector<float> bias;
  int epilogue = 0;  // gguf_matmul.cpp's Epilogue: 0 none, 1 SwiGLU
  GgufMatMul(const OrtApi*, const OrtKernelInfo* info) : t(info) {
    if (!t.error.empty()) return;
    Ort::ConstKernelInfo ki(info);
    std::string name = ki.GetNodeName(), kind;
    bias = optional_list<float>(ki, "bias");
    try {
      kind = ki.GetAttribute<std::string>("epilogue");
    } catch (const std::exception&) {
    }
    if (!bias.empty() && (int64_t)bias.size() != t.n) {
      t.error = name + ": bias holds " + std::to_string(bias.size()) + " values, not n " + std::to_string(t.n);
      return;
    }
    if (kind == "swiglu" && t.n % 2 == 0) {
      epilogue = 1;
    } else if (!kind.empty()) {
      t.error = name + ": epilogue '" + kind + "' is not one it takes (\"swiglu\", with an even n)";
      return;
    }
    weight = product_weight(t.key(), t.type, t.k, t.rows(), t.spans);
  }

  Ort::Status Compute(const Ort::Custom::Tensor<float>& x, Ort::Custom::Tensor<float>& y) {
    if (!t.error.empty()) return Ort::Status(t.error.c_str(), ORT_FAIL);
    std::vector<int64_t> shape = x.Shape();
    if (shape.empty() || shape.back() != t.k) return Ort::Status("GgufMatMul: X's last axis is not k", ORT_INVALID_ARGUMENT);
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    shape.back() = epilogue == 1 ? t.n / 2 : t.n;
    float* out = y.Allocate(shape);
    if (m == 0) return Ort::Status(nullptr);
    specrt_weight_matmul_ex(weight.get(), x.Data(), m, out, specrt_threads(), bias.empty() ? nullptr : bias.data(),
                            epilogue);
    return Ort::Status(nullptr);
  }
};

struct GgufGather {
  GgufTensor t;
  GgufGather(const OrtApi*, const OrtKernelInfo* info) : t(info) {
    if (t.error.empty() && (t.spans.size() != 1 || !t.order.empty())) t.error = "GgufGather: one tensor, in its order";
  }

  Ort::Status Compute(const Ort::Custom::Tensor<int64_t>& ids, Ort::Custom::Tensor<float>& y) {
    if (!t.error.empty()) return Ort::Status(t.error.c_str(), ORT_FAIL);
    std::vector<int64_t> shape = ids.Shape();
    int64_t count = 1;
    for (int64_t s : shape) count *= s;
    shape.push_back(t.k);
    float* out = y.Allocate(shape);
    if (count == 0) return Ort::Status(nullptr);
    if (specrt_get_rows(t.type, t.w, t.n, t.k, ids.Data(), count, out) != 0)
      return Ort::Status("GgufGather: a token id is outside the embedding's rows", ORT_INVALID_ARGUMENT);
    return Ort::Status(nullptr);
  }
};

}  // namespace

// the folder relative file attributes start from, for the sessions created next (the loader
// sets it to the graph's folder just before it creates a session of that graph)
extern "C" void specrt_set_base_dir(const char* dir) {
  std::lock_guard<std::mutex> lock(base_mu);
  base_dir = dir ? dir : "";
}

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static Ort::CustomOpDomain domain{"specrt"};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> matmul{
      Ort::Custom::CreateLiteCustomOp<GgufMatMul>("GgufMatMul", "CPUExecutionProvider")};
  static std::unique_ptr<Ort::Custom::OrtLiteCustomOp> gather{
      Ort::Custom::CreateLiteCustomOp<GgufGather>("GgufGather", "CPUExecutionProvider")};
  static std::once_flag added;
  std::call_once(added, [] {
    domain.Add(matmul.get());
    domain.Add(gather.get());
  });
  try {
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const std::exception& e) {
    return Ort::Status(e.what(), ORT_FAIL).release();
  }
  return nullptr;
}
