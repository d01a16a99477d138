// ---------------------------------------------------------------------------------------------
// Fused causal attention, FlashAttention-2 style (helper "kern", issue #25). Compiled as part of
// the one NVRTC program (kernels/program.rs joins common.cu and every family's .cu), so it
// uses common.cu's helpers and shares its conventions: BLOCK threads per block, a one-dimensional grid that the kernels loop over, u64
// sizes, --fmad=false (the register-tiled kernels' products, delta and the generic backward's
// dot products use explicit __fmaf_rn instead), no floating-point atomics.
//
// Layout: q, out, dout, dq are [bh, t, d] and k, v, dk, dv [b * kv_heads, t, d] row-major in
// the element type E (f32, or the raw bits of bf16 / f16), or (packed != 0) the layout of a fused
// qkv projection: q, k, v and dq, dk, dv are head slots of one [b, t, heads + 2 * kv_heads, d]
// tensor and out, dout are [b, t, heads, d] (fa_rows gives each head's base and row stride; no
// head split / merge copies); lse and delta are [bh, t] f32 in both. bh = b * heads counts
// query heads. Grouped-query attention: query head h reads key/value head h / (heads /
// kv_heads) in place (nothing repeated); kv_heads == heads is multi-head attention. Scores are
// s = (q.k)*scale, with the host's scale (1/sqrt(d) by default), and key j visible to query i
// iff j <= i.

// Forward (flash_fwd_*): one block per tile of BR queries of one head. The queries' tile stays
// in shared memory; tiles of BC keys and values stream through shared memory; each query row
// keeps a running maximum m, a running sum l of exp(s - m) and its output accumulator in
// registers (online softmax), rescaled by exp(m_old - m_new) whenever the maximum grows. At the
// end out = acc / l and lse = m + log(l). Nothing of size t x t is ever stored.
//
// Backward: delta = rowsum(dout * out) (flash_bwd_pre_*), then two passes that each recompute
// P = exp(s - lse) tile by tile: flash_bwd_dkdv_* (one block per tile of BK keys of a key/value
// head, looping over its group's query heads in ascending order and, for each, over the query
// tiles at or below the diagonal: dv += P^T dout, dk += scale * dS^T q with
// dS = P * (dout v^T - delta)) and flash_bwd_dq_* (one block per tile of BQ queries, looping
// over the key tiles up to the diagonal: dq += scale * dS k). Every output element is written
// by exactly one thread, summing in a fixed order: no atomics, so results are bit-reproducible.
//
// Two kernel families share that structure. Head dims of exactly 64 or 128 (when t * d < 2^31)
// take the register-tiled kernels (`_d64`, `_d128`; flash_tiled.cu, which follows this file:
// compile-time head dim, per-thread micro-tiles, float4 shared loads, explicit FMAs). Every other
// head dim up to 128 takes the generic kernels (`_le64`, `_le128`): head dim read at run time,
// one score (or output column) per thread and loop step, two shared loads per multiply-add,
// rows padded by one float against bank conflicts.
// Both use the same compile-time tiles: head dims up to 64 use 64-query / 32-key forward tiles
// and 32 x 32 backward tiles, head dims up to 128 use 32 / 16 and 16 x 16 (everything in static
// shared memory, under 48 KiB per block). The arithmetic is f32 on the CUDA cores: half inputs
// are widened on load and results rounded once on store. The bf16 / f16 forward at head dims 64
// and 128 also has a tensor-core kernel (flash_mma.cu, mma.sync), which the host takes on
// compute capability 8.0+.

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

