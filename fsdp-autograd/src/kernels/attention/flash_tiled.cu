// The register-tiled fused attention kernels (flash.cu's contract and helpers; this file follows
// flash.cu in the NVRTC program, split from it to keep each kernel file under 1,000 lines).

// ---------------------------------------------------------------------------------------------
// Register-tiled kernels for head dims exactly 64 and 128 (helper "flash"): the same contract as
// the kernels above (causal, [bh, t, D], lse saved, every output written by one thread in a
// fixed order, no atomics, no t x t buffer), with the head dim a compile-time constant and u32
// index math inside a head (the host takes them only when t * D < 2^31).
//
// Threads form a 16 x 16 grid, ty = threadIdx.x / 16 and tx = threadIdx.x % 16. A thread owns a
// micro-tile of every product: rows ty + 16 i of the block's row set and columns tx + 16 j of
// the streamed set for the score-like products (the dot products run four head-dim elements at
// a time, one float4 shared load per row, so a 4 x 2 micro-tile does 32 FMAs per six 16-byte
// loads), and rows ty + 16 i x head-dim columns 4 tx + 64 c .. + 3 for the accumulations (one
// float4 load of the streamed operand per four FMAs per row). Rows of the [rows][D] tiles are
// padded to D + 4 floats, so the float4 loads of 8 consecutive rows hit distinct banks; tiles
// read along columns are unpadded and 16-byte aligned.
//
// Every dot product and accumulation is an explicit __fmaf_rn chain in a fixed order (the
// program keeps --fmad=false elsewhere): one rounding per multiply-add, deterministic, and at
// least as accurate as the split multiply-then-add of the generic kernels. CUDA cores only: no
// tensor-core mma (the host emulator cannot run inline PTX).
//
// Tiles (static shared memory, all under 48 KiB):
//   D = 64:  forward 64 queries x 32 keys (46,592 B), dk/dv 32 keys x 32 queries (43,264 B),
//            dq 32 queries x 32 keys (39,168 B);
//   D = 128: forward 32 x 16 (37,632 B), dk/dv 16 x 16 (35,968 B), dq 16 x 16 (34,944 B).

__device__ u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

// One aligned 16-byte shared-memory load (p is 16-byte aligned: row strides and column offsets
// below are multiples of four floats, and the tiles are __align__(16)).
__device__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// acc + a.b over four elements, fused multiply-adds in x, y, z, w order.
__device__ float fma4(float4 a, float4 b, float acc) {
    acc = __fmaf_rn(a.x, b.x, acc);
    acc = __fmaf_rn(a.y, b.y, acc);
    acc = __fmaf_rn(a.z, b.z, acc);
    return __fmaf_rn(a.w, b.w, acc);
}

__device__ float comp4(float4 a, int u) { return u == 0 ? a.x : u == 1 ? a.y : u == 2 ? a.z : a.w; }

// Rows [r0, r0 + n) of head matrix `src` ([t, D], row stride rs) into sh[0..R)[0..D), zero
// past n.
template <class E, int D, int R, int W>
__device__ void fa_load(float (*sh)[W], const typename E::T* src, u32 r0, u32 n, u32 rs) {
#pragma unroll 4
    for (u32 i = threadIdx.x; i < (u32)(R * D); i += BLOCK) {
        const u32 r = i / D, j = i % D;
        sh[r][j] = r < n ? E::ld(src, (r0 + r) * rs + j) : 0.0f;
    }
}

// lse and delta of query rows [q0, q0 + n) into ls / dl, zero past n.
template <int R>
__device__ void fa_load_rows(float* ls, float* dl, const float* lse, const float* delta, u32 q0,
                             u32 n) {
    for (u32 i = threadIdx.x; i < (u32)R; i += BLOCK) {
        ls[i] = i < n ? lse[q0 + i] : 0.0f;
        dl[i] = i < n ? delta[q0 + i] : 0.0f;
    }
}

