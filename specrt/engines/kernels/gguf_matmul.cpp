// y = x W^T with W a GGUF tensor's bytes as stored (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), x float32
// quantized to int8 in blocks: the layer products of a GGUF model. This file: the legacy 32-weight
// types, the threads and the C API; gguf_kquants.cpp: the k-quants, packed 16 columns at a time.
//
//   x  [M, K] float32 (row-major)       W  [N, row_bytes(type, K)] uint8: the file's rows, as stored
//   y  [M, N] float32                    M: any (a step's rows: 1..17 verify, hundreds prefill)
//
// Why written here: ONNX Runtime's MatMulNBits rewrites these blocks (1.39 GB read a token where the
// file holds 1.0) and unpacks each weight again for every pair of rows; ggml's kernels are not
// batch-invariant (gemm for groups of rows, gemv for the rest). This one reads each weight block
// once per group of rows and computes every output row in one fixed order, whatever the number of
// rows and threads: threads split the output columns, rows never share arithmetic.
//
// Numbers of the legacy types (one definition, the scalar reference below; every SIMD path gives
// the same bits): x is quantized per 32 values (QX32: d = max|x|/127, codes nearbyint(x/d), their
// sum), as llama.cpp does. Weight codes are unsigned (a type's bias subtracted through the x sums),
// so one u8 x s8 dot serves every type. Integer dots are exact; a block's integer lanes (lane i:
// the products at k with (k >> 2) & 7 == i) are converted and accumulated into 8 float lanes with
// one fma each, offsets (Q4_1's m) into one float, and the lanes are summed in one tree order.

#include "gguf_blocks.h"

#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specrt_kernels {

int64_t kq_packed_bytes(int type, int64_t N, int64_t K);
void kq_pack(int type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out);
void kq_reference(int type, const uint8_t* w, int64_t N, int64_t K, const char* xq, int64_t xstride, int64_t M,
                  int64_t n0, int64_t n1, float* y);
bool kq_groups(int type, const uint8_t* packed, int64_t N, int64_t K, int64_t g0, int64_t g1, const char* xq,
               int64_t xstride, int64_t M, float* y);
void quantize_rows(const float* x, int64_t K, bool k, int64_t r0, int64_t r1, char* out, int64_t xstride);

