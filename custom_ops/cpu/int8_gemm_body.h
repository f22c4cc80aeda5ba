// The loops of cpu/int8_gemm.h, included there twice: in namespace int8_cpu::portable and,
// on x86-64, in int8_cpu::avx2 under `#pragma GCC target("avx2,fma")` with
// TFMETAL_INT8_BODY_AVX2 defined (the 16-column passes then use intrinsics). No include
// guard on purpose.

// Portable: a kNR-wide float row of the weights per k, used for every row.
template <int MR>
TFMETAL_INT8_INLINE void MicroPortable(const Pass& p) {
  float c[MR][kNR];
  const int64_t nc = p.nc;
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < kNR; ++j) c[r][j] = j < nc ? p.acc[r * p.ldacc + j] : 0.0f;
  for (int64_t k = 0; k < p.kc; ++k) {
    const int8_t* qk = p.q + k * p.ldq;
    float w[kNR];
    if (nc == kNR) {
      for (int64_t j = 0; j < kNR; ++j) w[j] = static_cast<float>(qk[j]);
    } else {
      for (int64_t j = 0; j < kNR; ++j) w[j] = j < nc ? static_cast<float>(qk[j]) : 0.0f;
    }
    for (int r = 0; r < MR; ++r) {
      const float xv = p.x[r * p.ldx + k];
      for (int64_t j = 0; j < kNR; ++j) c[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < nc; ++j) p.acc[r * p.ldacc + j] = c[r][j];
}

#ifdef TFMETAL_INT8_BODY_AVX2
// 8 int8 weights to float, exactly: sign-extended to int32 and added to the bits of
// 1.5 * 2^23 (the sum stays in that float's binade, so its bits are the float
// 1.5 * 2^23 + q), then 1.5 * 2^23 subtracted. Integer adds and a float subtract, not
// vcvtdq2ps: that conversion has one execution port on some x86 cores (Zen 1: half the
// int8 rate of this form), and batch-1 inference converts every weight once.
TFMETAL_INT8_INLINE __m256 Int8x8ToFloat(const int8_t* q) {
  const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i bits = _mm256_add_epi32(wide, _mm256_set1_epi32(0x4B400000));
  return _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(12582912.0f));
}