template <class E, int D, int BR, int BC>
__device__ void fa_fwd(u64 bh, u64 t64, u64 heads, u64 kv_heads, u64 packed, float scale, const typename E::T* q,
                       const typename E::T* k, const typename E::T* v, typename E::T* out,
                       float* lse) {
    constexpr int RM = BR / 16;  // query rows per thread: ty + 16 i
    constexpr int SN = BC / 16;  // key columns per thread: tx + 16 j
    constexpr int OC = D / 64;   // float4 output chunks per row: columns 4 tx + 64 c
    constexpr int DP = D + 4;
    __shared__ __align__(16) float qs[BR][DP];
    __shared__ __align__(16) float ks[BC][DP];
    __shared__ __align__(16) float vs[BC][D];
    __shared__ __align__(16) float ps[BR][BC];
    __shared__ float red[BR][16];
    const u32 t = (u32)t64;
    const u32 ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const u32 tiles = (t + BR - 1) / BR;
    for (u64 blk = blockIdx.x; blk < bh * tiles; blk += gridDim.x) {
        // The last query tiles see the most keys: they go first, for a balanced grid.
        const u32 q0 = (tiles - 1 - (u32)(blk / bh)) * BR;
        const u64 h = blk % bh;
        const u32 rows = min_u32(BR, t - q0);
        const FaRows rq = fa_rows(h, t64, D, heads, kv_heads, packed, 0), rk = fa_rows(h, t64, D, heads, kv_heads, packed, 1),
                     rv = fa_rows(h, t64, D, heads, kv_heads, packed, 2), ro = fa_rows(h, t64, D, heads, kv_heads, packed, 3);
        __syncthreads();  // the previous tile's readers of qs and red are done
        fa_load<E, D, BR, DP>(qs, q + rq.base, q0, rows, (u32)rq.rs);
        float m[RM], l[RM], acc[RM][OC][4];
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            m[i] = neg_inf_f32();
            l[i] = 0.0f;
#pragma unroll
            for (int c = 0; c < OC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][c][e] = 0.0f;
        }
        const u32 kend = q0 + rows;  // no query of the tile sees a key at or past kend
        for (u32 k0 = 0; k0 < kend; k0 += BC) {
            const u32 kn = min_u32(BC, kend - k0);
            __syncthreads();  // qs is loaded; the previous key tile's readers are done
            fa_load<E, D, BC, DP>(ks, k + rk.base, k0, kn, (u32)rk.rs);
            fa_load<E, D, BC, D>(vs, v + rv.base, k0, kn, (u32)rv.rs);
            __syncthreads();
            float s[RM][SN];
#pragma unroll
            for (int i = 0; i < RM; ++i)
#pragma unroll
                for (int j = 0; j < SN; ++j) s[i][j] = 0.0f;
#pragma unroll 4
            for (int dd = 0; dd < D; dd += 4) {
                float4 a[RM], b[SN];
#pragma unroll
                for (int i = 0; i < RM; ++i) a[i] = ld4(&qs[ty + 16 * i][dd]);
#pragma unroll
                for (int j = 0; j < SN; ++j) b[j] = ld4(&ks[tx + 16 * j][dd]);
#pragma unroll
                for (int i = 0; i < RM; ++i)
#pragma unroll
                    for (int j = 0; j < SN; ++j) s[i][j] = fma4(a[i], b[j], s[i][j]);
            }
#pragma unroll
            for (int i = 0; i < RM; ++i) {
                const u32 r = ty + 16 * i;
                float mt = neg_inf_f32();
#pragma unroll
                for (int j = 0; j < SN; ++j) {
                    const u32 c = tx + 16 * j;
                    s[i][j] = r < rows && k0 + c <= q0 + r ? s[i][j] * scale : neg_inf_f32();
                    mt = fmaxf(mt, s[i][j]);
                }
                red[r][tx] = mt;
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < RM; ++i) {
                const u32 r = ty + 16 * i;
                float mt = red[r][0];
                for (int x = 1; x < 16; ++x) mt = fmaxf(mt, red[r][x]);
                const float mn = fmaxf(m[i], mt);
                // A padding row (no visible key) keeps m = -inf; shifting by 0 keeps its p at 0.
                const float shift = mn == neg_inf_f32() ? 0.0f : mn;
                const float alpha = expf(m[i] - shift);
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < SN; ++j) {
                    const float p = expf(s[i][j] - shift);  // masked: exp(-inf) = 0
                    ps[r][tx + 16 * j] = p;
                    part = part + p;
                }
                // l is this thread's share of the row sum (its key columns), all shares
                // rescaled by the same alpha; they are added at the end.
                l[i] = l[i] * alpha + part;
                m[i] = mn;
#pragma unroll
                for (int c = 0; c < OC; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][c][e] = acc[i][c][e] * alpha;
            }
            __syncthreads();
            // acc += P V over the tile's keys (keys past kn: p = 0 and zero-filled v rows).
#pragma unroll 2
            for (int kk = 0; kk < BC; kk += 4) {
                float4 pa[RM];
#pragma unroll
                for (int i = 0; i < RM; ++i) pa[i] = ld4(&ps[ty + 16 * i][kk]);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
#pragma unroll
                    for (int c = 0; c < OC; ++c) {
                        const float4 vb = ld4(&vs[kk + u][4 * tx + 64 * c]);
#pragma unroll
                        for (int i = 0; i < RM; ++i) {
                            const float p = comp4(pa[i], u);
                            acc[i][c][0] = __fmaf_rn(p, vb.x, acc[i][c][0]);
                            acc[i][c][1] = __fmaf_rn(p, vb.y, acc[i][c][1]);
                            acc[i][c][2] = __fmaf_rn(p, vb.z, acc[i][c][2]);
                            acc[i][c][3] = __fmaf_rn(p, vb.w, acc[i][c][3]);
                        }
                    }
                }
            }
        }
        // The row sums: the 16 shares of each row, in column-group order.