namespace {

constexpr int ROWS = 16, TILE = 32;  // rows a pass; TILE: columns whose weights stay in cache

// -- the float part of the legacy types, shared by every path --------------------------------------------------------

struct Acc {  // one output (row, column): 16 float lanes and 4 lanes of offsets
  float lane[16] = {};
  float off[4] = {};
  void add(float scale, const int32_t* ilane, int first, int count) {
    for (int i = 0; i < count; ++i) lane[first + i] = std::fma(scale, (float)ilane[i], lane[first + i]);
  }
  float total() const {  // lanes i and i + 8, then i and i + 4, i and i + 2, the two; the offsets alike
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; ++i) s8[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
    return (s2[0] + s2[1]) + ((off[0] + off[2]) + (off[1] + off[3]));
  }
};

// -- scalar reference: unpack a block's codes (unsigned, natural order) and its numbers ---------

// A 32-weight block (legacy types): codes c[32] (unsigned but Q8_0's, which are its signed
// values), float scale d, integer bias, float offset m.
struct Unpacked32 { int16_t u[QK]; float d, m; int bias; };

void unpack32(int type, const uint8_t* p, Unpacked32* o) {
  o->m = 0;
  switch (type) {
    case Q4_0: {
      auto b = (const BQ4_0*)p;
      for (int j = 0; j < 16; ++j) { o->u[j] = b->qs[j] & 0xF; o->u[j + 16] = b->qs[j] >> 4; }
      o->d = fp16(b->d); o->bias = 8;
      break;
    }
    case Q4_1: {
      auto b = (const BQ4_1*)p;
      for (int j = 0; j < 16; ++j) { o->u[j] = b->qs[j] & 0xF; o->u[j + 16] = b->qs[j] >> 4; }
      o->d = fp16(b->d); o->m = fp16(b->m); o->bias = 0;
      break;
    }
    case Q5_0: {
      auto b = (const BQ5_0*)p;
      uint32_t qh;
      std::memcpy(&qh, b->qh, 4);
      for (int j = 0; j < 16; ++j) {
        o->u[j] = (b->qs[j] & 0xF) | (((qh >> j) << 4) & 0x10);
        o->u[j + 16] = (b->qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
      }
      o->d = fp16(b->d); o->bias = 16;
      break;
    }
    case Q8_0: {
      auto b = (const BQ8_0*)p;
      for (int j = 0; j < QK; ++j) o->u[j] = b->qs[j];
      o->d = fp16(b->d); o->bias = 0;
      break;
    }
  }
}

// The integer lanes of one block: lane i = sum over k with (k >> 2) & 7 == i (a 32-weight block:
// 8 lanes, into float lanes 8 (b & 1) + i) or (k >> 2) & 15 == i (a 256-weight block: 16 lanes) of
// code * x (times the k's sub-block scale), the bias folded into lane 0.
void lanes32(const Unpacked32& w, const QX32& x, int32_t* il) {
  for (int i = 0; i < 8; ++i) il[i] = 0;
  for (int k = 0; k < QK; ++k) il[(k >> 2) & 7] += (int32_t)w.u[k] * x.q[k];
  il[0] -= w.bias * x.sum;
}

// y[r] (r < R) of one column over all K: the reference every path must equal.
void column_ref(int type, const uint8_t* wrow, int64_t nb, const void* xq, int64_t xstride, int R, Acc* acc) {
  int32_t il[16];
  Unpacked32 w;
  for (int64_t b = 0; b < nb; ++b) {
    unpack32(type, wrow + b * block_bytes(type), &w);
    for (int r = 0; r < R; ++r) {
      const QX32& x = ((const QX32*)((const char*)xq + r * xstride))[b];
      lanes32(w, x, il);
      acc[r].add(w.d * x.d, il, 8 * (int)(b & 1), 8);
      if (type == Q4_1) acc[r].off[0] = std::fma(w.m * x.d, (float)x.sum, acc[r].off[0]);
    }
  }
}

// -- AVX-512 VNNI: a block unpacked once into registers, a dot per row (legacy types) ----------

#if defined(__x86_64__)

SPECRT_AVX512 inline float half_avx(uint16_t h) { return _cvtsh_ss(h); }  // = fp16(h), in one instruction

SPECRT_AVX512 inline float fma1(float a, float b, float c) {  // std::fma, as the instruction
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

// A legacy 32-weight block's codes (unsigned, natural order), d and m, unpacked in registers.
// Q8_0's codes are its signed values: their magnitudes here, and x takes their signs (sign_epi8)
SPECRT_AVX512 inline __m256i codes32(int type, const uint8_t* p, float* d, float* m, __m256i* sign) {
  const __m128i low = _mm_set1_epi8(0x0F);
  *m = 0;
  switch (type) {
    case Q8_0: {
      auto b = (const BQ8_0*)p;
      *d = half_avx(b->d);
      *sign = _mm256_loadu_si256((const __m256i*)b->qs);
      return _mm256_abs_epi8(*sign);
    }
    case Q5_0: {
      auto b = (const BQ5_0*)p;
      __m128i q = _mm_loadu_si128((const __m128i*)b->qs);
      __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
      uint32_t qh;
      std::memcpy(&qh, b->qh, 4);
      *d = half_avx(b->d);
      return _mm256_or_si256(nib, _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10)));
    }
    default: {  // Q4_0, Q4_1: d, [m,] 16 bytes of nibbles
      const uint8_t* qs = type == Q4_1 ? ((const BQ4_1*)p)->qs : ((const BQ4_0*)p)->qs;
      *d = half_avx(*(const uint16_t*)p);
      if (type == Q4_1) *m = half_avx(((const BQ4_1*)p)->m);
      __m128i q = _mm_loadu_si128((const __m128i*)qs);
      return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
    }
  }
}

// legacy 32-weight types, R rows: blocks in pairs, block b's 8 integer lanes into float lanes
// 8 (b & 1) + i as the reference adds them (a lone last block: the other half's scale is 0)
template <int R>
SPECRT_AVX512 void rows32(int type, const uint8_t* wrow, int64_t nb, const char* xq, int64_t xstride, Acc* acc) {
  const int bias = type == Q5_0 ? 16 : type == Q4_0 ? 8 : 0;
  const size_t bb = block_bytes(type);
  __m512 a[R];
  float off[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { a[r] = _mm512_setzero_ps(); off[r] = 0; }
  for (int64_t b = 0; b < nb; b += 2) {
    bool pair = b + 1 < nb;
    float d0, m0, d1 = 0, m1 = 0;
    __m256i g0 = _mm256_set1_epi8(1), g1 = g0;  // the signs x takes (Q8_0), else +1
    __m256i u0 = codes32(type, wrow + b * bb, &d0, &m0, &g0);
    __m256i u1 = pair ? codes32(type, wrow + (b + 1) * bb, &d1, &m1, &g1) : _mm256_setzero_si256();
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const QX32* x = (const QX32*)(xq + r * xstride) + b;
      __m256i x0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x[0].q), g0);
      __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, x0);
      p0 = _mm256_sub_epi32(p0, _mm256_maskz_set1_epi32(1, bias * x[0].sum));
      __m256i p1 = _mm256_setzero_si256();
      float s1 = 0;
      if (pair) {
        __m256i x1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x[1].q), g1);
        p1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, x1);
        p1 = _mm256_sub_epi32(p1, _mm256_maskz_set1_epi32(1, bias * x[1].sum));
        s1 = d1 * x[1].d;
      }
      __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(d0 * x[0].d), _mm256_set1_ps(s1), 1);
      __m512i lanes = _mm512_inserti64x4(_mm512_castsi256_si512(p0), p1, 1);
      a[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(lanes), a[r]);
      if (type == Q4_1) {
        off[r] = fma1(m0 * x[0].d, (float)x[0].sum, off[r]);
        if (pair) off[r] = fma1(m1 * x[1].d, (float)x[1].sum, off[r]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { _mm512_storeu_ps(acc[r].lane, a[r]); acc[r].off[0] = off[r]; }
}

SPECRT_AVX512 void rows32_any(int type, const uint8_t* wrow, int64_t nb, const char* xq, int64_t xs, int R,
                              Acc* acc) {
  for (int r0 = 0; r0 < R; r0 += 8) {
    const char* x = xq + r0 * xs;
    switch (std::min(8, R - r0)) {
      case 1: rows32<1>(type, wrow, nb, x, xs, acc + r0); break;
      case 2: rows32<2>(type, wrow, nb, x, xs, acc + r0); break;
      case 3: rows32<3>(type, wrow, nb, x, xs, acc + r0); break;
      case 4: rows32<4>(type, wrow, nb, x, xs, acc + r0); break;
      case 5: rows32<5>(type, wrow, nb, x, xs, acc + r0); break;
      case 6: rows32<6>(type, wrow, nb, x, xs, acc + r0); break;
      case 7: rows32<7>(type, wrow, nb, x, xs, acc + r0); break;
      default: rows32<8>(type, wrow, nb, x, xs, acc + r0); break;
    }
  }
}
#endif

// -- AVX2 (with FMA and F16C): the same lanes in two 8-lane halves, up to 4 rows a pass ---------

#if defined(__x86_64__)

// one chunk's integer lanes: codes (u8) . x (s8) in pairs (maddubs: <= 2 * 63 * 127 or, for
// Q8_0's magnitudes, 2 * 128 * 127: no saturation), times the 16-bit lanes' scales, summed in 4s
SPECRT_AVX2 inline __m256i dot32(__m256i u, __m256i x, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale16);
}

