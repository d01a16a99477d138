// ---------------------------------------------------------------------------------------------
// Fused causal attention, FlashAttention-2 style (helper "kern", issue #25). Compiled as part of
// the same NVRTC program as kernels.cu (program.rs appends this file to it), so it shares its
// conventions: BLOCK threads per block, a one-dimensional grid that the kernels loop over, u64
// sizes, --fmad=false, no floating-point atomics.
//
// Layout: q, k, v, out, dout, dq, dk, dv are [bh, t, d] row-major in the element type E (f32,
// or the raw bits of bf16 / f16); lse and delta are [bh, t] f32. Scores are s = (q.k)*scale with
// key j visible to query i iff j <= i.
//
// Forward (flash_fwd_*): one block per tile of BR queries of one head. The queries' tile stays
// in shared memory; tiles of BC keys and values stream through shared memory; each query row
// keeps a running maximum m, a running sum l of exp(s - m) and its output accumulator in
// registers (online softmax), rescaled by exp(m_old - m_new) whenever the maximum grows. At the
// end out = acc / l and lse = m + log(l). Nothing of size t x t is ever stored.
//
// Backward: delta = rowsum(dout * out) (flash_bwd_pre_*), then two passes that each recompute
// P = exp(s - lse) tile by tile: flash_bwd_dkdv_* (one block per tile of BK keys, looping over
// the query tiles at or below the diagonal: dv += P^T dout, dk += scale * dS^T q with
// dS = P * (dout v^T - delta)) and flash_bwd_dq_* (one block per tile of BQ queries, looping
// over the key tiles up to the diagonal: dq += scale * dS k). Every output element is written
// by exactly one thread, summing in a fixed order: no atomics, so results are bit-reproducible.
//
// Tile sizes are compile-time: head dims up to 64 use 64-query / 32-key forward tiles and
// 32 x 32 backward tiles, head dims up to 128 use 32 / 16 and 16 x 16 (everything in static
// shared memory, under 48 KiB per block). Rows are padded by one float against bank conflicts.
// The arithmetic is plain f32 on the CUDA cores (no tensor-core mma): half inputs are widened
// on load and results rounded once on store.

struct EltF32 {
    typedef float T;
    static __device__ float ld(const float* p, u64 i) { return p[i]; }
    static __device__ void st(float* p, u64 i, float x) { p[i] = x; }
};

struct EltBf16 {
    typedef u16 T;
    static __device__ float ld(const u16* p, u64 i) { return __uint_as_float((u32)p[i] << 16); }
    static __device__ void st(u16* p, u64 i, float x) { p[i] = f32_to_bf16_bits(x); }
};

struct EltF16 {
    typedef u16 T;
    static __device__ float ld(const u16* p, u64 i) { return f16_bits_to_f32(p[i]); }
    static __device__ void st(u16* p, u64 i, float x) { p[i] = f32_to_f16_bits(x); }
};

__device__ u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

// Loads rows [r0, r0 + n) of a [t, d] matrix at `src` into sh[0..R)[0..d), zero-filling rows
// past n.
template <class E, int R, int W>
__device__ void flash_load(float (*sh)[W], const typename E::T* src, u64 r0, u64 n, u64 d) {
    for (u64 i = threadIdx.x; i < (u64)R * d; i += BLOCK) {
        u64 r = i / d, j = i % d;
        sh[r][j] = r < n ? E::ld(src, (r0 + r) * d + j) : 0.0f;
    }
}

