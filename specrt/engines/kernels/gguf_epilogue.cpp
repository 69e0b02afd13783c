// What a product's output goes through before it leaves the kernel (gguf_matmul.cpp's epilogue):
// a bias (Qwen's q, k and v) and SwiGLU (the MLP's silu(gate) * up, its gate and up one product).
//
//   y [M, N] = x W^T + bias            bias [N] (optional)
//   out [M, N/2] = silu(y[:, :N/2]) * y[:, N/2:]      silu(g) = g / (1 + e^-g)
//
// Why here and not ONNX Runtime's Split, QuickGelu and Mul after the product: those three nodes
// and the bias's Add cost ~1.3 ms of a 1.5B one-position step (28 layers; ORT's profile), and
// every row a step adds writes and reads the 2 x 8960 floats again. e^t is computed by one fixed
// sequence of float operations (Cephes' expf: t = n ln2 + r, a degree-7 polynomial in r, times
// 2^n; ~2 ulp; t clamped to [-87, 88], so a gate below -88 gives g u / (1 + e^88), within
// 1e-36 |g u| of 0) written once per path: the AVX-512 and AVX2 bodies are the scalar reference's
// operations, lane by lane (std::fma where they fuse, -ffp-contract=off), so every path gives
// the reference's bits and an element's value never depends on the rows or lanes beside it.

#include "gguf_blocks.h"

namespace specrt_kernels {
namespace {

constexpr float LO = -87.0f, HI = 88.0f;  // e^t normal and finite on [LO, HI]
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = -0.693359375f, LN2_LO = 2.12194440e-4f;
constexpr float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// -- the scalar reference -----------------------------------------------------------------------

inline float exp_ref(float t) {
  t = std::min(HI, std::max(LO, t));
  const float n = std::nearbyint(t * LOG2E);
  float r = std::fma(n, LN2_HI, t);
  r = std::fma(n, LN2_LO, r);
  float p = P[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, P[i]);
  const float e = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return e * two_n;
}

inline float silu_mul_ref(float g, float u) { return g / (1.0f + exp_ref(0.0f - g)) * u; }  // 0 - g: as the lanes

void silu_mul_scalar(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = silu_mul_ref(g[j], u[j]);
}

#if defined(__x86_64__)
// -- AVX-512: 16 lanes of the reference ---------------------------------------------------------

SPECRT_AVX512 void silu_mul_avx512(const float* g, const float* u, float* out, int64_t n) {
  const __m512 lo = _mm512_set1_ps(LO), hi = _mm512_set1_ps(HI), one = _mm512_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 gv = _mm512_loadu_ps(g + j);
    const __m512 t = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_sub_ps(_mm512_setzero_ps(), gv)));
    const __m512 nn = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(LOG2E)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(nn, _mm512_set1_ps(LN2_HI), t);
    r = _mm512_fmadd_ps(nn, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(P[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P[i]));
    const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), one);
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nn), _mm512_set1_epi32(127)), 23);
    const __m512 ex = _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, ex));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
  }
  silu_mul_scalar(g + j, u + j, out + j, n - j);
}

// -- AVX2: 8 lanes of the reference -------------------------------------------------------------

SPECRT_AVX2 void silu_mul_avx2(const float* g, const float* u, float* out, int64_t n) {
  const __m256 lo = _mm256_set1_ps(LO), hi = _mm256_set1_ps(HI), one = _mm256_set1_ps(1.0f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 gv = _mm256_loadu_ps(g + j);
    const __m256 t = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_sub_ps(_mm256_setzero_ps(), gv)));
    const __m256 nn = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(LOG2E)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(nn, _mm256_set1_ps(LN2_HI), t);
    r = _mm256_fmadd_ps(nn, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(P[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P[i]));
    const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), one);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nn), _mm256_set1_epi32(127)), 23);
    const __m256 ex = _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, ex));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
  }
  silu_mul_scalar(g + j, u + j, out + j, n - j);
}
#endif

}  // namespace

// out [n] = silu(g) * u on the path in use (every path the reference's bits)
void silu_mul(const float* g, const float* u, float* out, int64_t n) {
#if defined(__x86_64__)
  if (isa() == AVX512VNNI) return silu_mul_avx512(g, u, out, n);
  if (isa() == AVX2) return silu_mul_avx2(g, u, out, n);
#endif
  silu_mul_scalar(g, u, out, n);
}

}  // namespace specrt_kernels
