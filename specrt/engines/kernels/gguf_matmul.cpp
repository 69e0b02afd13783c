// y = x W^T with W a GGUF tensor's bytes as stored (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), x float32
// quantized to int8 in blocks: the layer products of a GGUF model, computed in place.
//
//   x  [M, K] float32 (row-major)       W  [N, row_bytes(type, K)] uint8: the file's rows, as stored
//   y  [M, N] float32                    M: any (a step's rows: 1..17 verify, hundreds prefill)
//
// Why written here: ONNX Runtime's MatMulNBits rewrites these blocks (1.39 GB read a token where the
// file holds 1.0) and unpacks each weight again for every pair of rows; ggml's kernels are not
// batch-invariant (gemm for groups of rows, gemv for the rest). This one reads each weight block
// once per group of rows (up to ROWS) and computes every output row in one fixed order, whatever the
// number of rows and threads: threads split the output columns, rows never share arithmetic.
//
// Numbers (one definition, the scalar reference below; every SIMD path gives the same bits):
//   x is quantized per block: 32 values for Q4_0/Q4_1/Q5_0/Q8_0 (QX32: d = max|x|/127, codes
//   nearbyint(x/d), their sum), 256 for the k-quants (QXK: one d, sums per 16), as llama.cpp does.
//   Weight codes are unsigned (a type's bias subtracted through the x sums), so one u8 x s8 dot
//   serves every type. Integer dots are exact; a block's integer lanes (lane i: the products at
//   k with (k >> 2) & 7 == i) are converted and accumulated into 8 float lanes with one fma each,
//   offsets (Q4_1's m, Q4_K's mins) into one float, and the lanes are summed in one tree order.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

// -- block formats (ggml's; shapes per block) ---------------------------------------------------

enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int QK = 32, QKK = 256, ROWS = 16;

struct BQ4_0 { uint16_t d; uint8_t qs[16]; };                    // 32 weights: d (q - 8)
struct BQ4_1 { uint16_t d, m; uint8_t qs[16]; };                 // 32: d q + m
struct BQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };     // 32: d (q - 16), q 5 bits
struct BQ8_0 { uint16_t d; int8_t qs[32]; };                     // 32: d q
struct BQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };  // 256: d sc q - dmin m
struct BQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };  // 256: d sc (q - 32)
static_assert(sizeof(BQ4_0) == 18 && sizeof(BQ4_1) == 20 && sizeof(BQ5_0) == 22, "block sizes");
static_assert(sizeof(BQ8_0) == 34 && sizeof(BQ4_K) == 144 && sizeof(BQ6_K) == 210, "block sizes");

// x quantized: QX32 per 32 values (legacy types), QXK per 256 (k-quants)
struct QX32 { float d; int32_t sum; int8_t q[QK]; };
struct QXK { float d; int16_t bsums[16]; int16_t bsums32[8]; int8_t q[QKK]; };  // sums per 16 and per 32

int block_values(int type) { return type == Q4_K || type == Q6_K ? QKK : QK; }

size_t block_bytes(int type) {
  switch (type) {
    case Q4_0: return sizeof(BQ4_0);
    case Q4_1: return sizeof(BQ4_1);
    case Q5_0: return sizeof(BQ5_0);
    case Q8_0: return sizeof(BQ8_0);
    case Q4_K: return sizeof(BQ4_K);
    case Q6_K: return sizeof(BQ6_K);
  }
  return 0;
}

float fp16(uint16_t h) {  // exact half -> float, no F16C needed
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4)
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// the same 8 scales and 8 mins with 32-bit operations (what the SIMD paths use; tests: equal)
void q4k_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  uint32_t s0 = u[0] & 0x3f3f3f3f, m0 = u[1] & 0x3f3f3f3f;
  uint32_t s1 = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
  uint32_t m1 = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
  std::memcpy(sc, &s0, 4);
  std::memcpy(sc + 4, &s1, 4);
  std::memcpy(mn, &m0, 4);
  std::memcpy(mn + 4, &m1, 4);
}

// -- activations ---------------------------------------------------------------------------------

int8_t code(float v, float id) {
  float r = std::nearbyint(v * id);
  return (int8_t)std::max(-127.0f, std::min(127.0f, r));
}