// legacy 32-weight blocks: block b's 8 lanes into the half b & 1
template <int R>
SPECRT_AVX2 void rows32_avx2(int type, const uint8_t* wrow, int64_t nb, const char* xq, int64_t xstride, Acc* acc) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256 half[R][2];
  float off[R];
  for (int r = 0; r < R; ++r) { half[r][0] = half[r][1] = _mm256_setzero_ps(); off[r] = 0; }
  const size_t bb = block_bytes(type);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = wrow + b * bb;
    float d = _cvtsh_ss(*(const uint16_t*)p), m = type == Q4_1 ? _cvtsh_ss(((const BQ4_1*)p)->m) : 0.0f;
    __m256i u, g = _mm256_set1_epi8(1);
    int bias = 0;
    if (type == Q8_0) {
      g = _mm256_loadu_si256((const __m256i*)((const BQ8_0*)p)->qs);
      u = _mm256_abs_epi8(g);
    } else {
      const uint8_t* qs = type == Q4_1 ? ((const BQ4_1*)p)->qs : type == Q5_0 ? ((const BQ5_0*)p)->qs : ((const BQ4_0*)p)->qs;
      __m128i q = _mm_loadu_si128((const __m128i*)qs);
      u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low);
      bias = type == Q4_0 ? 8 : 0;
      if (type == Q5_0) {  // the 32 high bits as 0x10 bytes
        uint32_t qh;
        std::memcpy(&qh, ((const BQ5_0*)p)->qh, 4);
        __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                              0x0101010101010101, 0x0000000000000000));
        __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        bias = 16;
      }
    }
    int h = (int)(b & 1);
    for (int r = 0; r < R; ++r) {
      const QX32& x = ((const QX32*)(xq + r * xstride))[b];
      __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)x.q), g);
      __m256i t = dot32(u, xs, ones);
      t = _mm256_sub_epi32(t, _mm256_setr_epi32(bias * x.sum, 0, 0, 0, 0, 0, 0, 0));
      half[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(t), half[r][h]);
      if (type == Q4_1) off[r] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(m * x.d), _mm_set_ss((float)x.sum), _mm_set_ss(off[r])));
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc[r].lane, half[r][0]);
    _mm256_storeu_ps(acc[r].lane + 8, half[r][1]);
    acc[r].off[0] = off[r];
  }
}

