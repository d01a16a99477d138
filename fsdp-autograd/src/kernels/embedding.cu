// Embedding. Forward: a gather (rows of invalid ids become NaN). Backward without atomics: a
// stable counting sort of the positions by id, then one block per table row adds its dy rows in
// position order — the CPU kernel's summation order, bit for bit.

// Operand codes in `types`: table 1, out 2 (ids are i64).
__device__ void embedding_fwd_body(u64 types, u64 total, u64 dim, u64 rows, const i64* ids,
                                   const void* table, void* out) {
    const unsigned tt = ty_of(types, 1), to = ty_of(types, 2);
    GRID_STRIDE(e, total) {
        u64 i = e / dim;
        u64 j = e - i * dim;
        i64 v = ids[i];
        st_t(out, e, to, in_range(v, rows) ? ld_t(table, (u64)v * dim + j, tt) : nan_f32());
    }
}

extern "C" __global__ void embedding_fwd(u64 total, u64 dim, u64 rows, const i64* ids,
                                         const float* table, float* out) {
    embedding_fwd_body(TYPES_F32, total, dim, rows, ids, table, out);
}

// One block. count[0..rows] must be zero on entry. Positions are processed in tiles of BLOCK, in
// order; within a tile each thread counts the equal ids before and after it. On exit
// rank[i] = #{j < i : ids[j] == ids[i]} for every valid i, and count[r] = #{i : ids[i] == r}.
extern "C" __global__ void emb_rank(u64 n, const i64* ids, u64 rows, u32* count, u32* rank) {
    __shared__ i64 tile[BLOCK];
    for (u64 base = 0; base < n; base += BLOCK) {
        u64 i = base + threadIdx.x;
        i64 id = -1;
        if (i < n && in_range(ids[i], rows)) id = ids[i];
        tile[threadIdx.x] = id;
        __syncthreads();
        u32 before = 0;
        bool last = true;
        if (id >= 0) {
            for (unsigned t = 0; t < BLOCK; ++t) {
                if (tile[t] == id) {
                    if (t < threadIdx.x) before += 1;
                    else if (t > threadIdx.x) last = false;
                }
            }
            rank[i] = count[id] + before;
        }
        // Every read of count[] for this tile happens before any update of it.
        __syncthreads();
        if (id >= 0 && last) count[id] = count[id] + before + 1;
        // Updates are visible to the whole block before the next tile reads them.
        __syncthreads();
    }
}

// One block: start[r] = count[0] + ... + count[r - 1] (exclusive prefix sum).
extern "C" __global__ void emb_scan(u64 rows, const u32* count, u32* start) {
    __shared__ u32 part[BLOCK];
    u64 chunk = (rows + BLOCK - 1) / BLOCK;
    u64 lo = (u64)threadIdx.x * chunk;
    u64 hi = lo + chunk;
    if (lo > rows) lo = rows;
    if (hi > rows) hi = rows;
    u32 s = 0;
    for (u64 r = lo; r < hi; ++r) s += count[r];
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (unsigned t = 0; t < BLOCK; ++t) {
            u32 c = part[t];
            part[t] = acc;
            acc += c;
        }
    }
    __syncthreads();
    u32 acc = part[threadIdx.x];
    for (u64 r = lo; r < hi; ++r) {
        start[r] = acc;
        acc += count[r];
    }
}

// order[start[id] + rank[i]] = i: the positions grouped by id, each group in position order.
extern "C" __global__ void emb_scatter(u64 n, u64 rows, const i64* ids, const u32* start,
                                       const u32* rank, u32* order) {
    GRID_STRIDE(i, n) {
        i64 v = ids[i];
        if (in_range(v, rows)) order[start[v] + rank[i]] = (u32)i;
    }
}

// dtable[r, :] = sum of dy[i, :] over the positions i of id r, in position order (0 if none).
// Operand codes in `types`: dy 3, dtable 4 (start, count, order are u32).
__device__ void emb_accum_body(u64 types, u64 rows, u64 dim, const u32* start, const u32* count,
                               const u32* order, const void* dy, void* dtable) {
    const unsigned tg = ty_of(types, 3), td = ty_of(types, 4);
    ROW_LOOP(r, rows) {
        u32 s = start[r];
        u32 c = count[r];
        COL_LOOP(j, dim) {
            float acc = 0.0f;
            for (u32 p = 0; p < c; ++p) acc = acc + ld_t(dy, (u64)order[s + p] * dim + j, tg);
            st_t(dtable, r * dim + j, td, acc);
        }
    }
}

extern "C" __global__ void emb_accum(u64 rows, u64 dim, const u32* start, const u32* count,
                                     const u32* order, const float* dy, float* dtable) {
    emb_accum_body(TYPES_F32, rows, dim, start, count, order, dy, dtable);
}

// Operands: ids, table, out (table and out typed).
extern "C" __global__ void embedding_fwd_t(u64 types, u64 total, u64 dim, u64 rows,
                                           const i64* ids, const void* table, void* out) {
    embedding_fwd_body(types, total, dim, rows, ids, table, out);
}

// Operands: start, count, order, dy, dtable (dy and dtable typed).
extern "C" __global__ void emb_accum_t(u64 types, u64 rows, u64 dim, const u32* start,
                                       const u32* count, const u32* order, const void* dy,
                                       void* dtable) {
    emb_accum_body(types, rows, dim, start, count, order, dy, dtable);
}