// Where query head bh's rows of an operand live: row 0's element offset and the row stride.
// Parts 0 and 3 (q, dq; out, dout) are the query head's; parts 1 and 2 (k, dk; v, dv) its
// key/value head's: head (bh % heads) / (heads / kv_heads) of its batch entry (grouped-query
// attention; kv_heads == heads is multi-head attention, and kv_heads divides heads, checked by
// the host). packed == 0: q, out are [b * heads, t, d] and k, v [b * kv_heads, t, d] (stride
// d). packed != 0, the layout of a fused qkv projection (no head split / merge copies): parts
// 0, 1, 2 (each pointer the whole tensor) are head slots of [b, t, heads + 2 * kv_heads, d]
// (per position the query heads, then the key heads, then the value heads: GPT's
// [b, t, 3, heads, d] when kv_heads == heads; stride (heads + 2 * kv_heads) * d); part 3 (out,
// dout) is [b, t, heads, d] (stride heads * d). lse and delta are [b * heads, t] in both.
struct FaRows {
    u64 base, rs;
};
__device__ FaRows fa_rows(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, u64 part) {
    FaRows r;
    const u64 b = bh / heads, h = bh % heads;
    const u64 hk = h / (heads / kv_heads);
    if (!packed) {
        r.base = (part == 1 || part == 2 ? b * kv_heads + hk : bh) * t * d;
        r.rs = d;
        return r;
    }
    if (part == 3) {
        r.base = (b * t * heads + h) * d;
        r.rs = heads * d;
    } else {
        const u64 width = heads + 2 * kv_heads;
        const u64 slot = part == 0 ? h : part == 1 ? heads + hk : heads + kv_heads + hk;
        r.base = (b * t * width + slot) * d;
        r.rs = width * d;
    }
    return r;
}

// The first query head of key/value head bkv's group (bkv counts [b * kv_heads] heads): the
// dk/dv passes sum over query heads h0, h0 + 1, ..., h0 + heads / kv_heads - 1, in that order.
__device__ u64 fa_group_first(u64 bkv, u64 heads, u64 kv_heads) {
    return (bkv / kv_heads) * heads + (bkv % kv_heads) * (heads / kv_heads);
}

// Loads rows [r0, r0 + n) of a [t, d] matrix at `src` (row stride rs) into sh[0..R)[0..d),
// zero-filling rows past n.
template <class E, int R, int W>
__device__ void flash_load(float (*sh)[W], const typename E::T* src, u64 r0, u64 n, u64 d,
                           u64 rs) {
    for (u64 i = threadIdx.x; i < (u64)R * d; i += BLOCK) {
        u64 r = i / d, j = i % d;
        sh[r][j] = r < n ? E::ld(src, (r0 + r) * rs + j) : 0.0f;
    }
}

template <class E, int DMAX, int BR, int BC>
__device__ void flash_fwd(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const typename E::T* q,
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
        const FaRows rq = fa_rows(h, t, d, heads, kv_heads, packed, 0), rk = fa_rows(h, t, d, heads, kv_heads, packed, 1),
                     rv = fa_rows(h, t, d, heads, kv_heads, packed, 2), ro = fa_rows(h, t, d, heads, kv_heads, packed, 3);
        __syncthreads();  // the previous tile's readers of qs are done
        flash_load<E, BR, DMAX + 1>(qs, q + rq.base, q0, rows, d, rq.rs);
        float m = neg_inf_f32(), l = 0.0f;
        float acc[CPT];
#pragma unroll
        for (int c = 0; c < CPT; ++c) acc[c] = 0.0f;
        const u64 kend = q0 + rows;  // no query of the tile sees a key at or past kend
        for (u64 k0 = 0; k0 < kend; k0 += BC) {
            const u64 kn = min_u64(BC, kend - k0);
            __syncthreads();  // qs is loaded; the previous key tile's readers are done
            flash_load<E, BC, DMAX + 1>(ks, k + rk.base, k0, kn, d, rk.rs);
            flash_load<E, BC, DMAX + 1>(vs, v + rv.base, k0, kn, d, rv.rs);
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
                if (j < d) E::st(out, ro.base + row * ro.rs + j, acc[c] / l);
            }
            if (tc == 0) lse[h * t + row] = m + logf(l);
        }
    }
}