#pragma unroll
        for (int i = 0; i < RM; ++i) red[ty + 16 * i][tx] = l[i];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < RM; ++i) {
            const u32 r = ty + 16 * i;
            float sum = 0.0f;
            for (int x = 0; x < 16; ++x) sum = sum + red[r][x];
            if (r < rows) {
                const u32 o = (q0 + r) * (u32)ro.rs;
#pragma unroll
                for (int c = 0; c < OC; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        E::st(out + ro.base, o + 4 * tx + 64 * c + e, acc[i][c][e] / sum);
                if (tx == 0) lse[h * t64 + q0 + r] = m[i] + logf(sum);
            }
        }
    }
}

// Scores and dout.v products of one (A rows, B rows) tile pair, A = this thread's rows
// ty + 16 i, B = its columns tx + 16 j: s = a1.b1 and g = a2.b2 over the head dim.
template <int D, int AM, int BN>
__device__ void fa_dots2(const float (*a1)[D + 4], const float (*a2)[D + 4],
                         const float (*b1)[D + 4], const float (*b2)[D + 4], u32 ty, u32 tx,
                         float (*s)[BN], float (*g)[BN]) {
#pragma unroll
    for (int i = 0; i < AM; ++i)
#pragma unroll
        for (int j = 0; j < BN; ++j) s[i][j] = g[i][j] = 0.0f;
#pragma unroll 4
    for (int dd = 0; dd < D; dd += 4) {
        float4 x1[AM], x2[AM], y1[BN], y2[BN];
#pragma unroll
        for (int i = 0; i < AM; ++i) {
            x1[i] = ld4(&a1[ty + 16 * i][dd]);
            x2[i] = ld4(&a2[ty + 16 * i][dd]);
        }
#pragma unroll
        for (int j = 0; j < BN; ++j) {
            y1[j] = ld4(&b1[tx + 16 * j][dd]);
            y2[j] = ld4(&b2[tx + 16 * j][dd]);
        }
#pragma unroll
        for (int i = 0; i < AM; ++i)
#pragma unroll
            for (int j = 0; j < BN; ++j) {
                s[i][j] = fma4(x1[i], y1[j], s[i][j]);
                g[i][j] = fma4(x2[i], y2[j], g[i][j]);
            }
    }
}

