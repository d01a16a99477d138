//! Host kernels of the thread backend: copies and rank-ordered reductions over device buffers,
//! read and written only through `fsdp-alloc`'s guards.

use fsdp_alloc::{AllocError, BufferRef, DType};
use half::{bf16, f16};

use crate::types::ReduceOp;

/// Elements per block of a reduction (the unit the buffers' guards are taken for).
const BLOCK: usize = 64 * 1024;

/// Copies all bytes of `src` into `dst` (same length).
pub(crate) fn copy(src: &BufferRef, dst: &BufferRef) -> Result<(), AllocError> {
    if src.is_empty() {
        return Ok(());
    }
    let s = src.read::<u8>()?;
    let mut d = dst.write::<u8>()?;
    if d.len() != s.len() {
        return Err(AllocError::BadAccess(format!(
            "copy of {} bytes into a {}-byte range",
            s.len(),
            d.len()
        )));
    }
    d.copy_from_slice(&s);
    Ok(())
}

/// Bytes per block of [`copy_to_all`]: the source block stays in L2 while it is written to every
/// destination (512 KiB; the development machine has 4 MiB of L2 per core).
const COPY_BLOCK: usize = 512 * 1024;

/// Copies `src` into every range of `dsts` (each as long as `src`), block by block, so each
/// source byte is read from memory once however many destinations there are. A destination that
/// *is* `src` (same location) is skipped.
pub(crate) fn copy_to_all(src: &BufferRef, dsts: &[BufferRef]) -> Result<(), AllocError> {
    let len = src.len();
    if let Some(d) = dsts.iter().find(|d| d.len() != len) {
        return Err(AllocError::BadAccess(format!(
            "copy of {len} bytes into a {}-byte range",
            d.len()
        )));
    }
    let targets: Vec<&BufferRef> = dsts
        .iter()
        .filter(|d| d.location() != src.location())
        .collect();
    let mut start = 0;
    while start < len {
        let n = COPY_BLOCK.min(len - start);
        let sub = src.slice(start, n)?;
        let s = sub.read::<u8>()?;
        for d in &targets {
            let dsub = d.slice(start, n)?;
            dsub.write::<u8>()?.copy_from_slice(&s);
        }
        start += n;
    }
    Ok(())
}

/// Bytes from which [`copy_streaming`] writes around the caches.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) const STREAMING_MIN: usize = 8 << 20;

