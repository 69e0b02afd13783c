// What the kernel files share: ggml's block formats, x quantized in blocks, a k-quant block
// unpacked (the scalar reference's view), the SIMD target attributes and the path this CPU runs.
// Everything here is inline in an unnamed namespace: each file has its own copy, no symbol leaks.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPECRT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")))
#define SPECRT_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace specrt_kernels {

enum Isa { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2 };
int isa();  // the path in use (gguf_matmul.cpp: detected, or forced by the tests)

namespace {

// -- block formats (ggml's; shapes per block) ---------------------------------------------------

enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int QK = 32, QKK = 256;

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
// QXK: 256 values (a k-quant block's span), each 32 with its own scale d32 (one scale per 256, as
// llama.cpp's Q8_K, cost the 1.5B +4.2 % perplexity against +0.35 % for MatMulNBits' per 32: the
// activations' outlier channels crush a whole block's resolution); code sums per 16 and per 32,
// and per 32 the sum in x's units (d32 * its code sum: Q4_K's mins)
struct QXK { float d32[8]; float fsum32[8]; int16_t bsums[16]; int16_t bsums32[8]; int8_t q[QKK]; };

inline int block_values(int type) { return type == Q4_K || type == Q6_K ? QKK : QK; }

inline size_t block_bytes(int type) {
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

inline float fp16(uint16_t h) {  // exact half -> float, no F16C needed
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
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// the same 8 scales and 8 mins with 32-bit operations (what the SIMD paths use; tests: equal)
inline void q4k_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
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

inline int8_t code(float v, float id) {
  float r = std::nearbyint(v * id);
  return (int8_t)std::max(-127.0f, std::min(127.0f, r));
}

inline void quantize_x32(const float* x, int64_t K, QX32* out) {  // x [K] -> K/32 blocks
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

// the 32 values j of a QXK once their codes and their two sums per 16 are in: the rest of its fields
inline void close32(QXK& o, int j, float d) {
  o.bsums32[j] = (int16_t)(o.bsums[2 * j] + o.bsums[2 * j + 1]);
  o.d32[j] = d;
  o.fsum32[j] = d * (float)o.bsums32[j];
}

inline void quantize_xk(const float* x, int64_t K, QXK* out) {  // x [K] -> K/256 blocks, scales per 32
  for (int64_t b = 0; b < K / QKK; ++b, x += QKK) {
    for (int j = 0; j < 8; ++j) {
      const float* v = x + 32 * j;
      float amax = 0;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
      for (int h = 0; h < 2; ++h) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += out[b].q[32 * j + 16 * h + i] = code(v[16 * h + i], id);
        out[b].bsums[2 * j + h] = (int16_t)s;
      }
      close32(out[b], j, d);
    }
  }
}

// A 32-weight block (legacy types): codes c[32] (unsigned but Q8_0's, which are its signed
// values), float scale d, integer bias, float offset m.
struct Unpacked32 { int16_t u[QK]; float d, m; int bias; };

inline void unpack32(int type, const uint8_t* p, Unpacked32* o) {
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

inline void unpack_k(int type, const uint8_t* p, UnpackedK* o) {
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

}  // namespace
}  // namespace specrt_kernels