template <class E, int DMAX, int BR, int BC>
__device__ void flash_fwd(u64 bh, u64 t, u64 d, float scale, const typename E::T* q,
                          const typename E::T* k, const typename E::T* v, typename E::T* out,
                          float* lse) {
    constexpr int TPR = BLOCK / BR;  // threads per query row
    constexpr int KPT = BC / TPR;    // keys of a tile per thread
    constexpr int CPT = DMAX / TPR;  // output columns per thread
    __shared__ float qs[BR][DMAX + 1];
    __shared__ float ks[BC][DMAX + 1];
    __shared__ float vs[BC][DMAX + 1];
    __shared__ float ps[BR][BC + 1];
    __shared__ float red_max[BR][TPR];
    __shared__ float red_sum[BR][TPR];
    const u64 r = threadIdx.x / TPR, tc = threadIdx.x % TPR;
    const u64 tiles = (t + BR - 1) / BR;
    for (u64 blk = blockIdx.x; blk < bh * tiles; blk += gridDim.x) {
        const u64 h = blk / tiles, q0 = (blk % tiles) * BR;
        const u64 rows = min_u64(BR, t - q0);
        const u64 base = h * t * d;
        __syncthreads();  // the previous tile's readers of qs are done
        flash_load<E, BR, DMAX + 1>(qs, q + base, q0, rows, d);
        float m = neg_inf_f32(), l = 0.0f;
        float acc[CPT];
#pragma unroll
        for (int c = 0; c < CPT; ++c) acc[c] = 0.0f;
        const u64 kend = q0 + rows;  // no query of the tile sees a key at or past kend
        for (u64 k0 = 0; k0 < kend; k0 += BC) {
            const u64 kn = min_u64(BC, kend - k0);
            __syncthreads();  // qs is loaded; the previous key tile's readers are done
            flash_load<E, BC, DMAX + 1>(ks, k + base, k0, kn, d);
            flash_load<E, BC, DMAX + 1>(vs, v + base, k0, kn, d);
            __syncthreads();
            float s[KPT];
            float mt = neg_inf_f32();
#pragma unroll
            for (int i = 0; i < KPT; ++i) {
                const u64 c = tc + (u64)i * TPR;
                s[i] = neg_inf_f32();
                if (r < rows && k0 + c <= q0 + r) {
                    float dot = 0.0f;
                    for (u64 j = 0; j < d; ++j) dot = dot + qs[r][j] * ks[c][j];
                    s[i] = dot * scale;
                    mt = fmaxf(mt, s[i]);
                }
            }
            red_max[r][tc] = mt;
            __syncthreads();
            for (int i = 0; i < TPR; ++i) mt = fmaxf(mt, red_max[r][i]);
            const float mn = fmaxf(m, mt);
            // A padding row (no visible key) keeps m = -inf; shifting by 0 keeps its p at 0.
            const float shift = mn == neg_inf_f32() ? 0.0f : mn;
            const float alpha = expf(m - shift);
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < KPT; ++i) {
                const float p = expf(s[i] - shift);  // masked: exp(-inf) = 0
                ps[r][tc + (u64)i * TPR] = p;
                part = part + p;
            }
            red_sum[r][tc] = part;
            __syncthreads();
            float lt = 0.0f;
            for (int i = 0; i < TPR; ++i) lt = lt + red_sum[r][i];  // same order in every lane
            l = l * alpha + lt;
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPR;
                float a = acc[c] * alpha;
                if (j < d) {
                    for (u64 kk = 0; kk < kn; ++kk) a = a + ps[r][kk] * vs[kk][j];
                }
                acc[c] = a;
            }
            m = mn;
        }
        if (r < rows) {
            const u64 row = q0 + r;
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPR;
                if (j < d) E::st(out, base + row * d + j, acc[c] / l);
            }
            if (tc == 0) lse[h * t + row] = m + logf(l);
        }
    }
}

template <class E>
__device__ void flash_bwd_pre(u64 rows, u64 d, const typename E::T* out,
                              const typename E::T* dout, float* delta) {
    GRID_STRIDE(i, rows) {
        float acc = 0.0f;
        for (u64 j = 0; j < d; ++j) acc = acc + E::ld(dout, i * d + j) * E::ld(out, i * d + j);
        delta[i] = acc;
    }
}