void quantize_x32(const float* x, int64_t K, QX32* out) {  // x [K] -> K/32 blocks
  for (int64_t b = 0; b < K / QK; ++b, x += QK) {
    float amax = 0;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i]));
    float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) sum += out[b].q[i] = code(x[i], id);
    out[b].d = d;
    out[b].sum = sum;
  }
}

void quantize_xk(const float* x, int64_t K, QXK* out) {  // x [K] -> K/256 blocks
  for (int64_t b = 0; b < K / QKK; ++b, x += QKK) {
    float amax = 0;
    for (int i = 0; i < QKK; ++i) amax = std::max(amax, std::fabs(x[i]));
    float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += out[b].q[16 * j + i] = code(x[16 * j + i], id);
      out[b].bsums[j] = (int16_t)s;
    }
    for (int j = 0; j < 8; ++j) out[b].bsums32[j] = (int16_t)(out[b].bsums[2 * j] + out[b].bsums[2 * j + 1]);
    out[b].d = d;
  }
}

// -- the float part, shared by every path --------------------------------------------------------

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

// A 256-weight block (k-quants): codes u[256], the integer scale of each k's sub-block, the bias
// per code, d, and (Q4_K) dmin with the 8 mins.
struct UnpackedK { uint8_t u[QKK]; int32_t sc[16]; int32_t mins[8]; float d, dmin; int bias, sub; };