// MR rows x NV vectors (8 columns each) in registers, k innermost: MR * NV independent
// accumulator chains, each converted weight vector used for MR rows.
template <int MR, int NV>
TFMETAL_INT8_INLINE void MicroVector(const Pass& p) {
  __m256 c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = _mm256_loadu_ps(p.acc + r * p.ldacc + 8 * v);
  const int8_t* qk = p.q;
  const float* xk = p.x;
  for (int64_t k = 0; k < p.kc; ++k, qk += p.ldq, ++xk) {
    __m256 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_broadcast_ss(xk + r * p.ldx);
    for (int v = 0; v < NV; ++v) {
      const __m256 w = Int8x8ToFloat(qk + 8 * v);
      for (int r = 0; r < MR; ++r) c[r][v] = _mm256_fmadd_ps(xv[r], w, c[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(p.acc + r * p.ldacc + 8 * v, c[r][v]);
}

// The widest pass for `mr` rows that keeps its accumulators in the 16 ymm registers:
// 1 row x 64 columns, 2 x 32, 3 or 4 x 16.
TFMETAL_INT8_INLINE int64_t WideColumns(int64_t mr) { return mr == 1 ? 64 : (mr == 2 ? 32 : 16); }

TFMETAL_INT8_INLINE void MicroWide(int64_t mr, const Pass& p) {
  switch (mr) {
    case 4: MicroVector<4, 2>(p); break;
    case 3: MicroVector<3, 2>(p); break;
    case 2: MicroVector<2, 4>(p); break;
    case 1: MicroVector<1, 8>(p); break;
    default: break;
  }
}
#endif

template <int MR>
TFMETAL_INT8_INLINE void Micro(const Pass& p) {
#ifdef TFMETAL_INT8_BODY_AVX2
  if (p.nc == kNR) return MicroVector<MR, 2>(p);
#endif
  MicroPortable<MR>(p);
}

TFMETAL_INT8_INLINE void MicroRows(int64_t mr, const Pass& p) {
  switch (mr) {
    case 4: Micro<4>(p); break;
    case 3: Micro<3>(p); break;
    case 2: Micro<2>(p); break;
    case 1: Micro<1>(p); break;
    default: break;
  }
}

// Copies kernel rows [kb, kb + kc) x columns [n0, n1) into `packed` panel-major (panel
// i: kc rows of 64 bytes at packed + i * kKC * 64), reading each row's columns in one
// sequential run.
TFMETAL_INT8_INLINE void PackBlock(const Problem& p, int64_t kb, int64_t kc, int64_t n0, int64_t n1,
                                   int8_t* packed) {
  const int64_t nu = n1 - n0;
  for (int64_t k = 0; k < kc; ++k) {
    const int8_t* src = p.q + (kb + k) * p.n + n0;
    int8_t* dst = packed + k * kPanel;
    int64_t j = 0;
    for (; j + kPanel <= nu; j += kPanel, dst += kKC * kPanel) std::memcpy(dst, src + j, kPanel);
    if (j < nu) std::memcpy(dst, src + j, nu - j);
  }
}

// Prefetches (into L2) kernel rows [kb, kb + kc) x columns [j0, j1): after each panel is
// computed, the same panel of the next block, so the next block's reads from memory
// overlap this block's arithmetic.
TFMETAL_INT8_INLINE void PrefetchPanel(const Problem& p, int64_t kb, int64_t kc, int64_t j0, int64_t j1) {
  for (int64_t k = 0; k < kc; ++k) {
    const int8_t* row = p.q + (kb + k) * p.n;
    __builtin_prefetch(row + j0, 0, 2);
    __builtin_prefetch(row + j1 - 1, 0, 2);
  }
}

// Batch 1 and 2 (memory-bound: each weight is used once or twice): no packing. k runs
// outer, in steps of 4 kernel rows, and the unit's columns inner, the accumulators in the
// per-thread scratch (L1/L2-resident: at most kMaxUnitCols floats per row). Each kernel row's
// columns [n0, n1) are read in one sequential run, prefetched kStreamAhead rows ahead (a run is
// a few KB, too short for the hardware prefetchers to ramp up on each one), and every weight is
// converted once. Per output, the same chain as the packed path: one accumulator from 0, a
// multiply-add per k in increasing k.
#ifdef TFMETAL_INT8_BODY_AVX2
constexpr int64_t kStreamAhead = 8;

template <int R>
TFMETAL_INT8_INLINE void StreamRows(const Problem& p, const float* x, int64_t n0, int64_t n1, float* acc) {
  const int64_t nu = n1 - n0, ldacc = p.unit_cols, nv = nu / 8 * 8, n = p.n;
  for (int r = 0; r < R; ++r) std::fill(acc + r * ldacc, acc + r * ldacc + nu, 0.0f);
  int64_t k = 0;
  for (; k + 4 <= p.k; k += 4) {
    const int8_t* q0 = p.q + k * n + n0;
    __m256 xv[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) xv[r][t] = _mm256_set1_ps(x[r * p.k + k + t]);
    const bool ahead = k + kStreamAhead + 4 <= p.k;
    for (int64_t j = 0; j < nv; j += 8) {
      if (ahead && (j & 63) == 0) {  // the same lines kStreamAhead kernel rows on
        for (int t = 0; t < 4; ++t) __builtin_prefetch(q0 + (kStreamAhead + t) * n + j, 0, 1);
      }
      const __m256 w0 = Int8x8ToFloat(q0 + j), w1 = Int8x8ToFloat(q0 + n + j);
      const __m256 w2 = Int8x8ToFloat(q0 + 2 * n + j), w3 = Int8x8ToFloat(q0 + 3 * n + j);
      for (int r = 0; r < R; ++r) {
        float* a = acc + r * ldacc + j;
        __m256 c = _mm256_loadu_ps(a);
        c = _mm256_fmadd_ps(xv[r][0], w0, c);
        c = _mm256_fmadd_ps(xv[r][1], w1, c);
        c = _mm256_fmadd_ps(xv[r][2], w2, c);
        c = _mm256_fmadd_ps(xv[r][3], w3, c);
        _mm256_storeu_ps(a, c);
      }
    }
    for (int64_t j = nv; j < nu; ++j)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < 4; ++t)
          acc[r * ldacc + j] = std::fma(x[r * p.k + k + t], static_cast<float>(q0[t * n + j]), acc[r * ldacc + j]);
  }
  for (; k < p.k; ++k) {
    const int8_t* qk = p.q + k * n + n0;
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_set1_ps(x[r * p.k + k]);
      float* a = acc + r * ldacc;
      int64_t j = 0;
      for (; j < nv; j += 8) _mm256_storeu_ps(a + j, _mm256_fmadd_ps(xk, Int8x8ToFloat(qk + j), _mm256_loadu_ps(a + j)));
      for (; j < nu; ++j) a[j] = std::fma(x[r * p.k + k], static_cast<float>(qk[j]), a[j]);
    }
  }
}
#else
template <int R>
TFMETAL_INT8_INLINE void StreamRows(const Problem& p, const float* x, int64_t n0, int64_t n1, float* acc) {
  const int64_t nu = n1 - n0, ldacc = p.unit_cols;
  for (int r = 0; r < R; ++r) std::fill(acc + r * ldacc, acc + r * ldacc + nu, 0.0f);
  for (int64_t k = 0; k < p.k; ++k) {
    const int8_t* qk = p.q + k * p.n + n0;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * p.k + k];
      float* a = acc + r * ldacc;
      for (int64_t j = 0; j < nu; ++j) a[j] += xv * static_cast<float>(qk[j]);  // as MicroPortable
    }
  }
}
#endif