// acc[i][c][e] += sum over kk < N of w[ty + 16 i][kk] * x[kk][4 tx + 64 c + e], kk ascending.
template <int D, int AM, int N>
__device__ void fa_accum(const float (*w)[N], const float (*x)[D + 4], u32 ty, u32 tx,
                         float (*acc)[D / 64][4]) {
    constexpr int OC = D / 64;
#pragma unroll 2
    for (int kk = 0; kk < N; kk += 4) {
        float4 wa[AM];
#pragma unroll
        for (int i = 0; i < AM; ++i) wa[i] = ld4(&w[ty + 16 * i][kk]);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
            for (int c = 0; c < OC; ++c) {
                const float4 xb = ld4(&x[kk + u][4 * tx + 64 * c]);
#pragma unroll
                for (int i = 0; i < AM; ++i) {
                    const float p = comp4(wa[i], u);
                    acc[i][c][0] = __fmaf_rn(p, xb.x, acc[i][c][0]);
                    acc[i][c][1] = __fmaf_rn(p, xb.y, acc[i][c][1]);
                    acc[i][c][2] = __fmaf_rn(p, xb.z, acc[i][c][2]);
                    acc[i][c][3] = __fmaf_rn(p, xb.w, acc[i][c][3]);
                }
            }
        }
    }
}

template <class E, int D, int BK, int BQ>
__device__ void fa_bwd_dkdv(u64 bh, u64 t64, u64 heads, u64 kv_heads, u64 packed, float scale, const typename E::T* q,
                            const typename E::T* k, const typename E::T* v,
                            const typename E::T* dout, const float* lse, const float* delta,
                            typename E::T* dk, typename E::T* dv) {
    constexpr int KM = BK / 16;  // key rows per thread: ty + 16 i
    constexpr int QN = BQ / 16;  // query columns per thread: tx + 16 j
    constexpr int OC = D / 64;
    constexpr int DP = D + 4;
    __shared__ __align__(16) float ks[BK][DP];
    __shared__ __align__(16) float vs[BK][DP];
    __shared__ __align__(16) float qs[BQ][DP];
    __shared__ __align__(16) float gs[BQ][DP];
    __shared__ __align__(16) float pt[BK][BQ];
    __shared__ __align__(16) float dst[BK][BQ];
    __shared__ float ls[BQ];
    __shared__ float dl[BQ];
    const u32 t = (u32)t64;
    const u32 ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const u32 tiles = (t + BK - 1) / BK;
    const u64 group = heads / kv_heads, bkv = bh / group;
    for (u64 blk = blockIdx.x; blk < bkv * tiles; blk += gridDim.x) {
        // The first key tiles are seen by the most queries: they go first.
        const u32 k0 = (u32)(blk / bkv) * BK;
        const u64 h0 = fa_group_first(blk % bkv, heads, kv_heads);
        const u32 kn = min_u32(BK, t - k0);
        const FaRows rk = fa_rows(h0, t64, D, heads, kv_heads, packed, 1),
                     rv = fa_rows(h0, t64, D, heads, kv_heads, packed, 2);
        __syncthreads();
        fa_load<E, D, BK, DP>(ks, k + rk.base, k0, kn, (u32)rk.rs);
        fa_load<E, D, BK, DP>(vs, v + rv.base, k0, kn, (u32)rv.rs);
        float dka[KM][OC][4], dva[KM][OC][4];
#pragma unroll
        for (int i = 0; i < KM; ++i)
#pragma unroll
            for (int c = 0; c < OC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) dka[i][c][e] = dva[i][c][e] = 0.0f;
        // The group's query heads in ascending order, each over its query tiles at or below
        // the diagonal: one loop over (head, tile) pairs, so that only the current head's row
        // bases are live (a nested loop over heads costs registers the d = 128 kernel needs).
        const u32 qfirst = k0 / BQ * BQ, per = (t - qfirst + BQ - 1) / BQ;
        for (u64 it = 0; it < group * per; ++it) {
            const u64 h = h0 + it / per;
            const u32 q0 = qfirst + (u32)(it % per) * BQ;
            const FaRows rq = fa_rows(h, t64, D, heads, kv_heads, packed, 0),
                         ro = fa_rows(h, t64, D, heads, kv_heads, packed, 3);
            const u32 qn = min_u32(BQ, t - q0);
            __syncthreads();  // ks/vs loaded; the previous query tile's readers are done
            fa_load<E, D, BQ, DP>(qs, q + rq.base, q0, qn, (u32)rq.rs);
            fa_load<E, D, BQ, DP>(gs, dout + ro.base, q0, qn, (u32)ro.rs);
            fa_load_rows<BQ>(ls, dl, lse + h * t64, delta + h * t64, q0, qn);
            __syncthreads();
            float s[KM][QN], g[KM][QN];
            fa_dots2<D, KM, QN>(ks, vs, qs, gs, ty, tx, s, g);
#pragma unroll
            for (int i = 0; i < KM; ++i)
#pragma unroll
                for (int j = 0; j < QN; ++j) {
                    const u32 kr = ty + 16 * i, qc = tx + 16 * j;
                    const bool vis = kr < kn && qc < qn && k0 + kr <= q0 + qc;
                    const float p = vis ? expf(s[i][j] * scale - ls[qc]) : 0.0f;
                    pt[kr][qc] = p;
                    dst[kr][qc] = vis ? p * (g[i][j] - dl[qc]) : 0.0f;
                }
            __syncthreads();
            fa_accum<D, KM, BQ>(pt, gs, ty, tx, dva);   // dv += P^T dout
            fa_accum<D, KM, BQ>(dst, qs, ty, tx, dka);  // dk += dS^T q (times scale below)
        }
#pragma unroll
        for (int i = 0; i < KM; ++i) {
            const u32 kr = ty + 16 * i;
            if (kr < kn) {
                const u32 o = (k0 + kr) * (u32)rk.rs;  // dk and dv: the same stride
#pragma unroll
                for (int c = 0; c < OC; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 j = o + 4 * tx + 64 * c + e;
                        E::st(dk + rk.base, j, dka[i][c][e] * scale);
                        E::st(dv + rv.base, j, dva[i][c][e]);
                    }
            }
        }
    }
}