void unpack_k(int type, const uint8_t* p, UnpackedK* o) {
  if (type == Q4_K) {
    auto b = (const BQ4_K*)p;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        o->u[64 * c + l] = b->qs[32 * c + l] & 0xF;
        o->u[64 * c + 32 + l] = b->qs[32 * c + l] >> 4;
      }
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      scale_min_k4(j, b->scales, &sc, &m);
      o->sc[j] = sc;
      o->mins[j] = m;
    }
    o->d = fp16(b->d); o->dmin = fp16(b->dmin); o->bias = 0; o->sub = 32;
  } else {  // Q6_K
    auto b = (const BQ6_K*)p;
    for (int h = 0; h < 2; ++h) {
      const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
      uint8_t* u = o->u + 128 * h;
      for (int l = 0; l < 32; ++l) {
        u[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
        u[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        u[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        u[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
    for (int j = 0; j < 16; ++j) o->sc[j] = b->scales[j];
    o->d = fp16(b->d); o->dmin = 0; o->bias = 32; o->sub = 16;
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

void lanes_k(const UnpackedK& w, const QXK& x, int32_t* il) {
  for (int i = 0; i < 16; ++i) il[i] = 0;
  for (int k = 0; k < QKK; ++k) il[(k >> 2) & 15] += w.sc[k / w.sub] * ((int32_t)w.u[k] * x.q[k]);
  if (w.bias) {
    int32_t b = 0;
    for (int j = 0; j < 16; ++j) b += w.sc[j] * x.bsums[j];
    il[0] -= w.bias * b;
  }
}

void mins_k(const UnpackedK& w, const QXK& x, int32_t* m) {  // Q4_K: min * x sum, sub-blocks in pairs
  for (int i = 0; i < 4; ++i)
    m[i] = w.mins[2 * i] * (x.bsums[4 * i] + x.bsums[4 * i + 1]) +
           w.mins[2 * i + 1] * (x.bsums[4 * i + 2] + x.bsums[4 * i + 3]);
}

// y[r] (r < R) of one column over all K: the reference every path must equal.
void column_ref(int type, const uint8_t* wrow, int64_t nb, const void* xq, int64_t xstride, int R, Acc* acc) {
  int32_t il[16];
  if (block_values(type) == QK) {
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
  } else {
    UnpackedK w;
    for (int64_t b = 0; b < nb; ++b) {
      unpack_k(type, wrow + b * block_bytes(type), &w);
      for (int r = 0; r < R; ++r) {
        const QXK& x = ((const QXK*)((const char*)xq + r * xstride))[b];
        lanes_k(w, x, il);
        acc[r].add(w.d * x.d, il, 0, 16);
        if (type == Q4_K) {
          int32_t m[4];
          mins_k(w, x, m);
          for (int i = 0; i < 4; ++i) acc[r].off[i] = std::fma(-(w.dmin * x.d), (float)m[i], acc[r].off[i]);
        }
      }
    }
  }
}

// -- AVX-512 VNNI: a column's block unpacked once into registers, a dot per row -----------------

#if defined(__x86_64__)
#define SPECRT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")))

SPECRT_AVX512 inline float half_avx(uint16_t h) { return _cvtsh_ss(h); }  // = fp16(h), in one instruction

SPECRT_AVX512 inline float fma1(float a, float b, float c) {  // std::fma, as the instruction
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

SPECRT_AVX512 inline int32_t sum4(__m128i p) {  // the 4 int32 lanes' sum (exact: integers)
  p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(p, _mm_shuffle_epi32(p, 0xB1)));
}

// the int16 scale of each 16-bit lane of codes z (k = 64 z + 2 j, + 1): sub-block 2z + j / 16 of
// 32 weights (Q4_K, halves) or 4z + j / 8 of 16 (Q6_K); `scales` holds the int16 scales in order
struct LaneScales {  // vpermw indices of codes z's 16-bit lanes into a block's int16 scales
  __m512i idx[4];
  SPECRT_AVX512 explicit LaneScales(bool halves) {
    alignas(64) int16_t v[32];
    #pragma GCC unroll 16
    for (int z = 0; z < 4; ++z) {
      for (int j = 0; j < 32; ++j) v[j] = (int16_t)(halves ? 2 * z + j / 16 : 4 * z + j / 8);
      idx[z] = _mm512_load_si512(v);
    }
  }
  SPECRT_AVX512 __m512i operator()(__m512i scales, int z) const { return _mm512_permutexvar_epi16(idx[z], scales); }
};

// Q4_K, R rows (R <= 8: the accumulators stay in registers). Per row and block: the codes' pairs
// times x (maddubs: <= 2 * 15 * 127, no saturation), times the sub-block's scale and summed in
// 4s (dpwssd): the reference's integer lanes, exactly; then y lanes += d dx * lanes.
template <int R>
SPECRT_AVX512 void q4k_rows(const uint8_t* wrow, int64_t nb, const char* xq, int64_t xstride, Acc* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const LaneScales lane_scales16(true);
  __m512 a[R];
  __m128 off[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { a[r] = _mm512_setzero_ps(); off[r] = _mm_setzero_ps(); }
  for (int64_t b = 0; b < nb; ++b) {
    auto blk = (const BQ4_K*)(wrow + b * sizeof(BQ4_K));
    __m512i c0 = _mm512_loadu_si512(blk->qs), c1 = _mm512_loadu_si512(blk->qs + 64);
    __m512i lo0 = _mm512_and_si512(c0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(c0, 4), low);
    __m512i lo1 = _mm512_and_si512(c1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(c1, 4), low);
    __m512i w[4] = {  // codes of k 0..63, 64..127, 128..191, 192..255 (natural order)
        _mm512_shuffle_i64x2(lo0, hi0, 0x44), _mm512_shuffle_i64x2(lo0, hi0, 0xEE),
        _mm512_shuffle_i64x2(lo1, hi1, 0x44), _mm512_shuffle_i64x2(lo1, hi1, 0xEE)};
    uint32_t u[3];  // q4k_scales in registers
    std::memcpy(u, blk->scales, 12);
    uint32_t s0 = u[0] & 0x3f3f3f3f, m0 = u[1] & 0x3f3f3f3f;
    uint32_t s1 = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    uint32_t m1 = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)s1, (int)s0)));
    __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)m1, (int)m0));
    __m512i s[4];
    #pragma GCC unroll 16
    for (int z = 0; z < 4; ++z) s[z] = lane_scales16(scales, z);
    float d = half_avx(blk->d), dmin = half_avx(blk->dmin);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const QXK& x = *(const QXK*)(xq + r * xstride + b * (int64_t)sizeof(QXK));
      __m512i t = _mm512_setzero_si512();
      #pragma GCC unroll 16
      for (int z = 0; z < 4; ++z)
        t = _mm512_dpwssd_epi32(t, _mm512_maddubs_epi16(w[z], _mm512_loadu_si512(x.q + 64 * z)), s[z]);
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * x.d), _mm512_cvtepi32_ps(t), a[r]);
      __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)x.bsums32));
      off[r] = _mm_fmadd_ps(_mm_set1_ps(-(dmin * x.d)), _mm_cvtepi32_ps(m), off[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) { _mm512_storeu_ps(acc[r].lane, a[r]); _mm_storeu_ps(acc[r].off, off[r]); }
}

