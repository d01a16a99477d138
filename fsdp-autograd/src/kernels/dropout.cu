// Dropout with a counter-based mask (kernels/dropout.rs): y = x * m, m = scale where the
// element's Philox4x32-10 word is at least `thr`, else 0. The mask of element e of sample s at
// `site` is word e % 4 of the block with counter {e / 4, site, s, s >> 32} under the key's two
// 32-bit halves, exactly as the CPU kernel draws it (rand_philox's philox4x32_10), so both
// backends drop the same elements; the product is one f32 multiplication rounded once on store.

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

// Philox4x32-10 (Random123): round 0 with the key as given, rounds 1..9 bump the key first.
__device__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 = k0 + PHILOX_W0;
            k1 = k1 + PHILOX_W1;
        }
        u64 p0 = (u64)PHILOX_M0 * (u64)c[0];
        u64 p1 = (u64)PHILOX_M1 * (u64)c[2];
        u32 hi0 = (u32)(p0 >> 32), lo0 = (u32)p0;
        u32 hi1 = (u32)(p1 >> 32), lo1 = (u32)p1;
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// One thread per four-element block of a row: `rows` samples of `cols` elements, row r is
// sample `sample0 + r`. Codes: x, y.
extern "C" __global__ void dropout_t(u64 types, u64 rows, u64 cols, u64 key, u64 site,
                                     u64 sample0, u64 thr, float scale, const void* x, void* y) {
    const unsigned tx = ty_of(types, 0), ty = ty_of(types, 1);
    const u64 per_row = (cols + 3) / 4;
    GRID_STRIDE(i, rows * per_row) {
        const u64 r = i / per_row, b = i % per_row;
        const u64 s = sample0 + r;
        u32 c[4] = {(u32)b, (u32)site, (u32)s, (u32)(s >> 32)};
        philox4x32_10(c, (u32)key, (u32)(key >> 32));
        for (u64 w = 0; w < 4; w++) {
            const u64 j = b * 4 + w;
            if (j >= cols) break;
            const u64 at = r * cols + j;
            const float m = (u64)c[w] >= thr ? scale : 0.0f;
            st_t(y, at, ty, ld_t(x, at, tx) * m);
        }
    }
}