template <class E, int D, int BQ, int BK>
__device__ void fa_bwd_dq(u64 bh, u64 t64, u64 heads, u64 kv_heads, u64 packed, float scale, const typename E::T* q,
                          const typename E::T* k, const typename E::T* v,
                          const typename E::T* dout, const float* lse, const float* delta,
                          typename E::T* dq) {
    constexpr int QM = BQ / 16;  // query rows per thread: ty + 16 i
    constexpr int KN = BK / 16;  // key columns per thread: tx + 16 j
    constexpr int OC = D / 64;
    constexpr int DP = D + 4;
    __shared__ __align__(16) float qs[BQ][DP];
    __shared__ __align__(16) float gs[BQ][DP];
    __shared__ __align__(16) float ks[BK][DP];
    __shared__ __align__(16) float vs[BK][DP];
    __shared__ __align__(16) float dss[BQ][BK];
    __shared__ float ls[BQ];
    __shared__ float dl[BQ];
    const u32 t = (u32)t64;
    const u32 ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    const u32 tiles = (t + BQ - 1) / BQ;
    for (u64 blk = blockIdx.x; blk < bh * tiles; blk += gridDim.x) {
        // The last query tiles see the most keys: they go first.
        const u32 q0 = (tiles - 1 - (u32)(blk / bh)) * BQ;
        const u64 h = blk % bh;
        const u32 qn = min_u32(BQ, t - q0);
        const FaRows rq = fa_rows(h, t64, D, heads, kv_heads, packed, 0), rk = fa_rows(h, t64, D, heads, kv_heads, packed, 1),
                     rv = fa_rows(h, t64, D, heads, kv_heads, packed, 2), ro = fa_rows(h, t64, D, heads, kv_heads, packed, 3);
        __syncthreads();
        fa_load<E, D, BQ, DP>(qs, q + rq.base, q0, qn, (u32)rq.rs);
        fa_load<E, D, BQ, DP>(gs, dout + ro.base, q0, qn, (u32)ro.rs);
        fa_load_rows<BQ>(ls, dl, lse + h * t64, delta + h * t64, q0, qn);
        float dqa[QM][OC][4];
#pragma unroll
        for (int i = 0; i < QM; ++i)
#pragma unroll
            for (int c = 0; c < OC; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) dqa[i][c][e] = 0.0f;
        const u32 kend = q0 + qn;
        for (u32 k0 = 0; k0 < kend; k0 += BK) {
            const u32 kn = min_u32(BK, kend - k0);
            __syncthreads();  // qs/gs loaded; the previous key tile's readers are done
            fa_load<E, D, BK, DP>(ks, k + rk.base, k0, kn, (u32)rk.rs);
            fa_load<E, D, BK, DP>(vs, v + rv.base, k0, kn, (u32)rv.rs);
            __syncthreads();
            float s[QM][KN], g[QM][KN];
            fa_dots2<D, QM, KN>(qs, gs, ks, vs, ty, tx, s, g);
#pragma unroll
            for (int i = 0; i < QM; ++i)
#pragma unroll
                for (int j = 0; j < KN; ++j) {
                    const u32 qr = ty + 16 * i, kc = tx + 16 * j;
                    const bool vis = qr < qn && kc < kn && k0 + kc <= q0 + qr;
                    const float p = vis ? expf(s[i][j] * scale - ls[qr]) : 0.0f;
                    dss[qr][kc] = vis ? p * (g[i][j] - dl[qr]) : 0.0f;
                }
            __syncthreads();
            fa_accum<D, QM, BK>(dss, ks, ty, tx, dqa);  // dq += dS k (times scale below)
        }
#pragma unroll
        for (int i = 0; i < QM; ++i) {
            const u32 qr = ty + 16 * i;
            if (qr < qn) {
                const u32 o = (q0 + qr) * (u32)rq.rs;
#pragma unroll
                for (int c = 0; c < OC; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        E::st(dq + rq.base, o + 4 * tx + 64 * c + e, dqa[i][c][e] * scale);
            }
        }
    }
}

// Entry points of the register-tiled kernels (`_d64`, `_d128`: exactly that head dim).

extern "C" __global__ void flash_fwd_f32_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                             const float* k, const float* v, float* out, float* lse) {
    fa_fwd<EltF32, 64, 64, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_bf16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                             const u16* k, const u16* v, u16* out, float* lse) {
    fa_fwd<EltBf16, 64, 64, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                             const u16* k, const u16* v, u16* out, float* lse) {
    fa_fwd<EltF16, 64, 64, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f32_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                             const float* k, const float* v, float* out, float* lse) {
    fa_fwd<EltF32, 128, 32, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_bf16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                             const u16* k, const u16* v, u16* out, float* lse) {
    fa_fwd<EltBf16, 128, 32, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_f16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                             const u16* k, const u16* v, u16* out, float* lse) {
    fa_fwd<EltF16, 128, 32, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
// The register-tiled dk/dv kernels are bounded to 3 blocks of BLOCK threads per SM (at most 80
// registers), the occupancy every other register-tiled kernel has. Unbounded, d = 64 wanted 90
// registers with the packed-layout index math (2 blocks per SM) and d = 128, with the
// grouped-query index math, 128. Bounded, ptxas -v (sm_90, NVRTC 12.9, this source) reports
// 80 registers and: d = 64, f32 / f16 no spills, bf16 12 bytes spilled; d = 128, 24 bytes
// spilled (60 bytes of spill loads). Not timed against the unbounded d = 128 kernel on a GPU
// yet (gpu-test's attention_kernel_times times d = 64). The bounds are on these declarations
// (they carry over to the definitions) so that the definitions keep the plain form the
// kernel-table test (kernels/cuda/tests/mod.rs, source_kernels) parses.
extern "C" __launch_bounds__(BLOCK, 3) __global__ void flash_bwd_dkdv_f32_d64(
    u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q, const float* k,
    const float* v, const float* dout, const float* lse, const float* delta, float* dk, float* dv);
extern "C" __launch_bounds__(BLOCK, 3) __global__ void flash_bwd_dkdv_bf16_d64(
    u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q, const u16* k,
    const u16* v, const u16* dout, const float* lse, const float* delta, u16* dk, u16* dv);
extern "C" __launch_bounds__(BLOCK, 3) __global__ void flash_bwd_dkdv_f16_d64(
    u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q, const u16* k,
    const u16* v, const u16* dout, const float* lse, const float* delta, u16* dk, u16* dv);
extern "C" __launch_bounds__(BLOCK, 3) __global__ void flash_bwd_dkdv_f32_d128(
    u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q, const float* k,
    const float* v, const float* dout, const float* lse, const float* delta, float* dk, float* dv);
extern "C" __launch_bounds__(BLOCK, 3) __global__ void flash_bwd_dkdv_bf16_d128(
    u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q, const u16* k,
    const u16* v, const u16* dout, const float* lse, const float* delta, u16* dk, u16* dv);
extern "C" __launch_bounds__(BLOCK, 3) __global__ void flash_bwd_dkdv_f16_d128(
    u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q, const u16* k,
    const u16* v, const u16* dout, const float* lse, const float* delta, u16* dk, u16* dv);
extern "C" __global__ void flash_bwd_dkdv_f32_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                                  const float* k, const float* v, const float* dout,
                                                  const float* lse, const float* delta, float* dk,
                                                  float* dv) {
    fa_bwd_dkdv<EltF32, 64, 32, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_bf16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                  const u16* k, const u16* v, const u16* dout,
                                                  const float* lse, const float* delta, u16* dk,
                                                  u16* dv) {
    fa_bwd_dkdv<EltBf16, 64, 32, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                  const u16* k, const u16* v, const u16* dout,
                                                  const float* lse, const float* delta, u16* dk,
                                                  u16* dv) {
    fa_bwd_dkdv<EltF16, 64, 32, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f32_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                                  const float* k, const float* v, const float* dout,
                                                  const float* lse, const float* delta, float* dk,
                                                  float* dv) {
    fa_bwd_dkdv<EltF32, 128, 16, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_bf16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                  const u16* k, const u16* v, const u16* dout,
                                                  const float* lse, const float* delta, u16* dk,
                                                  u16* dv) {
    fa_bwd_dkdv<EltBf16, 128, 16, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dkdv_f16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                  const u16* k, const u16* v, const u16* dout,
                                                  const float* lse, const float* delta, u16* dk,
                                                  u16* dv) {
    fa_bwd_dkdv<EltF16, 128, 16, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dk, dv);
}
extern "C" __global__ void flash_bwd_dq_f32_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                                const float* k, const float* v, const float* dout,
                                                const float* lse, const float* delta, float* dq) {
    fa_bwd_dq<EltF32, 64, 32, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_bf16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                const u16* k, const u16* v, const u16* dout,
                                                const float* lse, const float* delta, u16* dq) {
    fa_bwd_dq<EltBf16, 64, 32, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                const u16* k, const u16* v, const u16* dout,
                                                const float* lse, const float* delta, u16* dq) {
    fa_bwd_dq<EltF16, 64, 32, 32>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f32_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const float* q,
                                                const float* k, const float* v, const float* dout,
                                                const float* lse, const float* delta, float* dq) {
    fa_bwd_dq<EltF32, 128, 16, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_bf16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                const u16* k, const u16* v, const u16* dout,
                                                const float* lse, const float* delta, u16* dq) {
    fa_bwd_dq<EltBf16, 128, 16, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
extern "C" __global__ void flash_bwd_dq_f16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads, u64 packed, float scale, const u16* q,
                                                const u16* k, const u16* v, const u16* dout,
                                                const float* lse, const float* delta, u16* dq) {
    fa_bwd_dq<EltF16, 128, 16, 16>(bh, t, heads, kv_heads, packed, scale, q, k, v, dout, lse, delta, dq);
}
