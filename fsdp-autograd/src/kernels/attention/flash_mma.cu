// ---------------------------------------------------------------------------------------------
// Tensor-core flash attention forward (helper "attn", issue #35): the contract of flash.cu's
// forward (layouts and fa_rows, grouped-query heads, scale, causal mask, out and lse) for bf16 /
// f16 operands and head dims 64 and 128, with both matrix products (S = Q K^T and O += P V) on
// the tensor cores: `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` (f32 accumulation).
// The host selects these kernels only on devices of compute capability 8.0+ with the program
// compiled for compute_80 (kernels/program.rs), and only for half-precision operands; f32 keeps
// flash.cu's CUDA-core kernels (exact against the CPU to f32 rounding).
//
// Tiling (FlashAttention-2): one block of BLOCK threads (8 warps) per tile of BR = 128 queries of
// one query head; warp w owns queries q0 + 16 w .. q0 + 16 w + 15 and keeps their Q fragments in
// registers (loaded once from global memory). Tiles of BC = 64 keys stream through shared
// memory: K row-major (ks[key][col]), V transposed (vt[col][key]), rows padded by 8 halves so a
// quad's 32-bit fragment loads hit distinct banks. Per key tile each warp computes its 16 x 64
// scores (8 n-tiles x D/16 k-steps of mma), masks and scales them, updates the running maximum
// m and the per-thread partial sums l (online softmax, rescaled by exp(m_old - m_new)), rounds
// P to the operand type and multiplies it into its 16 x D output accumulator (the scores' C
// fragments of two adjacent n-tiles are exactly the A fragment of one k-step: no shuffles).
// At the end l is summed over the quad (lanes 4g .. 4g + 3, xor-shuffles: the same sum in every
// lane), out = acc / l is rounded once to the operand type, lse = m + log(l).
//
// Fragment layout of m16n8k16 (g = lane / 4, c = lane % 4; a 32-bit register holds two halves,
// the lower index in the low 16 bits): A (16 x 16, row-major) a0 = A[g][2c..2c+1],
// a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]; B (16 x 8, k x n) b0 = B[2c..2c+1][g],
// b1 = B[2c+8..2c+9][g]; C (16 x 8, f32) c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1].
//
// Emulated reference path (FA_MMA_EMULATED: the host emulator, and NVRTC targets below sm_80,
// where the host never selects these kernels): the same kernel, tiling and fragment registers,
// with the mma replaced by fa_mma_ref, which exchanges the 32 lanes' fragments through shared
// memory and computes each C element from them in f32 (products of two halves are exact in f32;
// sums in ascending k), and the quad shuffle by a shared-memory exchange. Both need every thread
// of the block to call them together, which the kernel guarantees (the block's warps run the
// same loops; no warp skips a tile). The emulator thus checks the fragment-index math against
// the CPU kernels; the hardware's own summation order inside an mma is not specified, so GPU
// results differ from the emulated ones by f32 rounding of the 16-term sums.
// Every output element is written by one thread; no atomics.

#if defined(FSDP_HOST_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
#define FA_MMA_EMULATED 1
#endif

// Two adjacent halves (p[0] low, p[1] high) as one 32-bit word; p is 4-byte aligned.
__device__ u32 fa_ld2(const u16* p) {
#ifdef FSDP_HOST_EMULATION
    return (u32)p[0] | ((u32)p[1] << 16);
#else
    return *(const u32*)p;
#endif
}

__device__ void fa_st2(u16* p, u32 w) {
#ifdef FSDP_HOST_EMULATION
    p[0] = (u16)(w & 0xffffu);
    p[1] = (u16)(w >> 16);
#else
    *(u32*)p = w;
#endif
}