// rows [0, rows) of `x` (ldx = k) times columns [n0, n1) into `acc` (ldacc = unit_cols).
TFMETAL_INT8_INLINE void Contract(const Problem& p, const float* x, int64_t rows, int64_t n0, int64_t n1,
                                  float* acc, int8_t* packed) {
  // Three or more rows: the packed panels below, each converted weight used for up to kMR rows
  // from registers (streaming 8 rows measured 0.85x float at 4096x4096, the packed form 0.95x).
  if (rows == 1) return StreamRows<1>(p, x, n0, n1, acc);
  if (rows == 2) return StreamRows<2>(p, x, n0, n1, acc);
  const int64_t ldacc = p.unit_cols, nu = n1 - n0;
  for (int64_t r = 0; r < rows; ++r) std::fill(acc + r * ldacc, acc + r * ldacc + nu, 0.0f);
  for (int64_t kb = 0; kb < p.k; kb += kKC) {
    const int64_t kc = std::min(kKC, p.k - kb);
    PackBlock(p, kb, kc, n0, n1, packed);
    for (int64_t j0 = n0; j0 < n1; j0 += kPanel) {
      const int64_t j1 = std::min(j0 + kPanel, n1);
      const int8_t* panel = packed + ((j0 - n0) / kPanel) * kKC * kPanel;
      if (kb + kKC < p.k) PrefetchPanel(p, kb + kKC, std::min(kKC, p.k - kb - kKC), j0, j1);
      for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
        const int64_t mr = std::min(kMR, rows - r0);
        Pass pass;
        pass.x = x + r0 * p.k + kb;
        pass.ldx = p.k;
        pass.ldq = kPanel;
        pass.kc = kc;
        pass.ldacc = ldacc;
        int64_t s0 = j0;
#ifdef TFMETAL_INT8_BODY_AVX2
        for (const int64_t wide = WideColumns(mr); s0 + wide <= j1; s0 += wide) {
          pass.q = panel + (s0 - j0);
          pass.nc = wide;
          pass.acc = acc + r0 * ldacc + (s0 - n0);
          MicroWide(mr, pass);
        }
#endif
        for (; s0 < j1; s0 += kNR) {
          pass.q = panel + (s0 - j0);
          pass.nc = std::min(kNR, j1 - s0);
          pass.acc = acc + r0 * ldacc + (s0 - n0);
          MicroRows(mr, pass);
        }
      }
    }
  }
}

// Work items [begin, end) of `c`: rows from `source(r0, rows, buffer)` (a float pointer,
// ldx = k), contracted, then scale, bias and activation (tfmetal/int8.h) into c.y.
template <typename T, typename Source>
void RunItems(const Call<T>& c, const Source& source, int64_t begin, int64_t end, float* scratch) {
  const Problem& p = c.p;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t g = item / p.units, u = item % p.units;
    const int64_t r0 = g * p.group_rows, rows = std::min(p.group_rows, p.m - r0);
    const int64_t n0 = u * p.unit_cols, n1 = std::min(p.n, n0 + p.unit_cols);
    float* acc = scratch;
    int8_t* packed = reinterpret_cast<int8_t*>(scratch + p.group_rows * p.unit_cols);
    const float* x = source(r0, rows, scratch + p.group_rows * p.unit_cols + PackedFloats(p));
    Contract(p, x, rows, n0, n1, acc, packed);
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = acc + r * p.unit_cols;
      T* y = c.y + (r0 + r) * p.n;
      for (int64_t n = n0; n < n1; ++n) {
        const float b = c.bias != nullptr ? static_cast<float>(c.bias[n]) : 0.0f;
        y[n] = static_cast<T>(tfm_int8_epilogue(a[n - n0], p.scale[n], b, p.activation, p.alpha));
      }
    }
  }
}
