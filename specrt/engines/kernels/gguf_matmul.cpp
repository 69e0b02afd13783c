// y = x W^T with W a GGUF tensor's bytes as stored (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), x float32
// quantized to int8 in blocks: the layer products of a GGUF model. This file: the threads, a
// weight's life and the C API; gguf_packed.cpp: the kernels, on W packed 16 columns at a time
// (the file's size), and the scalar reference on the file's own blocks.
//
//   x  [M, K] float32 (row-major)       W  [N, row_bytes(type, K)] uint8: the file's rows, as stored
//   y  [M, N] float32                    M: any (a step's rows: 1..17 verify, hundreds prefill)
//
// Why written here: ONNX Runtime's MatMulNBits rewrites these blocks (1.39 GB read a token where the
// file holds 1.0) and unpacks each weight again for every pair of rows; ggml's kernels are not
// batch-invariant (gemm for groups of rows, gemv for the rest). This one reads each weight block
// once per group of rows and computes every output row in one fixed order, whatever the number of
// rows and threads: threads split the output columns, rows never share arithmetic.

#include "gguf_blocks.h"

#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace specrt_kernels {

int64_t packed_bytes(int type, int64_t N, int64_t K);
void pack(int type, const uint8_t* const* rows, int64_t N, int64_t K, uint8_t* out);
void reference(int type, const uint8_t* const* rows, int64_t N, int64_t K, const char* xq, int64_t xstride, int64_t M,
               int64_t n0, int64_t n1, float* y);
bool packed_groups(int type, const uint8_t* packed, int64_t N, int64_t K, int64_t g0, int64_t g1, const char* xq,
                   int64_t xstride, int64_t M, float* y);
void quantize_rows(const float* x, int64_t K, bool k, int64_t r0, int64_t r1, char* out, int64_t xstride);
void silu_mul(const float* g, const float* u, float* out, int64_t n);

namespace {

// -- dispatch ------------------------------------------------------------------------------------

int detect_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return AVX512VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return SCALAR;
}

std::atomic<int> g_isa{-1};

// -- threads: a small pool that splits output columns --------------------------------------------

// Workers wait for the next call spinning for a short while (a step's products come one after
// another, and waking a sleeping thread cost ~0.1-0.2 ms here, as much as a product), then sleep.
class Pool {
 public:
  template <class F>
  void run(int n, const F& fn) {  // fn(i) for i < n, i on thread i (0: the caller)
    if (n <= 1) return fn(0);
    std::lock_guard<std::mutex> one_call(call_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while ((int)workers_.size() < n - 1) {
        int id = (int)workers_.size() + 1;
        workers_.emplace_back([this, id] { loop(id); });
      }
    }
    job_ = [&fn](int i) { fn(i); };
    wanted_.store(n, std::memory_order_relaxed);
    pending_.store(n - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load()) cv_.notify_all();
    fn(0);
    while (pending_.load(std::memory_order_acquire) != 0) pause();
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      for (int spin = 0; spin < 20000 && generation_.load(std::memory_order_acquire) == seen; ++spin) pause();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        sleeping_.fetch_sub(1);
      }
      if (stop_) return;
      seen = generation_.load(std::memory_order_acquire);
      if (id < wanted_.load(std::memory_order_relaxed)) {
        job_(id);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }
  std::mutex mu_, call_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::function<void(int)> job_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> wanted_{0}, pending_{0}, sleeping_{0};
  bool stop_ = false;
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

int isa() {
  int v = g_isa.load();
  if (v < 0) g_isa.store(v = detect_isa());
  return v;
}

}  // namespace specrt_kernels

using namespace specrt_kernels;

extern "C" int64_t specrt_row_bytes(int type, int64_t K);

// A weight ready for products: W as the file stores it and, where this CPU has a SIMD path, W
// packed 16 columns at a time (gguf_packed.cpp: the file's size, +2.8 % for Q4_K).
struct SpecrtWeight {
  int type;
  int64_t N, K;
  std::vector<const uint8_t*> rows;  // row n's blocks as stored (the caller keeps them mapped)
  // the packed copy, 2 MB-aligned and asked for huge pages: a product streams it with 512x fewer TLB
  // misses (measured: a 7.7 MB product read from memory at ~20 GB/s on 4 KB pages)
  struct Packed {
    void* mapping = nullptr;  // what mmap gave (the slack before the aligned start stays mapped)
    size_t mapped = 0, n = 0;
    uint8_t* p = nullptr;     // the aligned start
    ~Packed() { if (mapping) munmap(mapping, mapped); }
    bool empty() const { return n == 0; }
    uint8_t* data() const { return p; }
    bool allocate(size_t bytes) {
      const size_t huge = size_t(2) << 20, rounded = (bytes + huge - 1) / huge * huge;
      void* m = mmap(nullptr, rounded + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) return false;
      mapping = m, mapped = rounded + huge, n = bytes;
      p = (uint8_t*)(((uintptr_t)m + huge - 1) / huge * huge);
#ifdef MADV_HUGEPAGE
      madvise(p, rounded, MADV_HUGEPAGE);
#endif
      return true;
    }
  } packed;
};