template <int S>
SPECRT_AVX512 inline __m256i q6_high(__m256i qh, __m256i three) {  // Q6_K's 2 high bits at S, moved to bits 4-5
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, S), three), 4);
}

// Q6_K, R rows: y lanes += d dx * (sum_z sc * (codes . x) - 32 sum_j sc_j xsum_j)
template <int R>
SPECRT_AVX512 void q6k_rows(const uint8_t* wrow, int64_t nb, const char* xq, int64_t xstride, Acc* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const LaneScales lane_scales16(false);
  __m512 a[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    auto blk = (const BQ6_K*)(wrow + b * sizeof(BQ6_K));
    __m512i w[4];  // codes of k 0..63, ..., 192..255
    for (int h = 0; h < 2; ++h) {
      __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk->ql + 64 * h));
      __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk->ql + 64 * h + 32));
      __m256i qh = _mm256_loadu_si256((const __m256i*)(blk->qh + 32 * h));
      __m256i q1 = _mm256_or_si256(_mm256_and_si256(l0, low), q6_high<0>(qh, three));
      __m256i q2 = _mm256_or_si256(_mm256_and_si256(l1, low), q6_high<2>(qh, three));
      __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), q6_high<4>(qh, three));
      __m256i q4 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), q6_high<6>(qh, three));
      w[2 * h] = _mm512_inserti64x4(_mm512_castsi256_si512(q1), q2, 1);
      w[2 * h + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(q3), q4, 1);
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)blk->scales));
    __m512i s[4];
    #pragma GCC unroll 16
    for (int z = 0; z < 4; ++z) s[z] = lane_scales16(_mm512_castsi256_si512(sc16), z);
    float d = half_avx(blk->d);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const QXK& x = *(const QXK*)(xq + r * xstride + b * (int64_t)sizeof(QXK));
      __m512i t = _mm512_setzero_si512();
      #pragma GCC unroll 16
      for (int z = 0; z < 4; ++z)  // maddubs: <= 2 * 63 * 127, no saturation
        t = _mm512_dpwssd_epi32(t, _mm512_maddubs_epi16(w[z], _mm512_loadu_si512(x.q + 64 * z)), s[z]);
      __m256i bs = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)x.bsums));
      int32_t bias = 32 * sum4(_mm_add_epi32(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
      t = _mm512_sub_epi32(t, _mm512_maskz_set1_epi32(1, bias));
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * x.d), _mm512_cvtepi32_ps(t), a[r]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc[r].lane, a[r]);
}

#define SPECRT_BY_ROWS(fn)                                                                                    \
  SPECRT_AVX512 void fn##_any(const uint8_t* wrow, int64_t nb, const char* xq, int64_t xs, int R, Acc* acc) { \
    for (int r0 = 0; r0 < R; r0 += 8) {                                                                       \
      const char* x = xq + r0 * xs;                                                                           \
      switch (std::min(8, R - r0)) {                                                                          \
        case 1: fn<1>(wrow, nb, x, xs, acc + r0); break;                                                       \
        case 2: fn<2>(wrow, nb, x, xs, acc + r0); break;                                                       \
        case 3: fn<3>(wrow, nb, x, xs, acc + r0); break;                                                       \
        case 4: fn<4>(wrow, nb, x, xs, acc + r0); break;                                                       \
        case 5: fn<5>(wrow, nb, x, xs, acc + r0); break;                                                       \
        case 6: fn<6>(wrow, nb, x, xs, acc + r0); break;                                                       \
        case 7: fn<7>(wrow, nb, x, xs, acc + r0); break;                                                       \
        default: fn<8>(wrow, nb, x, xs, acc + r0); break;                                                      \
      }                                                                                                       \
    }                                                                                                         \
  }