// x0, x1 rounded to E and packed (x0 low).
template <class E>
__device__ u32 fa_pack(float x0, float x1) {
    u16 h[2];
    E::st(h, 0, x0);
    E::st(h, 1, x1);
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Half `hi` (0 low, 1 high) of a packed word, widened to f32 (exact).
template <class E>
__device__ float fa_half(u32 w, u32 hi) {
    const u16 h = (u16)(hi ? w >> 16 : w & 0xffffu);
    return E::ld(&h, 0);
}

// The value of lane (lane ^ m) of this thread's warp.
__device__ float fa_xor(float x, u32 m) {
#ifdef FA_MMA_EMULATED
    __shared__ float xs[BLOCK];
    __syncthreads();  // earlier readers of xs are done
    xs[threadIdx.x] = x;
    __syncthreads();
    return xs[threadIdx.x ^ m];
#else
    return __shfl_xor_sync(0xffffffffu, x, (int)m);
#endif
}

#ifdef FA_MMA_EMULATED
// c += A B for one warp's m16n8k16 fragments (layout above), in f32.
template <class E>
__device__ void fa_mma_ref(float c[4], const u32 a[4], const u32 b[2]) {
    __shared__ u32 fa[BLOCK][4];
    __shared__ u32 fb[BLOCK][2];
    __syncthreads();  // earlier readers of fa / fb are done
    for (int i = 0; i < 4; ++i) fa[threadIdx.x][i] = a[i];
    fb[threadIdx.x][0] = b[0];
    fb[threadIdx.x][1] = b[1];
    __syncthreads();
    const u32 w0 = threadIdx.x & ~31u, lane = threadIdx.x & 31u, g = lane >> 2, cq = lane & 3u;
    float r[4];
    for (u32 i = 0; i < 4; ++i) {
        const u32 row = g + (i >= 2 ? 8u : 0u), col = 2 * cq + (i & 1u);
        float acc = c[i];
        for (u32 kk = 0; kk < 16; ++kk) {
            const u32 at = w0 + (row % 8) * 4 + (kk % 8) / 2;  // lane holding A[row][kk]
            const u32 ar = (row >= 8 ? 1u : 0u) + (kk >= 8 ? 2u : 0u);
            const u32 bt = w0 + col * 4 + (kk % 8) / 2;  // lane holding B[kk][col]
            const u32 br = kk >= 8 ? 1u : 0u;
            const float x = fa_half<E>(fa[at][ar], kk & 1u), y = fa_half<E>(fb[bt][br], kk & 1u);
            acc = acc + x * y;  // x * y is exact in f32
        }
        r[i] = acc;
    }
    for (int i = 0; i < 4; ++i) c[i] = r[i];
}
#endif

__device__ void fa_mma(EltBf16, float c[4], const u32 a[4], const u32 b[2]) {
#ifdef FA_MMA_EMULATED
    fa_mma_ref<EltBf16>(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ void fa_mma(EltF16, float c[4], const u32 a[4], const u32 b[2]) {
#ifdef FA_MMA_EMULATED
    fa_mma_ref<EltF16>(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <class E, int D>
__device__ void fa_mma_fwd(u64 bh, u64 t, u64 heads, u64 kv_heads, u64 packed, float scale,
                           const u16* q, const u16* k, const u16* v, u16* out, float* lse) {
    constexpr int BR = (BLOCK / 32) * 16;  // queries per block: 16 per warp
    constexpr int BC = 64;                 // keys per tile
    constexpr int KS = D / 16;             // k-steps of Q K^T
    constexpr int NT = BC / 8;             // score n-tiles per key tile
    constexpr int OT = D / 8;              // output n-tiles
    __shared__ __align__(16) u16 ks[BC][D + 8];
    __shared__ __align__(16) u16 vt[D][BC + 8];
    const E ty{};
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, cq = lane % 4;
    const u64 tiles = (t + BR - 1) / BR;
    for (u64 blk = blockIdx.x; blk < bh * tiles; blk += gridDim.x) {
        const u64 h = blk / tiles, q0 = (blk % tiles) * BR;
        const FaRows rq = fa_rows(h, t, D, heads, kv_heads, packed, 0),
                     rk = fa_rows(h, t, D, heads, kv_heads, packed, 1),
                     rv = fa_rows(h, t, D, heads, kv_heads, packed, 2),
                     ro = fa_rows(h, t, D, heads, kv_heads, packed, 3);
        const u64 row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
        u32 qf[KS][4];
#pragma unroll
        for (int s = 0; s < KS; ++s) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u64 r = row[i & 1], col = (u64)s * 16 + 2 * cq + (i & 2 ? 8 : 0);
                qf[s][i] = r < t ? fa_ld2(q + rq.base + r * rq.rs + col) : 0u;
            }
        }
        float o[OT][4];
#pragma unroll
        for (int n = 0; n < OT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        float m[2] = {neg_inf_f32(), neg_inf_f32()}, l[2] = {0.0f, 0.0f};
        const u64 kend = min_u64(t, q0 + BR);  // no query of the tile sees a key at or past kend
        for (u64 k0 = 0; k0 < kend; k0 += BC) {
            __syncthreads();  // the previous tile's readers of ks / vt are done
            for (u32 i = threadIdx.x; i < BC * D / 2; i += BLOCK) {
                const u32 r = i / (D / 2), c = 2 * (i % (D / 2));
                const bool in = k0 + r < t;
                fa_st2(&ks[r][c], in ? fa_ld2(k + rk.base + (k0 + r) * rk.rs + c) : 0u);
                const u32 w = in ? fa_ld2(v + rv.base + (k0 + r) * rv.rs + c) : 0u;
                vt[c][r] = (u16)(w & 0xffffu);
                vt[c + 1][r] = (u16)(w >> 16);
            }
            __syncthreads();
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    const u32 b[2] = {fa_ld2(&ks[n * 8 + g][kk * 16 + 2 * cq]),
                                      fa_ld2(&ks[n * 8 + g][kk * 16 + 2 * cq + 8])};
                    fa_mma(ty, s[n], qf[kk], b);
                }
            }
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const u64 key = k0 + n * 8 + 2 * cq + (i & 1), r = row[i >> 1];
                    s[n][i] = key <= r && key < t ? s[n][i] * scale : neg_inf_f32();
                    mx[i >> 1] = fmaxf(mx[i >> 1], s[n][i]);
                }
            }
            float shift[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                mx[hh] = fmaxf(mx[hh], fa_xor(mx[hh], 1));
                mx[hh] = fmaxf(mx[hh], fa_xor(mx[hh], 2));
                // A row with no visible key yet keeps m = -inf; shifting by 0 keeps its p at 0.
                shift[hh] = mx[hh] == neg_inf_f32() ? 0.0f : mx[hh];
                const float alpha = expf(m[hh] - shift[hh]);
                l[hh] = l[hh] * alpha;
#pragma unroll
                for (int n = 0; n < OT; ++n) {
                    o[n][2 * hh] = o[n][2 * hh] * alpha;
                    o[n][2 * hh + 1] = o[n][2 * hh + 1] * alpha;
                }
                m[hh] = mx[hh];
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    s[n][i] = expf(s[n][i] - shift[i >> 1]);  // masked: exp(-inf) = 0
                    l[i >> 1] = l[i >> 1] + s[n][i];
                }
            }
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                const u32 a[4] = {fa_pack<E>(s[2 * kk][0], s[2 * kk][1]),
                                  fa_pack<E>(s[2 * kk][2], s[2 * kk][3]),
                                  fa_pack<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  fa_pack<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int n = 0; n < OT; ++n) {
                    const u32 b[2] = {fa_ld2(&vt[n * 8 + g][kk * 16 + 2 * cq]),
                                      fa_ld2(&vt[n * 8 + g][kk * 16 + 2 * cq + 8])};
                    fa_mma(ty, o[n], a, b);
                }
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            // (a + b) + (c + d) in every lane of the quad: the same total everywhere.
            l[hh] = l[hh] + fa_xor(l[hh], 1);
            l[hh] = l[hh] + fa_xor(l[hh], 2);
            const u64 r = row[hh];
            if (r < t) {
#pragma unroll
                for (int n = 0; n < OT; ++n) {
                    const u64 c = (u64)n * 8 + 2 * cq;
                    fa_st2(out + ro.base + r * ro.rs + c,
                           fa_pack<E>(o[n][2 * hh] / l[hh], o[n][2 * hh + 1] / l[hh]));
                }
                if (cq == 0) lse[h * t + r] = m[hh] + logf(l[hh]);
            }
        }
    }
}

// Entry points (the parameters of flash.cu's forward; d is fixed by the kernel and ignored).
extern "C" __global__ void flash_fwd_mma_bf16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads,
                                                  u64 packed, float scale, const u16* q,
                                                  const u16* k, const u16* v, u16* out,
                                                  float* lse) {
    fa_mma_fwd<EltBf16, 64>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_mma_f16_d64(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads,
                                                 u64 packed, float scale, const u16* q,
                                                 const u16* k, const u16* v, u16* out,
                                                 float* lse) {
    fa_mma_fwd<EltF16, 64>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_mma_bf16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads,
                                                   u64 packed, float scale, const u16* q,
                                                   const u16* k, const u16* v, u16* out,
                                                   float* lse) {
    fa_mma_fwd<EltBf16, 128>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
extern "C" __global__ void flash_fwd_mma_f16_d128(u64 bh, u64 t, u64 d, u64 heads, u64 kv_heads,
                                                  u64 packed, float scale, const u16* q,
                                                  const u16* k, const u16* v, u16* out,
                                                  float* lse) {
    fa_mma_fwd<EltF16, 128>(bh, t, heads, kv_heads, packed, scale, q, k, v, out, lse);
}
