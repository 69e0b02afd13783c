// Every block type packed 16 columns at a time, y = x W^T: each int8 dot product instruction then
// multiplies 4 weights of each of 16 columns by one broadcast group of 4 x values (VNNI's dpbusd),
// so a row costs one instruction per 64 multiply-adds and the scales apply once per block (or
// sub-block) and column, not per weight.
//
//   packed  [ceil(N / 16), K / block values] groups of blocks, each the 16 columns' bytes of one
//           block side by side (each 4-weight quad's bytes as the file stores them), at the file's
//           size: Q4_0 288 bytes (18 a column-block), Q4_1 320 (20), Q5_0 352 (22), Q8_0 544 (34),
//           Q6_K 3360 (210), Q4_K 2368 (148 against the file's 144: +2.8 %)
//   y       [M, N] float32, rows in passes of up to 8 over a group's blocks (held in L1/L2)
//
// Numbers (one definition: `reference`, on the file's own layout; every SIMD path gives its bits):
// the k-quants take x with a scale per 32 values (QXK's d32). Per row, column and block: for each
// 32 values j in order, the exact int32 S_j (Q4_K: sc_j * sum_k code_k x_k; Q6_K: the two 16-value
// sub-blocks' sc_s * sum_k (code_k - 32) x_k) goes into tf = fma(d32_j, S_j, tf), and (Q4_K) mf =
// fma(min_j, fsum32_j, mf); then y = fma(d, tf, y) and y = fma(-dmin, mf, y), blocks in order.
// The 32-weight types take x per 32 (QX32: d, codes, their sum): per block in order, the exact
// S = sum_k (code_k - bias) x_k, y = fma(d_w * d_x, S, y), and (Q4_1) y = fma(m, d_x * sum_x, y).
// Nothing depends on the rows or threads beside.

#include "gguf_blocks.h"

#include <vector>