SPECRT_BY_ROWS(q4k_rows)
SPECRT_BY_ROWS(q6k_rows)

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
#define SPECRT_AVX2 __attribute__((target("avx2,fma,f16c")))

// one chunk's integer lanes: codes (u8) . x (s8) in pairs (maddubs: <= 2 * 63 * 127 or, for
// Q8_0's magnitudes, 2 * 128 * 127: no saturation), times the 16-bit lanes' scales, summed in 4s
SPECRT_AVX2 inline __m256i dot32(__m256i u, __m256i x, __m256i scale16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale16);
}

// k-quant codes as 8 chunks of 32 (natural order) and each chunk's int16 lane scales
SPECRT_AVX2 inline void unpack_k_avx2(int type, const uint8_t* p, __m256i* w, __m256i* s, float* d, float* dmin,
                                       __m128i* mins) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if (type == Q4_K) {
    auto blk = (const BQ4_K*)p;
    for (int c = 0; c < 4; ++c) {
      __m256i q = _mm256_loadu_si256((const __m256i*)(blk->qs + 32 * c));
      w[2 * c] = _mm256_and_si256(q, low);
      w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    }
    uint8_t sc[8], mn[8];
    q4k_scales(blk->scales, sc, mn);
    for (int j = 0; j < 8; ++j) s[j] = _mm256_set1_epi16(sc[j]);
    *mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)mn));
    *d = _cvtsh_ss(blk->d);
    *dmin = _cvtsh_ss(blk->dmin);
  } else {  // Q6_K
    auto blk = (const BQ6_K*)p;
    const __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk->ql + 64 * h));
      __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk->ql + 64 * h + 32));
      __m256i qh = _mm256_loadu_si256((const __m256i*)(blk->qh + 32 * h));
      auto high = [&](int shift) SPECRT_AVX2 {
        return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), three), 4);
      };
      w[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low), high(0));
      w[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), high(2));
      w[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), high(4));
      w[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), high(6));
    }
    for (int j = 0; j < 8; ++j)
      s[j] = _mm256_set_m128i(_mm_set1_epi16(blk->scales[2 * j + 1]), _mm_set1_epi16(blk->scales[2 * j]));
    *d = _cvtsh_ss(blk->d);
    *dmin = 0;
  }
}

template <int R>
SPECRT_AVX2 void rows_k_avx2(int type, const uint8_t* wrow, int64_t nb, const char* xq, int64_t xstride, Acc* acc) {
  __m256 lo[R], hi[R];
  __m128 off[R];
  for (int r = 0; r < R; ++r) { lo[r] = hi[r] = _mm256_setzero_ps(); off[r] = _mm_setzero_ps(); }
  const size_t bb = block_bytes(type);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[8], s[8];
    __m128i mins = _mm_setzero_si128();
    float d, dmin;
    unpack_k_avx2(type, wrow + b * bb, w, s, &d, &dmin, &mins);
    __m256i sc16 = type == Q6_K ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)((const BQ6_K*)(wrow + b * bb))->scales))
                                : _mm256_setzero_si256();
    for (int r = 0; r < R; ++r) {
      const QXK& x = *(const QXK*)(xq + r * xstride + b * (int64_t)sizeof(QXK));
      __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
      for (int j = 0; j < 8; j += 2) {  // chunk j: lanes 0-7 of the 16, chunk j + 1: lanes 8-15
        t0 = _mm256_add_epi32(t0, dot32(w[j], _mm256_loadu_si256((const __m256i*)(x.q + 32 * j)), s[j]));
        t1 = _mm256_add_epi32(t1, dot32(w[j + 1], _mm256_loadu_si256((const __m256i*)(x.q + 32 * j + 32)), s[j + 1]));
      }
      if (type == Q6_K) {
        __m256i bs = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)x.bsums));
        __m128i b4 = _mm_add_epi32(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        b4 = _mm_add_epi32(b4, _mm_shuffle_epi32(b4, 0x4E));
        b4 = _mm_add_epi32(b4, _mm_shuffle_epi32(b4, 0xB1));
        t0 = _mm256_sub_epi32(t0, _mm256_setr_epi32(32 * _mm_cvtsi128_si32(b4), 0, 0, 0, 0, 0, 0, 0));
      }
      __m256 scale = _mm256_set1_ps(d * x.d);
      lo[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(t0), lo[r]);
      hi[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(t1), hi[r]);
      if (type == Q4_K) {
        __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)x.bsums32));
        off[r] = _mm_fmadd_ps(_mm_set1_ps(-(dmin * x.d)), _mm_cvtepi32_ps(m), off[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc[r].lane, lo[r]);
    _mm256_storeu_ps(acc[r].lane + 8, hi[r]);
    _mm_storeu_ps(acc[r].off, off[r]);
  }
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
  bool k = type == Q4_K || type == Q6_K;
  for (int r0 = 0; r0 < R; r0 += 4) {
    const char* x = xq + r0 * xs;
    int n = std::min(4, R - r0);
    if (k) {
      if (n == 1) rows_k_avx2<1>(type, wrow, nb, x, xs, acc + r0);
      else if (n == 2) rows_k_avx2<2>(type, wrow, nb, x, xs, acc + r0);
      else if (n == 3) rows_k_avx2<3>(type, wrow, nb, x, xs, acc + r0);
      else rows_k_avx2<4>(type, wrow, nb, x, xs, acc + r0);
    } else {
      if (n == 1) rows32_avx2<1>(type, wrow, nb, x, xs, acc + r0);
      else if (n == 2) rows32_avx2<2>(type, wrow, nb, x, xs, acc + r0);
      else if (n == 3) rows32_avx2<3>(type, wrow, nb, x, xs, acc + r0);
      else rows32_avx2<4>(type, wrow, nb, x, xs, acc + r0);
    }
  }
}
#endif