// P and dS of one (query tile, key tile) pair into ps / dss (0 where masked or padding); the
// tiles' q, dout, k, v rows and the queries' lse / delta are in shared memory.
template <int DMAX, int BQ, int BK>
__device__ void flash_bwd_tile(u64 q0, u64 qn, u64 k0, u64 kn, u64 d, float scale,
                               float (*qs)[DMAX + 1], float (*gs)[DMAX + 1],
                               float (*ks)[DMAX + 1], float (*vs)[DMAX + 1], const float* ls,
                               const float* dl, float (*ps)[BK + 1], float (*dss)[BK + 1]) {
    constexpr int EPT = BQ * BK / BLOCK;
#pragma unroll
    for (int e = 0; e < EPT; ++e) {
        const u64 idx = threadIdx.x + (u64)e * BLOCK;
        const u64 qi = idx / BK, kc = idx % BK;
        float p = 0.0f, ds = 0.0f;
        if (qi < qn && kc < kn && k0 + kc <= q0 + qi) {
            float sq = 0.0f, sg = 0.0f;
            for (u64 j = 0; j < d; ++j) {
                sq = sq + qs[qi][j] * ks[kc][j];
                sg = sg + gs[qi][j] * vs[kc][j];
            }
            p = expf(sq * scale - ls[qi]);
            ds = p * (sg - dl[qi]);
        }
        if (ps) ps[qi][kc] = p;
        dss[qi][kc] = ds;
    }
}

template <class E, int DMAX, int BQ, int BK>
__device__ void flash_bwd_dkdv(u64 bh, u64 t, u64 d, float scale, const typename E::T* q,
                               const typename E::T* k, const typename E::T* v,
                               const typename E::T* dout, const float* lse, const float* delta,
                               typename E::T* dk, typename E::T* dv) {
    constexpr int TPK = BLOCK / BK;  // threads per key row
    constexpr int CPT = DMAX / TPK;  // gradient columns per thread
    __shared__ float ks[BK][DMAX + 1];
    __shared__ float vs[BK][DMAX + 1];
    __shared__ float qs[BQ][DMAX + 1];
    __shared__ float gs[BQ][DMAX + 1];
    __shared__ float ps[BQ][BK + 1];
    __shared__ float dss[BQ][BK + 1];
    __shared__ float ls[BQ];
    __shared__ float dl[BQ];
    const u64 kr = threadIdx.x / TPK, tc = threadIdx.x % TPK;
    const u64 tiles = (t + BK - 1) / BK;
    for (u64 blk = blockIdx.x; blk < bh * tiles; blk += gridDim.x) {
        const u64 h = blk / tiles, k0 = (blk % tiles) * BK;
        const u64 kn = min_u64(BK, t - k0);
        const u64 base = h * t * d;
        __syncthreads();
        flash_load<E, BK, DMAX + 1>(ks, k + base, k0, kn, d);
        flash_load<E, BK, DMAX + 1>(vs, v + base, k0, kn, d);
        float dka[CPT], dva[CPT];
#pragma unroll
        for (int c = 0; c < CPT; ++c) dka[c] = dva[c] = 0.0f;
        for (u64 q0 = k0 / BQ * BQ; q0 < t; q0 += BQ) {
            const u64 qn = min_u64(BQ, t - q0);
            __syncthreads();  // ks/vs loaded; the previous query tile's readers are done
            flash_load<E, BQ, DMAX + 1>(qs, q + base, q0, qn, d);
            flash_load<E, BQ, DMAX + 1>(gs, dout + base, q0, qn, d);
            for (u64 i = threadIdx.x; i < BQ; i += BLOCK) {
                ls[i] = i < qn ? lse[h * t + q0 + i] : 0.0f;
                dl[i] = i < qn ? delta[h * t + q0 + i] : 0.0f;
            }
            __syncthreads();
            flash_bwd_tile<DMAX, BQ, BK>(q0, qn, k0, kn, d, scale, qs, gs, ks, vs, ls, dl, ps,
                                         dss);
            __syncthreads();
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPK;
                if (j < d) {
                    float a = dva[c], b = dka[c];
                    for (u64 qi = 0; qi < qn; ++qi) {
                        a = a + ps[qi][kr] * gs[qi][j];
                        b = b + dss[qi][kr] * qs[qi][j];
                    }
                    dva[c] = a;
                    dka[c] = b;
                }
            }
        }
        if (kr < kn) {
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPK;
                if (j < d) {
                    E::st(dk, base + (k0 + kr) * d + j, dka[c] * scale);
                    E::st(dv, base + (k0 + kr) * d + j, dva[c]);
                }
            }
        }
    }
}