namespace {

// y [M, N] = x [M, K] W^T: x quantized once, threads split the columns (groups of 16)
void product(const SpecrtWeight& h, const float* x, int64_t M, float* y, int threads) {
  const int type = h.type;
  const int64_t N = h.N, K = h.K, nb = K / block_values(type);
  const bool k = block_values(type) == QKK;
  const int64_t xstride = k ? nb * (int64_t)sizeof(QXK) : nb * (int64_t)sizeof(QX32);
  std::vector<char> xq((size_t)(xstride * M));
  if (threads <= 0) threads = (int)std::max(1u, std::thread::hardware_concurrency());
  const int TQ = M >= 8 ? threads : 1;  // a prompt's rows quantized by every thread, a step's by one
  pool().run(TQ, [&](int t) { quantize_rows(x, K, k, M * t / TQ, M * (t + 1) / TQ, xq.data(), xstride); });
  const int T = (int)std::min<int64_t>(threads, std::max<int64_t>(1, N / 64));
  const bool simd = !h.packed.empty() && isa() != SCALAR;
  const int64_t units = simd ? (N + 15) / 16 : N;  // groups of 16 columns, or columns
  pool().run(T, [&](int t) {
    const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
    if (!simd || !packed_groups(type, h.packed.data(), N, K, u0, u1, xq.data(), xstride, M, y))
      reference(type, h.rows.data(), N, K, xq.data(), xstride, M, u0, u1, y);
  });
}

// what a product's output goes through (gguf_epilogue.cpp): none, or SwiGLU
enum Epilogue { NONE = 0, SWIGLU = 1 };

// whether an epilogue applies to N output columns (SwiGLU halves them: an even N)
bool takes(int epilogue, int64_t N) { return epilogue == NONE || (epilogue == SWIGLU && N % 2 == 0); }

// y = epilogue(x W^T + bias): y [M, N], or [M, N/2] = silu(first half) * second half (SWIGLU,
// the product written to a scratch first); the bias [N] (or nullptr) added before. Rows split
// over the threads where there are many (a prompt), one thread for a step's few.
void product_epilogue(const SpecrtWeight& h, const float* x, int64_t M, float* y, int threads, const float* bias,
                      int epilogue) {
  const int64_t N = h.N;
  // not zero-filled: the product writes every element (a 17-row step's 28 scratches were ~34 MB of memset)
  std::unique_ptr<float[]> scratch(epilogue == SWIGLU ? new float[(size_t)(M * N)] : nullptr);
  float* full = epilogue == SWIGLU ? scratch.get() : y;
  product(h, x, M, full, threads);
  if (!bias && epilogue == NONE) return;
  if (threads <= 0) threads = (int)std::max(1u, std::thread::hardware_concurrency());
  const int T = M >= 8 ? threads : 1;
  pool().run(T, [&](int t) {
    for (int64_t r = M * t / T; r < M * (t + 1) / T; ++r) {
      float* row = full + r * N;
      if (bias)
        for (int64_t j = 0; j < N; ++j) row[j] += bias[j];
      if (epilogue == SWIGLU) silu_mul(row, row + N / 2, y + r * (N / 2), N / 2);
    }
  });
}

}  // namespace

// -- the C API (ctypes and the ONNX Runtime operator call these) ---------------------------------

