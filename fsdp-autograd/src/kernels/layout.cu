// Strided views (element strides, row-major enumeration of the view's indices). The struct
// layout is mirrored by `ViewDesc` (#[repr(C)]) in kernels/cuda/desc.rs.

struct View {
    u64 rank;
    u64 offset;
    u64 shape[MAX_RANK];
    u64 strides[MAX_RANK];
};

__device__ u64 view_offset(const View& v, u64 e) {
    u64 off = v.offset;
    for (u64 k = v.rank; k > 0; --k) {
        u64 d = k - 1;
        u64 s = v.shape[d];
        u64 idx = e % s;
        e = e / s;
        off += idx * v.strides[d];
    }
    return off;
}

extern "C" __global__ void strided_copy_b2(u64 n, View v, const u16* src, u16* dst) {
    GRID_STRIDE(e, n) dst[e] = src[view_offset(v, e)];
}

extern "C" __global__ void strided_copy_b4(u64 n, View v, const u32* src, u32* dst) {
    GRID_STRIDE(e, n) dst[e] = src[view_offset(v, e)];
}

extern "C" __global__ void strided_copy_b8(u64 n, View v, const u64* src, u64* dst) {
    GRID_STRIDE(e, n) dst[e] = src[view_offset(v, e)];
}

// The host only launches this for views whose elements are pairwise distinct, so every
// destination element has one writer.
extern "C" __global__ void strided_add_f32(u64 n, View v, float* dst, const float* src) {
    GRID_STRIDE(e, n) {
        u64 o = view_offset(v, e);
        dst[o] = dst[o] + src[e];
    }
}