template <class E>
__device__ void flash_bwd_pre(u64 rows, u64 d, u64 t, u64 heads, u64 packed, const typename E::T* out,
                              const typename E::T* dout, float* delta) {
    GRID_STRIDE(i, rows) {
        float acc = 0.0f;
        // Fused multiply-adds in column order, as the backward kernels compute dout.v: a row
        // with one visible key (out = v) gets dS = p * (dout.v - delta) = 0 exactly.
        const FaRows ro = fa_rows(i / t, t, d, heads, heads, packed, 3);
        const u64 o = ro.base + (i % t) * ro.rs;
        for (u64 j = 0; j < d; ++j) acc = __fmaf_rn(E::ld(dout, o + j), E::ld(out, o + j), acc);
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
            for (u64 j = 0; j < d; ++j) {  // fused, in column order, like delta's
                sq = __fmaf_rn(qs[qi][j], ks[kc][j], sq);
                sg = __fmaf_rn(gs[qi][j], vs[kc][j], sg);
            }
            p = expf(sq * scale - ls[qi]);
            ds = p * (sg - dl[qi]);
        }
        if (ps) ps[qi][kc] = p;
        dss[qi][kc] = ds;
    }
}

template <class E, int DMAX, int BQ, int BK>
__device__ void flash_bwd_dkdv(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const typename E::T* q,
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
    const u64 group = heads / kv_heads, bkv = bh / group;
    for (u64 blk = blockIdx.x; blk < bkv * tiles; blk += gridDim.x) {
        const u64 hk = blk / tiles, k0 = (blk % tiles) * BK;
        const u64 kn = min_u64(BK, t - k0);
        const u64 h0 = fa_group_first(hk, heads, kv_heads);
        const FaRows rk = fa_rows(h0, t, d, heads, kv_heads, packed, 1),
                     rv = fa_rows(h0, t, d, heads, kv_heads, packed, 2);
        __syncthreads();
        flash_load<E, BK, DMAX + 1>(ks, k + rk.base, k0, kn, d, rk.rs);
        flash_load<E, BK, DMAX + 1>(vs, v + rv.base, k0, kn, d, rv.rs);
        float dka[CPT], dva[CPT];
#pragma unroll
        for (int c = 0; c < CPT; ++c) dka[c] = dva[c] = 0.0f;
        // The group's query heads in ascending order, each over its query tiles.
        for (u64 h = h0; h < h0 + group; ++h) {
            const FaRows rq = fa_rows(h, t, d, heads, kv_heads, packed, 0),
                         ro = fa_rows(h, t, d, heads, kv_heads, packed, 3);
            for (u64 q0 = k0 / BQ * BQ; q0 < t; q0 += BQ) {
                const u64 qn = min_u64(BQ, t - q0);
                __syncthreads();  // ks/vs loaded; the previous query tile's readers are done
                flash_load<E, BQ, DMAX + 1>(qs, q + rq.base, q0, qn, d, rq.rs);
                flash_load<E, BQ, DMAX + 1>(gs, dout + ro.base, q0, qn, d, ro.rs);
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
        }
        if (kr < kn) {
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const u64 j = tc + (u64)c * TPK;
                if (j < d) {
                    E::st(dk, rk.base + (k0 + kr) * rk.rs + j, dka[c] * scale);
                    E::st(dv, rv.base + (k0 + kr) * rv.rs + j, dva[c]);
                }
            }
        }
    }
}

template <class E, int DMAX, int BQ, int BK>
__device__ void flash_bwd_dq(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const typename E::T* q,
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
        const FaRows rq = fa_rows(h, t, d, heads, kv_heads, packed, 0), rk = fa_rows(h, t, d, heads, kv_heads, packed, 1),
                     rv = fa_rows(h, t, d, heads, kv_heads, packed, 2), ro = fa_rows(h, t, d, heads, kv_heads, packed, 3);
        __syncthreads();
        flash_load<E, BQ, DMAX + 1>(qs, q + rq.base, q0, qn, d, rq.rs);
        flash_load<E, BQ, DMAX + 1>(gs, dout + ro.base, q0, qn, d, ro.rs);
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
            flash_load<E, BK, DMAX + 1>(ks, k + rk.base, k0, kn, d, rk.rs);
            flash_load<E, BK, DMAX + 1>(vs, v + rv.base, k0, kn, d, rv.rs);
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
                if (j < d) E::st(dq, rq.base + (q0 + qr) * rq.rs + j, dqa[c] * scale);
            }
        }
    }
}

// Entry points: element type x head-dimension class. The generic kernels
// (`_le64`, `_le128`: any head dim up to 64 / 128, read at run time) use forward tiles
// <64, 64, 32> and <128, 32, 16> and backward tiles <64, 32, 32> and <128, 16, 16>; the
// register-tiled ones (`_d64`, `_d128`: exactly that head dim) are in flash_tiled.cu.