template <class E, int DMAX, int BQ, int BK>
__device__ void flash_bwd_dq(u64 bh, u64 t, u64 d, float scale, const typename E::T* q,
                             const typename E::T* k, const typename E::T* v,
                             const typename E::T* dout, const float* lse, const float* delta,
                             typename E::T* dq) {
    constexpr int TPQ = BLOCK / BQ;  // threads per query row
    constexpr int CPT = DMAX / TPQ;  // gradient columns per thread
    __shared__ float qs[BQ][DMAX + 1];
    __shared__ float gs[BQ][DMAX + 1];
    __shared__ float ks[BK][DMAX + 1];
    __shared__ float vs[BK][DMAX + 1];
    __shared__ float dss[BQ][BK + 1];
    __shared__ float ls[BQ];
    __shared__ float dl[BQ];
    const u64 qr = threadIdx.x / TPQ, tc = threadIdx.x % TPQ;
    const u64 tiles = (t + BQ - 1) / BQ;
    for (u64 blk = blockIdx.x; blk < bh * tiles; blk += gridDim.x) {
        const u64 h = blk / tiles, q0 = (blk % tiles) * BQ;
        const u64 qn = min_u64(BQ, t - q0);
        const u64 base = h * t * d;
        __syncthreads();
        flash_load<E, BQ, DMAX + 1>(qs, q + base, q0, qn, d);
        flash_load<E, BQ, DMAX + 1>(gs, dout + base, q0, qn, d);
        for (u64 i = threadIdx.x; i < BQ; i += BLOCK) {
            ls[i] = i < qn ? lse[h * t + q0 + i] : 0.0f;
            dl[i] = i < qn ? delta[h * t + q0 + i] : 0.0f;
        }
        float dqa[CPT];
#pragma unroll
        for (int c = 0; c < CPT; ++c) dqa[c] = 0.0f;
        const u64 kend = q0 + qn;
        for (u64 k0 = 0; k0 < kend; k0 += BK) {
            const u64 kn = min_u64(BK, kend - k0);
            __syncthreads();  // qs/gs loaded; the previous key tile's readers are done
            flash_load<E, BK, DMAX + 1>(ks, k + base, k0, kn, d);
            flash_load<E, BK, DMAX + 1>(vs, v + base, k0, kn, d);
            __syncthreads();
            flash_bwd_tile<DMAX, BQ, BK>(q0, qn, k0, kn, d, scale, qs, gs, ks, vs, ls, dl,
                                         (float (*)[BK + 1])0, dss);
            __syncthreads();
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPQ;
                if (j < d) {
                    float a = dqa[c];
                    for (u64 kc = 0; kc < kn; ++kc) a = a + dss[qr][kc] * ks[kc][j];
                    dqa[c] = a;
                }
            }
        }
        if (qr < qn) {
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPQ;
                if (j < d) E::st(dq, base + (q0 + qr) * d + j, dqa[c] * scale);
            }
        }
    }
}

// Entry points: element type x head-dimension class. Forward tiles: <64, 64, 32> and
// <128, 32, 16>; backward tiles: <64, 32, 32> and <128, 16, 16>.

