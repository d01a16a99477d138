//! Out-of-place transposes of `f32` matrices for the CPU GEMM's pre-transposed `B`
//! (`matmul.rs`'s `gemm_view_at`): exact copies, so every instruction-set level gives the same
//! bits — an AVX-512 path in 16×16 register tiles and an element-by-element one.

use super::isa::CpuIsa;

/// `dst (cols×rows) = srcᵀ` for `src` stored `rows×cols` with `ld` elements between rows
/// (`ld ≥ cols`); exact copies, so every path gives the same bits.
pub(super) fn transpose(
    isa: CpuIsa,
    src: &[f32],
    rows: usize,
    cols: usize,
    ld: usize,
    dst: &mut [f32],
) {
    assert!(
        ld >= cols
            && dst.len() >= rows * cols
            && (rows == 0 || src.len() >= (rows - 1) * ld + cols),
        "transpose: {rows}×{cols} (ld {ld}) from {} into {} elements",
        src.len(),
        dst.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == CpuIsa::Avx512 && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is available (checked above); the bounds were asserted above.
        unsafe { transpose_avx512(src, rows, cols, ld, dst) };
        return;
    }
    let _ = isa;
    transpose_scalar(src, 0, rows, 0, cols, rows, ld, dst);
}

/// The part `r0..r1 × c0..c1` of [`transpose`], element by element.
#[allow(clippy::too_many_arguments)]
pub(super) fn transpose_scalar(
    src: &[f32],
    r0: usize,
    r1: usize,
    c0: usize,
    c1: usize,
    rows: usize,
    ld: usize,
    dst: &mut [f32],
) {
    for r in r0..r1 {
        for c in c0..c1 {
            dst[c * rows + r] = src[r * ld + c];
        }
    }
}

/// [`transpose`] with 16×16 tiles transposed in AVX-512 registers (the rest element by
/// element).
///
/// # Safety
/// The CPU supports AVX-512F; `ld ≥ cols`, `src` holds `(rows − 1)·ld + cols` elements and
/// `dst` at least `rows·cols` (what [`transpose`] asserts): every tile's 16 loads of 16 floats
/// (rows `r0..r0+16 ≤ rows`, columns `c0..c0+16 ≤ cols`) and 16 stores (rows `c0..c0+16` of
/// `dst`, columns `r0..r0+16`) stay inside the slices.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
// The AVX-512 intrinsics are stable since Rust 1.89, which gemm's and pulp's `x86-v4` features
// (AVX-512 kernels) need as well: building this workspace needs 1.89 now, while its declared
// `rust-version` is still 1.85 (raising it turns on newer clippy lints across the workspace;
// left to a change of its own).
#[allow(clippy::incompatible_msrv)]
unsafe fn transpose_avx512(src: &[f32], rows: usize, cols: usize, ld: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let (rt, ct) = (rows / 16 * 16, cols / 16 * 16);
    for r0 in (0..rt).step_by(16) {
        for c0 in (0..ct).step_by(16) {
            let mut v = [_mm512_setzero_ps(); 16];
            for (i, x) in v.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(src.as_ptr().add((r0 + i) * ld + c0));
            }
            // 32-bit interleave of row pairs, 64-bit interleave of pairs of those, then two
            // rounds of 128-bit lane shuffles.
            let mut t = [_mm512_setzero_ps(); 16];
            for i in 0..8 {
                t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
            }
            for g in 0..4 {
                let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
                v[4 * g] =
                    _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(c)));
                v[4 * g + 1] =
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(c)));
                v[4 * g + 2] =
                    _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b), _mm512_castps_pd(d)));
                v[4 * g + 3] =
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b), _mm512_castps_pd(d)));
            }
            for i in 0..4 {
                t[i] = _mm512_shuffle_f32x4::<0x88>(v[i], v[4 + i]);
                t[4 + i] = _mm512_shuffle_f32x4::<0xDD>(v[i], v[4 + i]);
                t[8 + i] = _mm512_shuffle_f32x4::<0x88>(v[8 + i], v[12 + i]);
                t[12 + i] = _mm512_shuffle_f32x4::<0xDD>(v[8 + i], v[12 + i]);
            }
            for i in 0..4 {
                v[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
                v[8 + i] = _mm512_shuffle_f32x4::<0xDD>(t[i], t[8 + i]);
                v[4 + i] = _mm512_shuffle_f32x4::<0x88>(t[4 + i], t[12 + i]);
                v[12 + i] = _mm512_shuffle_f32x4::<0xDD>(t[4 + i], t[12 + i]);
            }
            for (i, x) in v.iter().enumerate() {
                _mm512_storeu_ps(dst.as_mut_ptr().add((c0 + i) * rows + r0), *x);
            }
        }
    }
    transpose_scalar(src, 0, rt, ct, cols, rows, ld, dst);
    transpose_scalar(src, rt, rows, 0, cols, rows, ld, dst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::isa::forced;
    use crate::kernels::cpu::testutil::Rng;

    /// The AVX-512 transpose equals the element-by-element one, bit for bit, on whole and partial
    /// tiles and strided sources, at every level this CPU has.
    #[test]
    fn every_level_transposes_alike() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut rng = Rng::new(9);
        for &(r, c, ld) in &[
            (16, 16, 16),
            (33, 47, 50),
            (64, 32, 32),
            (5, 3, 3),
            (17, 16, 20),
        ] {
            let src = rng.vec((r - 1) * ld + c);
            let mut want = vec![0.0; r * c];
            transpose_scalar(&src, 0, r, 0, c, r, ld, &mut want);
            for level in forced::available() {
                let mut got = vec![0.0; r * c];
                transpose(level, &src, r, c, ld, &mut got);
                assert_eq!(bits(&got), bits(&want), "{r}x{c} ld {ld} at {level}");
            }
        }
    }
}