extern "C" __global__ void flash_fwd_f32_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                             const float* k, const float* v, float* out,
                                             float* lse) {
    flash_fwd<EltF32, 64, 64, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_bf16_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                              const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltBf16, 64, 64, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f16_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                             const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltF16, 64, 64, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f32_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                              const float* k, const float* v, float* out,
                                              float* lse) {
    flash_fwd<EltF32, 128, 32, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_bf16_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                               const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltBf16, 128, 32, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f16_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                              const u16* k, const u16* v, u16* out, float* lse) {
    flash_fwd<EltF16, 128, 32, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, out, lse);
}

extern "C" __global__ void flash_bwd_pre_f32(u64 rows, u64 d, u64 t, u64 heads, u64 packed, const float* out,
                                             const float* dout, float* delta) {
    flash_bwd_pre<EltF32>(rows, d, t, heads, packed, out, dout, delta);
}
extern "C" __global__ void flash_bwd_pre_bf16(u64 rows, u64 d, u64 t, u64 heads, u64 packed, const u16* out, const u16* dout,
                                              float* delta) {
    flash_bwd_pre<EltBf16>(rows, d, t, heads, packed, out, dout, delta);
}
extern "C" __global__ void flash_bwd_pre_f16(u64 rows, u64 d, u64 t, u64 heads, u64 packed, const u16* out, const u16* dout,
                                             float* delta) {
    flash_bwd_pre<EltF16>(rows, d, t, heads, packed, out, dout, delta);
}

extern "C" __global__ void flash_bwd_dkdv_f32_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                  const float* q, const float* k, const float* v,
                                                  const float* dout, const float* lse,
                                                  const float* delta, float* dk, float* dv) {
    flash_bwd_dkdv<EltF32, 64, 32, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_bf16_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                   const u16* q, const u16* k, const u16* v,
                                                   const u16* dout, const float* lse,
                                                   const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltBf16, 64, 32, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f16_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                  const u16* q, const u16* k, const u16* v,
                                                  const u16* dout, const float* lse,
                                                  const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltF16, 64, 32, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f32_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                   const float* q, const float* k, const float* v,
                                                   const float* dout, const float* lse,
                                                   const float* delta, float* dk, float* dv) {
    flash_bwd_dkdv<EltF32, 128, 16, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_bf16_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                    const u16* q, const u16* k, const u16* v,
                                                    const u16* dout, const float* lse,
                                                    const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltBf16, 128, 16, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f16_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                   const u16* q, const u16* k, const u16* v,
                                                   const u16* dout, const float* lse,
                                                   const float* delta, u16* dk, u16* dv) {
    flash_bwd_dkdv<EltF16, 128, 16, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}

extern "C" __global__ void flash_bwd_dq_f32_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                                const float* k, const float* v,
                                                const float* dout, const float* lse,
                                                const float* delta, float* dq) {
    flash_bwd_dq<EltF32, 64, 32, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_bf16_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                 const u16* k, const u16* v, const u16* dout,
                                                 const float* lse, const float* delta, u16* dq) {
    flash_bwd_dq<EltBf16, 64, 32, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f16_le64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                const u16* k, const u16* v, const u16* dout,
                                                const float* lse, const float* delta, u16* dq) {
    flash_bwd_dq<EltF16, 64, 32, 32>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f32_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                 const float* q, const float* k, const float* v,
                                                 const float* dout, const float* lse,
                                                 const float* delta, float* dq) {
    flash_bwd_dq<EltF32, 128, 16, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_bf16_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                  const u16* q, const u16* k, const u16* v,
                                                  const u16* dout, const float* lse,
                                                  const float* delta, u16* dq) {
    flash_bwd_dq<EltBf16, 128, 16, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f16_le128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale,
                                                 const u16* q, const u16* k, const u16* v,
                                                 const u16* dout, const float* lse,
                                                 const float* delta, u16* dq) {
    flash_bwd_dq<EltF16, 128, 16, 16>(bh, t, d, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
