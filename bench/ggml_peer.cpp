// ggml's own CPU product on the same blocks, for bench_gguf_kernel.py's side by side: a small
// shared library over the ggml that llama.cpp's build made (DESIGN.md, "Peers on this machine"),
// loaded by ctypes. Only ggml's public headers and built libraries are used.
//
//   peer_open(type, n, k, blocks, repack)  W [n rows of k weights] as the file stores them, in
//       ggml's plain CPU buffer (repack 0: its vec_dot kernels) or in its CPU_REPACK buffer
//       (repack 1: the interleaved copy llama-server makes where a type and CPU have one);
//       nullptr where that buffer takes no such product
//   peer_matmul(h, x, m, y, threads)       y [m, n] = x [m, k] W^T (x float32; ggml quantizes it)
//   peer_close(h)

#include <cstdint>
#include <cstring>
#include <map>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace {

struct Graph {  // one row count's graph: x [k, m] -> y [n, m]
  ggml_context* ctx = nullptr;
  ggml_backend_buffer_t buf = nullptr;
  ggml_tensor *x = nullptr, *y = nullptr;
  ggml_cgraph* gf = nullptr;
};

struct Peer {
  int64_t n = 0, k = 0;
  ggml_context* wctx = nullptr;
  ggml_backend_buffer_t wbuf = nullptr;
  ggml_tensor* w = nullptr;
  ggml_backend_t backend = nullptr;
  std::map<int64_t, Graph> graphs;
};

ggml_context* context(int tensors, bool graph) {
  size_t bytes = ggml_tensor_overhead() * tensors + (graph ? ggml_graph_overhead() : 0);
  return ggml_init({bytes, nullptr, true});
}

ggml_backend_buffer_type_t repack_buffer(ggml_backend_dev_t dev) {
  auto reg = ggml_backend_dev_backend_reg(dev);
  auto get = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
  for (auto p = get ? get(dev) : nullptr; p && *p; ++p)
    if (std::strcmp(ggml_backend_buft_name(*p), "CPU_REPACK") == 0) return *p;
  return nullptr;
}

Graph& graph(Peer& p, int64_t m) {
  auto it = p.graphs.find(m);
  if (it != p.graphs.end()) return it->second;
  Graph g;
  g.ctx = context(3, true);
  g.x = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, p.k, m);
  g.y = ggml_mul_mat(g.ctx, p.w, g.x);
  g.gf = ggml_new_graph(g.ctx);
  ggml_build_forward_expand(g.gf, g.y);
  g.buf = ggml_backend_alloc_ctx_tensors_from_buft(g.ctx, ggml_backend_cpu_buffer_type());
  return p.graphs.emplace(m, g).first->second;
}

}  // namespace

extern "C" {

void peer_close(void* h);

void* peer_open(int type, int64_t n, int64_t k, const void* blocks, int repack) {
  ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  ggml_backend_buffer_type_t buft = repack ? repack_buffer(dev) : ggml_backend_cpu_buffer_type();
  if (dev == nullptr || buft == nullptr) return nullptr;
  auto p = new Peer;
  p->n = n, p->k = k;
  p->wctx = context(1, false);
  p->w = ggml_new_tensor_2d(p->wctx, (ggml_type)type, k, n);
  p->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(p->wctx, buft);
  if (p->wbuf == nullptr) return peer_close(p), nullptr;
  ggml_backend_buffer_set_usage(p->wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
  if (repack) {  // as llama.cpp decides: the device takes the product with W in that buffer
    ggml_context* probe = context(2, false);
    ggml_tensor* op = ggml_mul_mat(probe, p->w, ggml_new_tensor_2d(probe, GGML_TYPE_F32, k, 1));
    bool ok = ggml_backend_dev_supports_op(dev, op);
    ggml_free(probe);
    if (!ok) return peer_close(p), nullptr;
  }
  ggml_backend_tensor_set(p->w, blocks, 0, ggml_nbytes(p->w));
  p->backend = ggml_backend_cpu_init();
  return p;
}

void peer_matmul(void* h, const float* x, int64_t m, float* y, int threads) {
  auto& p = *(Peer*)h;
  Graph& g = graph(p, m);
  ggml_backend_tensor_set(g.x, x, 0, ggml_nbytes(g.x));
  ggml_backend_cpu_set_n_threads(p.backend, threads);
  ggml_backend_graph_compute(p.backend, g.gf);
  ggml_backend_tensor_get(g.y, y, 0, ggml_nbytes(g.y));
}

void peer_close(void* h) {
  auto p = (Peer*)h;
  for (auto& kv : p->graphs) {
    ggml_backend_buffer_free(kv.second.buf);
    ggml_free(kv.second.ctx);
  }
  if (p->backend) ggml_backend_free(p->backend);
  if (p->wbuf) ggml_backend_buffer_free(p->wbuf);
  if (p->wctx) ggml_free(p->wctx);
  delete p;
}

}  // extern "C"