// -- dispatch ------------------------------------------------------------------------------------

enum Isa { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2 };

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

int isa() {
  int v = g_isa.load();
  if (v < 0) g_isa.store(v = detect_isa());
  return v;
}

void column(int type, const uint8_t* wrow, int64_t nb, const void* xq, int64_t xstride, int R, Acc* acc) {
#if defined(__x86_64__)
  if (isa() == AVX512VNNI) {
    const char* x = (const char*)xq;
    if (type == Q4_K) return q4k_rows_any(wrow, nb, x, xstride, R, acc);
    if (type == Q6_K) return q6k_rows_any(wrow, nb, x, xstride, R, acc);
    return rows32_any(type, wrow, nb, x, xstride, R, acc);
  }
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

// y [M, N] = x [M, K] W^T, W [N, row_bytes] as stored; threads split the columns (0: one per core).
// Returns 0, or -1 for a type or K it does not take.
int specrt_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y,
                  int threads) {
  int64_t rb = specrt_row_bytes(type, K);
  if (rb == 0 || N <= 0 || M <= 0) return rb == 0 ? -1 : 0;
  int64_t nb = K / block_values(type);
  bool k = block_values(type) == QKK;
  int64_t xstride = k ? nb * (int64_t)sizeof(QXK) : nb * (int64_t)sizeof(QX32);
  std::vector<char> xq((size_t)(xstride * M));
  for (int64_t r = 0; r < M; ++r) {
    if (k) quantize_xk(x + r * K, K, (QXK*)(xq.data() + r * xstride));
    else quantize_x32(x + r * K, K, (QX32*)(xq.data() + r * xstride));
  }
  if (threads <= 0) threads = (int)std::max(1u, std::thread::hardware_concurrency());
  int T = (int)std::min<int64_t>(threads, std::max<int64_t>(1, N / 64));
  pool().run(T, [&](int t) {
    int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
    Acc acc[ROWS];
    for (int64_t r0 = 0; r0 < M; r0 += ROWS) {  // rows in groups: the weights stay in cache between
      int R = (int)std::min<int64_t>(ROWS, M - r0);
      for (int64_t n = n0; n < n1; ++n) {
        for (int r = 0; r < R; ++r) acc[r] = Acc();
        column(type, w + n * rb, nb, xq.data() + r0 * xstride, xstride, R, acc);
        for (int r = 0; r < R; ++r) y[(r0 + r) * N + n] = acc[r].total();
      }
    }
  });
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