SPECRT_AVX2 void rows_avx2(int type, const uint8_t* wrow, int64_t nb, const char* xq, int64_t xs, int R, Acc* acc) {
  for (int r0 = 0; r0 < R; r0 += 4) {
    const char* x = xq + r0 * xs;
    int n = std::min(4, R - r0);
    if (n == 1) rows32_avx2<1>(type, wrow, nb, x, xs, acc + r0);
    else if (n == 2) rows32_avx2<2>(type, wrow, nb, x, xs, acc + r0);
    else if (n == 3) rows32_avx2<3>(type, wrow, nb, x, xs, acc + r0);
    else rows32_avx2<4>(type, wrow, nb, x, xs, acc + r0);
  }
}
#endif

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

void column(int type, const uint8_t* wrow, int64_t nb, const void* xq, int64_t xstride, int R, Acc* acc) {
#if defined(__x86_64__)
  if (isa() == AVX512VNNI) return rows32_any(type, wrow, nb, (const char*)xq, xstride, R, acc);
  if (isa() == AVX2) return rows_avx2(type, wrow, nb, (const char*)xq, xstride, R, acc);
#endif
  column_ref(type, wrow, nb, xq, xstride, R, acc);
}

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

// A weight ready for products: W as the file stores it and, for the k-quants where this CPU has a
// SIMD path, W packed 16 columns at a time (gguf_kquants.cpp: the file's size, +2.8 % for Q4_K).
struct SpecrtWeight {
  int type;
  int64_t N, K;
  const uint8_t* w;
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

bool is_kquant(int type) { return type == Q4_K || type == Q6_K; }

// y [M, N] = x [M, K] W^T: x quantized once, threads split the columns (k-quants: groups of 16)
void product(const SpecrtWeight& h, const float* x, int64_t M, float* y, int threads) {
  const int type = h.type;
  const int64_t N = h.N, K = h.K, nb = K / block_values(type), rb = specrt_row_bytes(type, K);
  const bool k = block_values(type) == QKK;
  const int64_t xstride = k ? nb * (int64_t)sizeof(QXK) : nb * (int64_t)sizeof(QX32);
  std::vector<char> xq((size_t)(xstride * M));
  if (threads <= 0) threads = (int)std::max(1u, std::thread::hardware_concurrency());
  const int TQ = M >= 8 ? threads : 1;  // a prompt's rows quantized by every thread, a step's by one
  pool().run(TQ, [&](int t) { quantize_rows(x, K, k, M * t / TQ, M * (t + 1) / TQ, xq.data(), xstride); });
  const int T = (int)std::min<int64_t>(threads, std::max<int64_t>(1, N / 64));
  if (is_kquant(type)) {
    const bool simd = !h.packed.empty() && isa() != SCALAR;
    const int64_t units = simd ? (N + 15) / 16 : N;  // groups of 16 columns, or columns
    pool().run(T, [&](int t) {
      const int64_t u0 = units * t / T, u1 = units * (t + 1) / T;
      if (!simd || !kq_groups(type, h.packed.data(), N, K, u0, u1, xq.data(), xstride, M, y))
        kq_reference(type, h.w, N, K, xq.data(), xstride, M, u0, u1, y);
    });
    return;
  }
  pool().run(T, [&](int t) {
    int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
    Acc acc[ROWS];
    // a tile of columns at a time, every group of rows over it: a tile's weights are read from
    // memory once and from cache for the other groups (a prompt of hundreds of rows)
    for (int64_t c0 = n0; c0 < n1; c0 += TILE) {
      int64_t c1 = std::min(n1, c0 + TILE);
      for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        int R = (int)std::min<int64_t>(ROWS, M - r0);
        for (int64_t n = c0; n < c1; ++n) {
          for (int r = 0; r < R; ++r) acc[r] = Acc();
          column(type, h.w + n * rb, nb, xq.data() + r0 * xstride, xstride, R, acc);
          for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = acc[r].total();
        }
      }
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

// W ready for products (the k-quants packed once, where this CPU has a SIMD path); the caller keeps
// w mapped while the weight lives. nullptr for a type or K this library does not take.
void* specrt_weight(int type, const uint8_t* w, int64_t N, int64_t K) {
  if (specrt_row_bytes(type, K) == 0 || N <= 0) return nullptr;
  auto h = new SpecrtWeight{type, N, K, w, {}};
  if (is_kquant(type) && detect_isa() != SCALAR && h->packed.allocate((size_t)kq_packed_bytes(type, N, K)))
    kq_pack(type, w, N, K, h->packed.data());
  return h;
}

void specrt_weight_free(void* h) { delete (SpecrtWeight*)h; }

// bytes of the packed copy a weight holds (0: products read the file's blocks in place)
int64_t specrt_weight_packed_bytes(const void* h) { return (int64_t)((const SpecrtWeight*)h)->packed.n; }

// y [M, N] = x [M, K] W^T; threads split the columns (0: one per core)
void specrt_weight_matmul(const void* h, const float* x, int64_t M, float* y, int threads) {
  if (M > 0) product(*(const SpecrtWeight*)h, x, M, y, threads);
}

// y [M, N] = x [M, K] W^T, W [N, row_bytes] as stored (packed for this call where a weight would
// be). Returns 0, or -1 for a type or K it does not take.
int specrt_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
                  int threads) {
  if (specrt_row_bytes(type, K) == 0) return -1;
  if (N <= 0 || M <= 0) return 0;
  SpecrtWeight* h = (SpecrtWeight*)specrt_weight(type, w, N, K);
  product(*h, x, M, y, threads);
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