/// Copies `src` into `dst` (same length). On x86-64 the bulk is written with non-temporal
/// (streaming) stores, which skip the read-for-ownership of every destination cache line and do
/// not evict the caches: for a large output that nobody reads right away (an all-gather's
/// 64 MiB) this is up to ~1.6× faster than `memcpy` on the development machine. Elsewhere it is
/// a plain copy. The bytes written are the same either way.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = dst.len();
        // Up to the first 16-byte-aligned destination address with ordinary stores.
        let head = dst.as_ptr().align_offset(16).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (n - head) / 64 * 64;
        let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
        let mut i = 0;
        while i < body {
            // SAFETY: SSE2 is part of the x86-64 baseline. `i + 64 ≤ body ≤ n − head`, so the
            // four 16-byte loads stay inside `src[head..]` (unaligned loads) and the four stores
            // inside `dst[head..]`, whose pointer is 16-byte aligned (`head`), as
            // `_mm_stream_si128` requires; `dst` is a unique borrow, so nothing aliases it.
            unsafe {
                let a = _mm_loadu_si128(s.add(i) as *const __m128i);
                let b = _mm_loadu_si128(s.add(i + 16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(i + 32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(i + 48) as *const __m128i);
                _mm_stream_si128(d.add(i) as *mut __m128i, a);
                _mm_stream_si128(d.add(i + 16) as *mut __m128i, b);
                _mm_stream_si128(d.add(i + 32) as *mut __m128i, c);
                _mm_stream_si128(d.add(i + 48) as *mut __m128i, e);
            }
            i += 64;
        }
        // SAFETY: a store fence (SSE baseline): the streaming stores above become globally
        // visible before any later store, like ordinary ones.
        unsafe { _mm_sfence() };
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// An accumulator for elements of `T`.
pub(crate) trait Accum<T>: Copy {
    fn load(x: T) -> Self;
    fn add(self, x: T) -> Self;
    fn max(self, x: T) -> Self;
    fn min(self, x: T) -> Self;
    fn div(self, n: usize) -> Self;
    fn store(self) -> T;
}

impl Accum<f32> for f32 {
    #[inline(always)]
    fn load(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn add(self, x: f32) -> f32 {
        self + x
    }
    #[inline(always)]
    fn max(self, x: f32) -> f32 {
        f32::max(self, x)
    }
    #[inline(always)]
    fn min(self, x: f32) -> f32 {
        f32::min(self, x)
    }
    #[inline(always)]
    fn div(self, n: usize) -> f32 {
        self / n as f32
    }
    #[inline(always)]
    fn store(self) -> f32 {
        self
    }
}

macro_rules! half_accums {
    ($t:ty) => {
        /// Widened: accumulate in f32, round once at the end.
        impl Accum<$t> for f32 {
            #[inline(always)]
            fn load(x: $t) -> f32 {
                x.to_f32()
            }
            #[inline(always)]
            fn add(self, x: $t) -> f32 {
                self + x.to_f32()
            }
            #[inline(always)]
            fn max(self, x: $t) -> f32 {
                f32::max(self, x.to_f32())
            }
            #[inline(always)]
            fn min(self, x: $t) -> f32 {
                f32::min(self, x.to_f32())
            }
            #[inline(always)]
            fn div(self, n: usize) -> f32 {
                self / n as f32
            }
            #[inline(always)]
            fn store(self) -> $t {
                <$t>::from_f32(self)
            }
        }
        /// Own precision: round to the half type after every step.
        impl Accum<$t> for $t {
            #[inline(always)]
            fn load(x: $t) -> $t {
                x
            }
            #[inline(always)]
            fn add(self, x: $t) -> $t {
                <$t>::from_f32(self.to_f32() + x.to_f32())
            }
            #[inline(always)]
            fn max(self, x: $t) -> $t {
                <$t>::from_f32(f32::max(self.to_f32(), x.to_f32()))
            }
            #[inline(always)]
            fn min(self, x: $t) -> $t {
                <$t>::from_f32(f32::min(self.to_f32(), x.to_f32()))
            }
            #[inline(always)]
            fn div(self, n: usize) -> $t {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
            #[inline(always)]
            fn store(self) -> $t {
                self
            }
        }
    };
}
half_accums!(f16);
half_accums!(bf16);

macro_rules! int_accum {
    ($t:ty) => {
        impl Accum<$t> for $t {
            #[inline(always)]
            fn load(x: $t) -> $t {
                x
            }
            #[inline(always)]
            fn add(self, x: $t) -> $t {
                self.wrapping_add(x)
            }
            #[inline(always)]
            fn max(self, x: $t) -> $t {
                Ord::max(self, x)
            }
            #[inline(always)]
            fn min(self, x: $t) -> $t {
                Ord::min(self, x)
            }
            #[inline(always)]
            fn div(self, n: usize) -> $t {
                // n ≥ 1 (a group size); a group larger than the type's range divides to 0.
                <$t>::try_from(n).map_or(0, |n| self.wrapping_div(n))
            }
            #[inline(always)]
            fn store(self) -> $t {
                self
            }
        }
    };
}
int_accum!(i32);
int_accum!(i64);

/// Elements per accumulator tile: small enough to stay in L1 (4 KiB of f32).
const TILE: usize = 1024;

/// Folds `views` (one slice per rank, rank order) over `base..base + acc.len()` into `acc`:
/// `acc[i] = c(…c(c(load(v0[i]), v1[i]), v2[i])…)`. Up to four ranks are folded per pass over the
/// tile, in registers, so each element costs about one load per rank; the association is always
/// strictly left to right (rank order), whatever the grouping.
#[inline(always)]
fn fold_tile<T: Copy, A: Accum<T>, C: Fn(A, T) -> A + Copy>(
    views: &[&[T]],
    base: usize,
    acc: &mut [A],
    c: C,
) {
    let n = acc.len();
    let v = |k: usize| &views[k][base..base + n];
    match views.len() {
        0 => return,
        1 => {
            let a = v(0);
            for i in 0..n {
                acc[i] = A::load(a[i]);
            }
        }
        2 => {
            let (a, b) = (v(0), v(1));
            for i in 0..n {
                acc[i] = c(A::load(a[i]), b[i]);
            }
        }
        3 => {
            let (a, b, d) = (v(0), v(1), v(2));
            for i in 0..n {
                acc[i] = c(c(A::load(a[i]), b[i]), d[i]);
            }
        }
        _ => {
            let (a, b, d, e) = (v(0), v(1), v(2), v(3));
            for i in 0..n {
                acc[i] = c(c(c(A::load(a[i]), b[i]), d[i]), e[i]);
            }
        }
    }
    let mut k = views.len().min(4);
    while k < views.len() {
        match views.len() - k {
            1 => {
                let a = v(k);
                for i in 0..n {
                    acc[i] = c(acc[i], a[i]);
                }
                k += 1;
            }
            2 => {
                let (a, b) = (v(k), v(k + 1));
                for i in 0..n {
                    acc[i] = c(c(acc[i], a[i]), b[i]);
                }
                k += 2;
            }
            3 => {
                let (a, b, d) = (v(k), v(k + 1), v(k + 2));
                for i in 0..n {
                    acc[i] = c(c(c(acc[i], a[i]), b[i]), d[i]);
                }
                k += 3;
            }
            _ => {
                let (a, b, d, e) = (v(k), v(k + 1), v(k + 2), v(k + 3));
                for i in 0..n {
                    acc[i] = c(c(c(c(acc[i], a[i]), b[i]), d[i]), e[i]);
                }
                k += 4;
            }
        }
    }
}

/// Reduces `views` elementwise into `out` (all the same length) with `op`, tile by tile.
#[inline(always)]
fn fold_into<T: Copy, A: Accum<T>>(views: &[&[T]], out: &mut [T], op: ReduceOp, world: usize) {
    if out.is_empty() || views.is_empty() {
        return;
    }
    // Any initial value: the fold overwrites every element before reading it.
    let mut tile: Vec<A> = vec![A::load(views[0][0]); TILE.min(out.len())];
    let mut base = 0;
    while base < out.len() {
        let n = TILE.min(out.len() - base);
        let acc = &mut tile[..n];
        match op {
            ReduceOp::Sum | ReduceOp::Avg => fold_tile(views, base, acc, |a: A, x| a.add(x)),
            ReduceOp::Max => fold_tile(views, base, acc, |a: A, x| a.max(x)),
            ReduceOp::Min => fold_tile(views, base, acc, |a: A, x| a.min(x)),
        }
        let o = &mut out[base..base + n];
        if op == ReduceOp::Avg {
            o.iter_mut()
                .zip(acc.iter())
                .for_each(|(d, &a)| *d = a.div(world).store());
        } else {
            o.iter_mut()
                .zip(acc.iter())
                .for_each(|(d, &a)| *d = a.store());
        }
        base += n;
    }
}

/// `dst[i] = op(srcs[0][i], srcs[1][i], …)` folded strictly in the order of `srcs` (rank order),
/// accumulating in `A`. `dst` may overlap one of `srcs` (in-place forms): then each block is
/// computed into a scratch block before it is written.
fn reduce_typed<T: bytemuck::Pod, A: Accum<T>>(
    srcs: &[BufferRef],
    dst: &BufferRef,
    op: ReduceOp,
    world: usize,
) -> Result<(), AllocError> {
    let sz = std::mem::size_of::<T>();
    let count = dst.len() / sz;
    let aliased = srcs.iter().any(|s| s.overlaps(dst));
    let mut scratch: Vec<T> = Vec::new();
    let mut start = 0;
    while start < count {
        let n = BLOCK.min(count - start);
        let range = |b: &BufferRef| b.slice(start * sz, n * sz);
        let subs = srcs.iter().map(range).collect::<Result<Vec<_>, _>>()?;
        let guards = subs
            .iter()
            .map(|s| s.read::<T>())
            .collect::<Result<Vec<_>, _>>()?;
        let views: Vec<&[T]> = guards.iter().map(|g| &**g).collect();
        let out = range(dst)?;
        if aliased {
            scratch.clear();
            scratch.resize(n, T::zeroed());
            fold_into::<T, A>(&views, &mut scratch, op, world);
            drop(views);
            drop(guards);
            out.write::<T>()?.copy_from_slice(&scratch);
        } else {
            fold_into::<T, A>(&views, &mut out.write::<T>()?, op, world);
        }
        start += n;
    }
    Ok(())
}

fn reduce_from_bytes<T: bytemuck::Pod, A: Accum<T>>(
    srcs: &[&[u8]],
    dst: &BufferRef,
    op: ReduceOp,
    world: usize,
) -> Result<(), AllocError> {
    if let Some(s) = srcs.iter().find(|s| s.len() != dst.len()) {
        return Err(AllocError::BadAccess(format!(
            "reduction of a {}-byte source into a {}-byte range",
            s.len(),
            dst.len()
        )));
    }
    let views = srcs
        .iter()
        .map(|s| {
            bytemuck::try_cast_slice::<u8, T>(s)
                .map_err(|e| AllocError::BadAccess(format!("reduction source: {e}")))
        })
        .collect::<Result<Vec<&[T]>, _>>()?;
    fold_into::<T, A>(&views, &mut dst.write::<T>()?, op, world);
    Ok(())
}

/// The per-rank sources of a reduction, in rank order, each as long as the destination. Both
/// kinds fold with the same kernel, so to the same bits.
#[derive(Clone, Copy)]
pub(crate) enum Sources<'a> {
    /// Ranges of buffers (the thread backend reads its peers' buffers).
    Buffers(&'a [BufferRef]),
    /// Raw bytes aligned for the dtype (the MPI backend reads staging slots).
    Bytes(&'a [&'a [u8]]),
}

impl<'a> From<&'a [BufferRef]> for Sources<'a> {
    fn from(b: &'a [BufferRef]) -> Self {
        Sources::Buffers(b)
    }
}

impl<'a> From<&'a [&'a [u8]]> for Sources<'a> {
    fn from(b: &'a [&'a [u8]]) -> Self {
        Sources::Bytes(b)
    }
}

impl Sources<'_> {
    fn fold<T: bytemuck::Pod, A: Accum<T>>(
        self,
        dst: &BufferRef,
        op: ReduceOp,
        world: usize,
    ) -> Result<(), AllocError> {
        match self {
            Sources::Buffers(b) => reduce_typed::<T, A>(b, dst, op, world),
            Sources::Bytes(b) => reduce_from_bytes::<T, A>(b, dst, op, world),
        }
    }
}

/// Reduces `srcs` (one per rank, in rank order, each as long as `dst`) into `dst`, folding in
/// rank order. The (dtype, accum) pair must have passed [`crate::desc::check_reduce`].
pub(crate) fn reduce<'a>(
    dtype: DType,
    accum: DType,
    srcs: impl Into<Sources<'a>>,
    dst: &BufferRef,
    op: ReduceOp,
    world: usize,
) -> Result<(), AllocError> {
    if dst.is_empty() {
        return Ok(());
    }
    let srcs = srcs.into();
    use DType::*;
    match (dtype, accum) {
        (F32, F32) => srcs.fold::<f32, f32>(dst, op, world),
        (F16, F32) => srcs.fold::<f16, f32>(dst, op, world),
        (F16, F16) => srcs.fold::<f16, f16>(dst, op, world),
        (BF16, F32) => srcs.fold::<bf16, f32>(dst, op, world),
        (BF16, BF16) => srcs.fold::<bf16, bf16>(dst, op, world),
        (I32, I32) => srcs.fold::<i32, i32>(dst, op, world),
        (I64, I64) => srcs.fold::<i64, i64>(dst, op, world),
        _ => Err(AllocError::BadAccess(format!(
            "no reduction kernel for {dtype} buffers with {accum} accumulation"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Streaming stores write exactly what `memcpy` would, whatever the alignment of either
        /// side and the length (head, 64-byte body and tail of every size), and nothing outside.
        #[test]
        fn copy_streaming_equals_memcpy(
            src_off in 0usize..64,
            dst_off in 0usize..64,
            len in 0usize..1000,
            seed in any::<u8>(),
        ) {
            let src: Vec<u8> = (0..src_off + len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect();
            let mut dst = vec![0xA5u8; dst_off + len + 64];
            let mut want = dst.clone();
            want[dst_off..dst_off + len].copy_from_slice(&src[src_off..]);
            copy_streaming(&mut dst[dst_off..dst_off + len], &src[src_off..]);
            prop_assert_eq!(dst, want);
        }
    }

    #[test]
    fn copy_streaming_copies_a_large_buffer() {
        let src: Vec<u8> = (0..(3 << 20) + 13).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        copy_streaming(&mut dst[..], &src);
        assert_eq!(dst, src);
    }
}