extern "C" {

// the threads the ONNX Runtime operators split columns over (0: one per core); set by the loader
static std::atomic<int> g_threads{0};
int specrt_threads() { return g_threads.load(); }
void specrt_set_threads(int n) { g_threads.store(n < 0 ? 0 : n); }

// 0: scalar reference, 1: AVX2, 2: AVX-512 VNNI (what this CPU runs)
int specrt_isa() { return isa(); }

// run the reference (0) or the CPU's best path (-1); returns the path now in use
int specrt_force_isa(int v) {
  g_isa.store(v < 0 ? detect_isa() : std::min(v, detect_isa()));
  return g_isa.load();
}

// bytes of one row of K weights of a type; 0 for a type or K this library does not take
int64_t specrt_row_bytes(int type, int64_t K) {
  size_t bb = block_bytes(type);
  if (bb == 0 || K <= 0 || K % block_values(type) != 0) return 0;
  return (int64_t)bb * (K / block_values(type));
}

// W ready for products from its N rows (rows[n]: row n's blocks as stored, anywhere: several
// tensors of one type and K side by side, in any row order), packed once where this CPU has a SIMD
// path; the caller keeps the rows mapped while the weight lives. nullptr for a type or K this
// library does not take.
void* specrt_weight_rows(int type, const uint8_t* const* rows, int64_t N, int64_t K) {
  if (specrt_row_bytes(type, K) == 0 || N <= 0) return nullptr;
  auto h = new SpecrtWeight{type, N, K, std::vector<const uint8_t*>(rows, rows + N), {}};
  if (detect_isa() != SCALAR && h->packed.allocate((size_t)packed_bytes(type, N, K)))
    pack(type, rows, N, K, h->packed.data());
  return h;
}

// the same for W [N, row bytes] as one tensor stores it
void* specrt_weight(int type, const uint8_t* w, int64_t N, int64_t K) {
  const int64_t rb = specrt_row_bytes(type, K);
  if (rb == 0 || N <= 0) return nullptr;
  std::vector<const uint8_t*> rows((size_t)N);
  for (int64_t n = 0; n < N; ++n) rows[(size_t)n] = w + n * rb;
  return specrt_weight_rows(type, rows.data(), N, K);
}

void specrt_weight_free(void* h) { delete (SpecrtWeight*)h; }

// bytes of the packed copy a weight holds (0: products read the file's blocks in place)
int64_t specrt_weight_packed_bytes(const void* h) { return (int64_t)((const SpecrtWeight*)h)->packed.n; }

// y [M, N] = x [M, K] W^T; threads split the columns (0: one per core)
void specrt_weight_matmul(const void* h, const float* x, int64_t M, float* y, int threads) {
  if (M > 0) product(*(const SpecrtWeight*)h, x, M, y, threads);
}

// y = epilogue(x W^T + bias) (bias [N] or nullptr; epilogue 0: y [M, N], 1: SwiGLU, y [M, N/2]
// = silu(first half) * second half). Returns 0, or -1 for an epilogue it does not take (SwiGLU
// of an odd N).
int specrt_weight_matmul_ex(const void* h, const float* x, int64_t M, float* y, int threads, const float* bias,
                            int epilogue) {
  const SpecrtWeight& w = *(const SpecrtWeight*)h;
  if (!takes(epilogue, w.N)) return -1;
  if (M > 0) product_epilogue(w, x, M, y, threads, bias, epilogue);
  return 0;
}

// y [M, N] = x [M, K] W^T, W [N, row_bytes] as stored (packed for this call where a weight would
// be). Returns 0, or -1 for a type or K it does not take.
int specrt_matmul_ex(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
                     int threads, const float* bias, int epilogue);

int specrt_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
                  int threads) {
  return specrt_matmul_ex(type, w, N, K, x, M, y, threads, nullptr, NONE);
}

// the same with specrt_weight_matmul_ex's bias and epilogue
int specrt_matmul_ex(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
                     int threads, const float* bias, int epilogue) {
  if (specrt_row_bytes(type, K) == 0 || !takes(epilogue, N)) return -1;
  if (N <= 0 || M <= 0) return 0;
  SpecrtWeight* h = (SpecrtWeight*)specrt_weight(type, w, N, K);
  product_epilogue(*h, x, M, y, threads, bias, epilogue);
  delete h;
  return 0;
}

// out [n, K] = the rows ids of W dequantized (an embedding read by row from its blocks)
int specrt_get_rows(int type, const uint8_t* w, int64_t N, int64_t K, const int64_t* ids, int64_t n, float* out) {
  int64_t rb = specrt_row_bytes(type, K);
  if (rb == 0) return -1;
  int64_t nb = K / block_values(type);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= N) return -2;
    const uint8_t* row = w + ids[i] * rb;
    float* o = out + i * K;
    for (int64_t b = 0; b < nb; ++b) {
      if (block_values(type) == QK) {
        Unpacked32 u;
        unpack32(type, row + b * block_bytes(type), &u);
        for (int j = 0; j < QK; ++j) o[b * QK + j] = u.d * (float)((int)u.u[j] - u.bias) + u.m;
      } else {
        UnpackedK u;
        unpack_k(type, row + b * block_bytes(type), &u);
        for (int j = 0; j < QKK; ++j) {
          float scale = u.d * (float)u.sc[j / u.sub];
          float v = scale * (float)((int)u.u[j] - u.bias);
          o[b * QKK + j] = type == Q4_K ? v - u.dmin * (float)u.mins[j / 32] : v;
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