namespace specrt_kernels {
namespace {

constexpr int G = 16, PASS = 8;  // columns interleaved; rows a pass over a group's blocks

struct PQ4K {                // 16 columns of one 256-weight block
  uint8_t qs[4][8][64];      // [pair p][quad i][4 c + t]: the block's qs[32 p + 4 i + t] of column c
                             // (low nibble: k = 64 p + 4 i + t, sub-block 2p; high: + 32, 2p + 1)
  uint8_t sc[8][G];          // sub-block j's 6-bit scale
  uint8_t mn[8][G];          // sub-block j's 6-bit min
  uint16_t d[G], dmin[G];    // halves
};
struct PQ4_0 {              // 16 columns of one 32-weight block
  uint8_t qs[4][64];         // [quad i][4 c + t]: the block's qs[4 i + t] of column c (low nibble:
                             // k = 4 i + t; high: 16 + 4 i + t)
  uint16_t d[G];
};
struct PQ4_1 {
  uint8_t qs[4][64];
  uint16_t d[G], m[G];
};
struct PQ5_0 {
  uint8_t qs[4][64];
  uint32_t qh[G];            // the fifth bit of code k = 4 i + t at bit 8 t + i (a quad's 4 bits, one
                             // a byte, at bit i of each: two shifts and a mask make them 0x10s)
  uint16_t d[G];
};
struct PQ8_0 {
  int8_t qs[8][64];          // [quad i][4 c + t]: code 4 i + t of column c
  uint16_t d[G];
};
struct PQ6K {
  uint8_t q[2][8][3][64];    // [h][v]: ql[64 h + 4 v + t], ql[64 h + 32 + 4 v + t], qh[32 h + 4 v + t] of
                             // column c at 4 c + t, side by side (the kernel reads them in this order):
                             // codes of k = 128 h + 4 v + t + 0 / 32 / 64 / 96
  int8_t sc[16][G];          // sub-block s (16 weights) scale
  uint16_t d[G];
};
static_assert(sizeof(PQ4K) == 2368 && sizeof(PQ6K) == 3360, "packed block sizes");
static_assert(sizeof(PQ4_0) == 288 && sizeof(PQ4_1) == 320 && sizeof(PQ5_0) == 352 && sizeof(PQ8_0) == 544,
              "packed block sizes");

size_t packed_block(int type) {
  switch (type) {
    case Q4_0: return sizeof(PQ4_0);
    case Q4_1: return sizeof(PQ4_1);
    case Q5_0: return sizeof(PQ5_0);
    case Q8_0: return sizeof(PQ8_0);
    case Q4_K: return sizeof(PQ4K);
  }
  return sizeof(PQ6K);
}

inline int32_t load32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

// -- the SIMD paths: one body (packed_simd.inc), compiled for AVX-512 VNNI and for AVX2 ---------

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")
namespace avx512 {
struct V {  // 16 int32 / float lanes: the group's columns at once
  static constexpr int W = 16;
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I bytes(char v) { return _mm512_set1_epi8(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  template <int N> static I shl16(I a) { return _mm512_slli_epi16(a, N); }
  template <int N> static I shr16(I a) { return _mm512_srli_epi16(a, N); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I dot4(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }  // u8 . s8 in 4s, exact
  // s8 . s8 (Q8_0): the codes + 128 as u8; the caller takes 128 * sum x off (S8_BIAS)
  static constexpr int S8_BIAS = 128;
  static I dot4s(I acc, I c, I x) { return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(c, bytes(char(0x80))), x); }
  static I u8_i32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I s8_i32(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static F half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c, one rounding
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#include "packed_simd.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct V {  // 8 lanes: the group in two halves of 8 columns
  static constexpr int W = 8;
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I bytes(char v) { return _mm256_set1_epi8(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  template <int N> static I shl16(I a) { return _mm256_slli_epi16(a, N); }
  template <int N> static I shr16(I a) { return _mm256_srli_epi16(a, N); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I dot4(I acc, I u, I x) {  // maddubs: <= 2 * 63 * 127, no saturation; then pairs summed
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
  }
  // s8 . s8 (Q8_0): |c| . x with c's signs (<= 2 * 128 * 127, no saturation), exact
  static constexpr int S8_BIAS = 0;
  static I dot4s(I acc, I c, I x) { return dot4(acc, _mm256_abs_epi8(c), _mm256_sign_epi8(x, c)); }
  static I u8_i32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I s8_i32(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static F half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
};
#include "packed_simd.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

// -- the C++ entry points gguf_matmul.cpp calls ------------------------------------------------

// bytes of W packed (N rows of K weights; the last group padded with zero columns)
int64_t packed_bytes(int type, int64_t N, int64_t K) {
  return (N + G - 1) / G * (K / block_values(type)) * (int64_t)packed_block(type);
}

namespace {

// column c's 32-weight block src into the group's packed block dst
void pack32(int type, const uint8_t* src, int c, uint8_t* dst) {
  if (type == Q8_0) {
    auto s = (const BQ8_0*)src;
    auto p = (PQ8_0*)dst;
    for (int i = 0; i < 8; ++i) std::memcpy(&p->qs[i][4 * c], s->qs + 4 * i, 4);
    p->d[c] = s->d;
    return;
  }
  // Q4_0, Q4_1, Q5_0: d, [m | qh], 16 bytes of nibbles; the packed blocks share qs's place
  const uint8_t* qs = type == Q4_1 ? ((const BQ4_1*)src)->qs : type == Q5_0 ? ((const BQ5_0*)src)->qs
                                                                             : ((const BQ4_0*)src)->qs;
  auto p = (PQ4_0*)dst;
  for (int i = 0; i < 4; ++i) std::memcpy(&p->qs[i][4 * c], qs + 4 * i, 4);
  if (type == Q4_0) p->d[c] = ((const BQ4_0*)src)->d;
  if (type == Q4_1) {
    ((PQ4_1*)dst)->d[c] = ((const BQ4_1*)src)->d;
    ((PQ4_1*)dst)->m[c] = ((const BQ4_1*)src)->m;
  }
  if (type == Q5_0) {
    uint32_t qh, out = 0;
    std::memcpy(&qh, ((const BQ5_0*)src)->qh, 4);
    for (int k = 0; k < QK; ++k) out |= ((qh >> k) & 1u) << (8 * (k & 3) + (k >> 2));
    ((PQ5_0*)dst)->qh[c] = out;
    ((PQ5_0*)dst)->d[c] = ((const BQ5_0*)src)->d;
  }
}

}  // namespace

// W's N rows as stored (rows[n]: row n's blocks) -> packed [ceil(N / 16), K / block values]
// (out: packed_bytes, any alignment)
void pack(int type, const uint8_t* const* rows, int64_t N, int64_t K, uint8_t* out) {
  const int64_t nb = K / block_values(type), bb = (int64_t)block_bytes(type);
  const int64_t pb = (int64_t)packed_block(type);
  std::memset(out, 0, (size_t)packed_bytes(type, N, K));
  for (int64_t n = 0; n < N; ++n) {
    const int c = (int)(n % G);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = rows[n] + b * bb;
      uint8_t* dst = out + ((n / G) * nb + b) * pb;
      if (block_values(type) == QK) {
        pack32(type, src, c, dst);
      } else if (type == Q4_K) {
        auto s = (const BQ4_K*)src;
        auto p = (PQ4K*)dst;
        for (int q = 0; q < 32; ++q) std::memcpy(&p->qs[q / 8][q % 8][4 * c], s->qs + 4 * q, 4);
        uint8_t sc[8], mn[8];
        q4k_scales(s->scales, sc, mn);
        for (int j = 0; j < 8; ++j) {
          p->sc[j][c] = sc[j];
          p->mn[j][c] = mn[j];
        }
        p->d[c] = s->d;
        p->dmin[c] = s->dmin;
      } else {
        auto s = (const BQ6_K*)src;
        auto p = (PQ6K*)dst;
        for (int h = 0; h < 2; ++h)
          for (int v = 0; v < 8; ++v) {
            std::memcpy(&p->q[h][v][0][4 * c], s->ql + 64 * h + 4 * v, 4);
            std::memcpy(&p->q[h][v][1][4 * c], s->ql + 64 * h + 32 + 4 * v, 4);
            std::memcpy(&p->q[h][v][2][4 * c], s->qh + 32 * h + 4 * v, 4);
          }
        for (int j = 0; j < 16; ++j) p->sc[j][c] = s->scales[j];
        p->d[c] = s->d;
      }
    }
  }
}

namespace {

void reference32(int type, const uint8_t* const* rows, int64_t N, int64_t K, const char* xq, int64_t xstride, int64_t M,
                 int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK, bb = (int64_t)block_bytes(type);
  std::vector<float> acc((size_t)M);
  Unpacked32 u;
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {  // each block unpacked once for every row
      unpack32(type, rows[n] + b * bb, &u);
      for (int64_t r = 0; r < M; ++r) {
        const QX32& x = ((const QX32*)(xq + r * xstride))[b];
        int32_t S = -u.bias * x.sum;
        for (int k = 0; k < QK; ++k) S += (int32_t)u.u[k] * x.q[k];
        acc[r] = std::fma(u.d * x.d, (float)S, acc[r]);
        if (type == Q4_1) acc[r] = std::fma(u.m, x.d * (float)x.sum, acc[r]);
      }
    }
    for (int64_t r = 0; r < M; ++r) y[r * N + n] = acc[r];
  }
}

}  // namespace

// The reference: columns n0..n1 of y [M, N], from W's rows as stored (xq: M rows of K / 256 QXK blocks, or
// for the 32-weight types K / 32 QX32 blocks).
void reference(int type, const uint8_t* const* rows, int64_t N, int64_t K, const char* xq, int64_t xstride, int64_t M,
               int64_t n0, int64_t n1, float* y) {
  if (block_values(type) == QK) return reference32(type, rows, N, K, xq, xstride, M, n0, n1, y);
  const int64_t nb = K / QKK, bb = (int64_t)block_bytes(type);
  std::vector<float> acc((size_t)M);
  UnpackedK u;
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      unpack_k(type, rows[n] + b * bb, &u);
      for (int64_t r = 0; r < M; ++r) {
        const QXK& x = ((const QXK*)(xq + r * xstride))[b];
        float tf = 0, mf = 0;
        for (int j = 0; j < 8; ++j) {  // 32 values of x, one scale
          int32_t t = 0;
          for (int s = j * 32 / u.sub; s < (j + 1) * 32 / u.sub; ++s) {  // its sub-blocks (1, or 2 of 16)
            int32_t dot = 0;
            for (int k = s * u.sub; k < (s + 1) * u.sub; ++k) dot += (int32_t)u.u[k] * x.q[k];
            if (type == Q6_K) dot -= 32 * x.bsums[s];
            t += u.sc[s] * dot;
          }
          tf = std::fma(x.d32[j], (float)t, tf);
          if (type == Q4_K) mf = std::fma((float)u.mins[j], x.fsum32[j], mf);
        }
        acc[r] = std::fma(u.d, tf, acc[r]);
        if (type == Q4_K) acc[r] = std::fma(-u.dmin, mf, acc[r]);
      }
    }
    for (int64_t r = 0; r < M; ++r) y[r * N + n] = acc[r];
  }
}

// Groups g0..g1 of y [M, N] from packed W: the SIMD path in use (false: none here; use the reference)
bool packed_groups(int type, const uint8_t* packed, int64_t N, int64_t K, int64_t g0, int64_t g1, const char* xq,
                   int64_t xstride, int64_t M, float* y) {
#if defined(__x86_64__)
  const int64_t nb = K / block_values(type), gb = nb * (int64_t)packed_block(type);
  auto run = [&](auto fn) {
    alignas(64) float out[PASS][G];
    for (int64_t g = g0; g < g1; ++g) {
      const int cols = (int)std::min<int64_t>(G, N - g * G);
      for (int64_t r0 = 0; r0 < M; r0 += PASS) {
        const int R = (int)std::min<int64_t>(PASS, M - r0);
        fn(type, packed + g * gb, nb, xq + r0 * xstride, xstride, R, out);
        for (int r = 0; r < R; ++r) std::memcpy(y + (r0 + r) * N + g * G, out[r], sizeof(float) * cols);
      }
    }
  };
  if (isa() == AVX512VNNI) return run(avx512::group), true;
  if (isa() == AVX2) return run(avx2::group), true;
#endif
  return false;
}

}  // namespace specrt_kernels