extern "C" __global__ void flash_fwd_f32_d64(u64 bh, u64 t, u64 d, float scale, const float* q,
                                             const float* k, const float* v, float* out,
                                             float* lse) {
    flash_fwd<EltF32, 64, 64, 32>(bh, t, d, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_bf16_d64(u64 bh, u64 t, u64 d, float scale, const u16* q,
                                              const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltBf16, 64, 64, 32>(bh, t, d, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f16_d64(u64 bh, u64 t, u64 d, float scale, const u16* q,
                                             const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltF16, 64, 64, 32>(bh, t, d, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f32_d128(u64 bh, u64 t, u64 d, float scale, const float* q,
                                              const float* k, const float* v, float* out,
                                              float* lse) {
    flash_fwd<EltF32, 128, 32, 16>(bh, t, d, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_bf16_d128(u64 bh, u64 t, u64 d, float scale, const u16* q,
                                               const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltBf16, 128, 32, 16>(bh, t, d, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f16_d128(u64 bh, u64 t, u64 d, float scale, const u16* q,
                                              const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltF16, 128, 32, 16>(bh, t, d, scale, q, k, v, out, lse);
}

extern "C" __global__ void flash_bwd_pre_f32(u64 rows, u64 d, const float* out,
                                             const float* dout, float* delta) {
    flash_bwd_pre<EltF32>(rows, d, out, dout, delta);
}
extern "C" __global__ void flash_bwd_pre_bf16(u64 rows, u64 d, const u16* out, const u16* dout,
                                              float* delta) {
    flash_bwd_pre<EltBf16>(rows, d, out, dout, delta);
}
extern "C" __global__ void flash_bwd_pre_f16(u64 rows, u64 d, const u16* out, const u16* dout,
                                             float* delta) {
    flash_bwd_pre<EltF16>(rows, d, out, dout, delta);
}

extern "C" __global__ void flash_bwd_dkdv_f32_d64(u64 bh, u64 t, u64 d, float scale,
                                                  const float* q, const float* k, const float* v,
                                                  const float* dout, const float* lse,
                                                  const float* delta, float* dk, float* dv) {
    flash_bwd_dkdv<EltF32, 64, 32, 32>(bh, t, d, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_bf16_d64(u64 bh, u64 t, u64 d, float scale,
                                                   const u16* q, const u16* k, const u16* v,
                                                   const u16* dout, const float* lse,
                                                   const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltBf16, 64, 32, 32>(bh, t, d, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f16_d64(u64 bh, u64 t, u64 d, float scale,
                                                  const u16* q, const u16* k, const u16* v,
                                                  const u16* dout, const float* lse,
                                                  const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltF16, 64, 32, 32>(bh, t, d, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f32_d128(u64 bh, u64 t, u64 d, float scale,
                                                   const float* q, const float* k, const float* v,
                                                   const float* dout, const float* lse,
                                                   const float* delta, float* dk, float* dv) {
    flash_bwd_dkdv<EltF32, 128, 16, 16>(bh, t, d, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_bf16_d128(u64 bh, u64 t, u64 d, float scale,
                                                    const u16* q, const u16* k, const u16* v,
                                                    const u16* dout, const float* lse,
                                                    const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltBf16, 128, 16, 16>(bh, t, d, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f16_d128(u64 bh, u64 t, u64 d, float scale,
                                                   const u16* q, const u16* k, const u16* v,
                                                   const u16* dout, const float* lse,
                                                   const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltF16, 128, 16, 16>(bh, t, d, scale, q, k, v, dout, lse, delta, dk, dv);
}

extern "C" __global__ void flash_bwd_dq_f32_d64(u64 bh, u64 t, u64 d, float scale, const float* q,
                                                const float* k, const float* v,
                                                const float* dout, const float* lse,
                                                const float* delta, float* dq) {
    flash_bwd_dq<EltF32, 64, 32, 32>(bh, t, d, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_bf16_d64(u64 bh, u64 t, u64 d, float scale, const u16* q,
                                                 const u16* k, const u16* v, const u16* dout,
                                                 const float* lse, const float* delta, u16* dq) {
    flash_bwd_dq<EltBf16, 64, 32, 32>(bh, t, d, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f16_d64(u64 bh, u64 t, u64 d, float scale, const u16* q,
                                                const u16* k, const u16* v, const u16* dout,
                                                const float* lse, const float* delta, u16* dq) {
    flash_bwd_dq<EltF16, 64, 32, 32>(bh, t, d, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f32_d128(u64 bh, u64 t, u64 d, float scale,
                                                 const float* q, const float* k, const float* v,
                                                 const float* dout, const float* lse,
                                                 const float* delta, float* dq) {
    flash_bwd_dq<EltF32, 128, 16, 16>(bh, t, d, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_bf16_d128(u64 bh, u64 t, u64 d, float scale,
                                                  const u16* q, const u16* k, const u16* v,
                                                  const u16* dout, const float* lse,
                                                  const float* delta, u16* dq) {
    flash_bwd_dq<EltBf16, 128, 16, 16>(bh, t, d, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f16_d128(u64 bh, u64 t, u64 d, float scale,
                                                 const u16* q, const u16* k, const u16* v,
                                                 const u16* dout, const float* lse,
                                                 const float* delta, u16* dq) {
    flash_bwd_dq<EltF16, 128, 16, 16>(bh, t, d, scale, q, k, v, dout, lse, delta, dq);
}
