// Rotary position embedding (kernels/rope.rs declares and launches them): one thread per rotated
// pair (j, j + d/2) of one head row. The forward reads [batch, seq, heads, d] and writes
// [batch, heads, seq, d] (the attention's head split in the same pass):
// y1 = x1 * cos - x2 * sin, y2 = x2 * cos + x1 * sin; the backward reads [batch, heads, seq, d]
// and writes [batch, seq, heads, d]: dx1 = dy1 * cos + dy2 * sin, dx2 = dy2 * cos - dy1 * sin.
// The tables are f32 [rows, d/2], row pos0 + t for position t. Each product and sum is rounded on
// its own (no FMA), as on the CPU, so f32 results are the CPU's bits. Typed: input and output f32,
// f16 or bf16 (codes 0 and 1 of `types`).

__device__ void rope_pair(u64 types, bool backward, u64 batch, u64 seq, u64 heads, u64 dim,
                          u64 pos0, const void* in, const float* cosv, const float* sinv,
                          void* out, u64 i) {
    const unsigned ti = ty_of(types, 0), to = ty_of(types, 1);
    const u64 half = dim / 2;
    const u64 j = i % half, row = i / half;
    u64 b, t, h;
    if (!backward) {  // row = (b * seq + t) * heads + h
        h = row % heads;
        t = (row / heads) % seq;
        b = row / heads / seq;
    } else {  // row = (b * heads + h) * seq + t
        t = row % seq;
        h = (row / seq) % heads;
        b = row / seq / heads;
    }
    const u64 seq_major = ((b * seq + t) * heads + h) * dim;
    const u64 head_major = ((b * heads + h) * seq + t) * dim;
    const u64 io = backward ? head_major : seq_major;
    const u64 oo = backward ? seq_major : head_major;
    const float c = cosv[(pos0 + t) * half + j], s = sinv[(pos0 + t) * half + j];
    const float a1 = ld_t(in, io + j, ti), a2 = ld_t(in, io + j + half, ti);
    if (!backward) {
        st_t(out, oo + j, to, a1 * c - a2 * s);
        st_t(out, oo + j + half, to, a2 * c + a1 * s);
    } else {
        st_t(out, oo + j, to, a1 * c + a2 * s);
        st_t(out, oo + j + half, to, a2 * c - a1 * s);
    }
}

extern "C" __global__ void rope_fwd_t(u64 types, u64 batch, u64 seq, u64 heads, u64 dim, u64 pos0,
                                      const void* x, const float* cosv, const float* sinv,
                                      void* y) {
    const u64 n = batch * seq * heads * (dim / 2);
    GRID_STRIDE(i, n) rope_pair(types, false, batch, seq, heads, dim, pos0, x, cosv, sinv, y, i);
}

extern "C" __global__ void rope_bwd_t(u64 types, u64 batch, u64 seq, u64 heads, u64 dim, u64 pos0,
                                      const void* dy, const float* cosv, const float* sinv,
                                      void* dx) {
    const u64 n = batch * seq * heads * (dim / 2);
    GRID_STRIDE(i, n) rope_pair(types, true, batch, seq, heads, dim, pos0, dy, cosv, sinv, dx, i);
}
