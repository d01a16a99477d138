//! Matrix products through the `gemm` crate, at the CPU kernels' instruction-set level
//! ([`super::isa`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use gemm::Parallelism;

use super::isa::{gemm_level, CpuIsa};
use super::transpose::transpose;
use crate::kernels::check;
use crate::kernels::KernelError;

/// `0` = every thread of rayon's global pool (gemm's `Parallelism::Rayon(0)`).
static MATMUL_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets how many threads every later [`matmul`]/[`bmm`] call (process-wide) asks `gemm` for.
///
/// - `0` (the default): `gemm::Parallelism::Rayon(0)`, i.e. all threads of rayon's global pool
///   (one per core unless `RAYON_NUM_THREADS` says otherwise);
/// - `1`: `gemm::Parallelism::None` (run on the calling thread);
/// - `n ≥ 2`: `gemm::Parallelism::Rayon(n)`.
///
/// The setting changes speed only, never results: the tests of this module check that `gemm`
/// 0.19 gives bit-identical products under `None`, `Rayon(0)`, `Rayon(2)` and `Rayon(3)`
/// (it splits work over rows and columns of the output, never over the shared dimension).
///
/// ```
/// use fsdp_autograd::kernels::cpu::{matmul_parallelism, matmul_threads, set_matmul_threads};
/// let before = matmul_threads();
/// set_matmul_threads(1);
/// assert!(matches!(matmul_parallelism(), gemm::Parallelism::None));
/// set_matmul_threads(before);
/// ```
pub fn set_matmul_threads(threads: usize) {
    MATMUL_THREADS.store(threads, Ordering::Relaxed);
}

/// The value last given to [`set_matmul_threads`] (`0` = rayon's whole pool, the default).
pub fn matmul_threads() -> usize {
    MATMUL_THREADS.load(Ordering::Relaxed)
}

/// The `gemm::Parallelism` that [`matmul`] and [`bmm`] currently pass to `gemm` (see
/// [`set_matmul_threads`]). A benchmark calling `gemm::gemm` directly should pass this value to
/// compare like with like.
pub fn matmul_parallelism() -> Parallelism {
    match matmul_threads() {
        1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// One operand of [`gemm_view`]: `op(M)` is `rows × cols`; `M` is stored row-major with `ld`
/// elements between consecutive stored rows (`ld` ≥ the stored row width), as `rows × cols`, or
/// as `cols × rows` when `trans` (then `op(M) = Mᵀ`). With `ld` larger than the row width the
/// operand is a block of a bigger matrix (blocked attention multiplies such blocks).
#[derive(Debug, Clone, Copy)]
pub(crate) struct View {
    /// Rows of `op(M)`.
    pub rows: usize,
    /// Columns of `op(M)`.
    pub cols: usize,
    /// Elements between consecutive stored rows.
    pub ld: usize,
    /// Stored transposed.
    pub trans: bool,
}

impl View {
    /// A contiguous (`ld` = stored row width) operand whose `op(M)` is `rows × cols`.
    pub(crate) fn dense(rows: usize, cols: usize, trans: bool) -> View {
        let ld = if trans { rows } else { cols };
        View {
            rows,
            cols,
            ld,
            trans,
        }
    }

    /// `(stored rows, stored row width)`.
    fn stored(self) -> (usize, usize) {
        if self.trans {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }

    /// Checks `ld` and that `len` elements hold the operand; returns `(row stride, column
    /// stride)` of `op(M)`.
    fn strides(
        self,
        op: &'static str,
        arg: &'static str,
        len: usize,
    ) -> Result<(isize, isize), KernelError> {
        let (srows, width) = self.stored();
        if self.ld < width {
            return Err(KernelError::InvalidShape {
                op,
                reason: format!("{arg}: leading dimension {} < row width {width}", self.ld),
            });
        }
        let need = if srows == 0 || width == 0 {
            0
        } else {
            check::mul(op, srows - 1, self.ld)?
                .checked_add(width)
                .ok_or_else(|| KernelError::InvalidShape {
                    op,
                    reason: format!("{arg}: size overflows usize"),
                })?
        };
        if len < need {
            return Err(KernelError::LengthMismatch {
                op,
                arg,
                expected: need,
                actual: len,
                shape: format!("{self:?}"),
            });
        }
        let ld = check::stride(op, self.ld)?;
        Ok(if self.trans { (1, ld) } else { (ld, 1) })
    }
}

/// `C = scale · op(A) · op(B) (+ C if accumulate)` on strided operands: `op(A)` is `m×k`
/// (`a_view`), `op(B)` is `k×n` (`b_view`), `C` is `m×n` row-major with `ldc` elements between
/// rows. Every operand is bounds-checked against its slice before `gemm` runs. The core of
/// [`gemm_checked`] and of blocked attention.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn gemm_view(
    op: &'static str,
    a: &[f32],
    a_view: View,
    b: &[f32],
    b_view: View,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    scale: f32,
    parallelism: Parallelism,
) -> Result<(), KernelError> {
    let isa = gemm_level();
    let (m, k, n) = (a_view.rows, a_view.cols, b_view.cols);
    let pre = isa == CpuIsa::Avx512 && b_view.trans && pretranspose_pays(m, k, n);
    gemm_view_at(
        op,
        a,
        a_view,
        b,
        b_view,
        c,
        ldc,
        accumulate,
        scale,
        parallelism,
        isa,
        pre,
    )
}

/// Whether transposing a `trans_b` operand into a contiguous `k×n` scratch before the product
/// ([`gemm_view_at`]'s `pretranspose_b`) makes an AVX-512 product faster. `gemm` computes a
/// row-major product as the transposed one, in which such a `B` is a row-major left operand
/// that its packing gathers column by column: at AVX-512 speed that gather, not the
/// arithmetic, bounds products with long rows (k ≥ 512, e.g. a linear layer's forward
/// `x·Wᵀ` at 4·d_model inputs ran at 0.65–0.80 of OpenBLAS; 0.91–1.01 with the scratch, at
/// GPT-mini's and the 25M model's shapes). At few rows (m < 128) the transpose costs more than
/// it saves unless the rows are very long. Bounded to 4 Mi elements (16 MiB) of scratch.
fn pretranspose_pays(m: usize, k: usize, n: usize) -> bool {
    k >= 512 && (m >= 128 || k >= 2048) && k.saturating_mul(n) <= 1 << 22
}

/// [`gemm_view`] at an explicit level, optionally with `B` (stored transposed) first copied
/// into a contiguous `k×n` scratch (same products, same bits: the packed panels gemm's
/// microkernels read hold the same values either way; tested).
#[allow(clippy::too_many_arguments)]
fn gemm_view_at(
    op: &'static str,
    a: &[f32],
    a_view: View,
    b: &[f32],
    b_view: View,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    scale: f32,
    parallelism: Parallelism,
    isa: CpuIsa,
    pretranspose_b: bool,
) -> Result<(), KernelError> {
    let (m, k, n) = (a_view.rows, a_view.cols, b_view.cols);
    if b_view.rows != k {
        return Err(KernelError::InvalidShape {
            op,
            reason: format!("op(A) is {m}×{k} but op(B) has {} rows", b_view.rows),
        });
    }
    let (a_rs, a_cs) = a_view.strides(op, "a", a.len())?;
    let (b_rs, b_cs) = b_view.strides(op, "b", b.len())?;
    let (c_rs, _) = View {
        rows: m,
        cols: n,
        ld: ldc,
        trans: false,
    }
    .strides(op, "c", c.len())?;
    if pretranspose_b && b_view.trans && k > 0 && n > 0 {
        return PACKED_B.with(|cell| {
            // Taken out of the cell for the call (a nested call on this thread would find an
            // empty one and allocate its own), put back for the next call.
            let mut buf = cell.take();
            if buf.len() < k * n {
                buf.resize(k * n, 0.0);
            }
            let packed = &mut buf[..k * n];
            transpose(isa, b, n, k, b_view.ld, packed);
            let r = gemm_view_at(
                op,
                a,
                a_view,
                packed,
                View::dense(k, n, false),
                c,
                ldc,
                accumulate,
                scale,
                parallelism,
                isa,
                false,
            );
            cell.set(buf);
            r
        });
    }
    // SAFETY: `View::strides` checked that each slice holds its operand: gemm reads op(A)[i][p]
    // at i·a_rs + p·a_cs ≤ (stored rows − 1)·ld + (row width − 1) < a.len() for i < m, p < k
    // (likewise B), and writes C[i][j] at i·ldc + j ≤ (m − 1)·ldc + n − 1 < c.len(). `c` is a
    // unique borrow, so it aliases neither input. gemm returns before touching memory when m or
    // n is 0, and reads no input when k is 0.
    unsafe {
        sgemm(
            isa,
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_rs,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            scale,
            parallelism,
        );
    }
    Ok(())
}

thread_local! {
    /// [`gemm_view_at`]'s scratch for a pre-transposed `B`, kept per thread between calls (at
    /// most [`pretranspose_pays`]'s bound; host memory outside the device allocators).
    static PACKED_B: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `gemm::gemm`'s f32 path at an explicit instruction-set level: `gemm::gemm`'s own argument
/// normalization (a row-major destination is computed as the transposed problem, which its
/// microkernels prefer; negative strides are flipped), then the same blocked driver
/// (`gemm_common::gemm::gemm_basic_generic`) with the same arguments `gemm` 0.19 passes it, and
/// the microkernels of `gemm-f32` for `isa` — AVX-512 (`avx512f`, 16 lanes), AVX2 + FMA (`fma`,
/// 8 lanes) or the portable `scalar` kernel. At the level `gemm` itself detects, the bits equal
/// `gemm::gemm`'s (tested). A level the CPU lacks falls back to the next narrower one that it
/// has (never entered: [`super::cpu_isa`] is capped at the detected level).
///
/// # Safety
/// `gemm::gemm`'s contract: `dst`, `lhs` and `rhs` with their strides address valid `m×n`,
/// `m×k` and `k×n` matrices, `dst` not overlapping the others.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn sgemm(
    isa: CpuIsa,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_cs: isize,
    dst_rs: isize,
    read_dst: bool,
    lhs: *const f32,
    lhs_cs: isize,
    lhs_rs: isize,
    rhs: *const f32,
    rhs_cs: isize,
    rhs_rs: isize,
    alpha: f32,
    beta: f32,
    parallelism: Parallelism,
) {
    // As gemm::gemm: C = A·B is computed as Cᵀ = Bᵀ·Aᵀ when C is row-oriented.
    let (
        m,
        n,
        mut dst_cs,
        mut dst_rs,
        mut lhs,
        mut lhs_cs,
        mut lhs_rs,
        mut rhs,
        mut rhs_cs,
        mut rhs_rs,
    ) = if dst_cs.abs() < dst_rs.abs() {
        (
            n, m, dst_rs, dst_cs, rhs, rhs_rs, rhs_cs, lhs, lhs_rs, lhs_cs,
        )
    } else {
        (
            m, n, dst_cs, dst_rs, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs,
        )
    };
    let mut dst = dst;
    if dst_rs < 0 && m > 0 {
        dst = dst.wrapping_offset((m - 1) as isize * dst_rs);
        dst_rs = -dst_rs;
        lhs = lhs.wrapping_offset((m - 1) as isize * lhs_rs);
        lhs_rs = -lhs_rs;
    }
    if dst_cs < 0 && n > 0 {
        dst = dst.wrapping_offset((n - 1) as isize * dst_cs);
        dst_cs = -dst_cs;
        rhs = rhs.wrapping_offset((n - 1) as isize * rhs_cs);
        rhs_cs = -rhs_cs;
    }
    if lhs_cs < 0 && k > 0 {
        lhs = lhs.wrapping_offset((k - 1) as isize * lhs_cs);
        lhs_cs = -lhs_cs;
        rhs = rhs.wrapping_offset((k - 1) as isize * rhs_rs);
        rhs_rs = -rhs_rs;
    }
    /// One level: gemm-f32's microkernel table `$uk` with `$n` f32 lanes, run under `$simd`
    /// (exactly what gemm-common's `gemm_def!` instantiates for f32).
    macro_rules! at_level {
        ($simd:expr, $uk:path, $n:expr) => {{
            use $uk as uk;
            gemm_common::gemm::gemm_basic_generic::<
                _,
                f32,
                $n,
                { uk::MR_DIV_N * $n },
                { uk::NR },
                { uk::MR_DIV_N },
                { uk::H_M },
                { uk::H_N },
            >(
                $simd,
                m,
                n,
                k,
                dst,
                dst_cs,
                dst_rs,
                read_dst,
                lhs,
                lhs_cs,
                lhs_rs,
                rhs,
                rhs_cs,
                rhs_rs,
                alpha,
                beta,
                false,
                false,
                false,
                |a, b, c| a * b + c,
                &uk::UKR,
                &uk::H_UKR,
                false,
                parallelism,
            )
        }};
    }
    #[cfg(target_arch = "x86_64")]
    {
        use gemm_common::simd::{Scalar, V3, V4};
        if isa == CpuIsa::Avx512 {
            if let Some(simd) = V4::try_new() {
                return at_level!(simd, gemm_f32::microkernel::avx512f::f32, 16);
            }
        }
        if isa >= CpuIsa::Avx2 {
            if let Some(simd) = V3::try_new() {
                return at_level!(simd, gemm_f32::microkernel::fma::f32, 8);
            }
        }
        at_level!(Scalar, gemm_f32::microkernel::scalar::f32, 1)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            read_dst,
            lhs,
            lhs_cs,
            lhs_rs,
            rhs,
            rhs_cs,
            rhs_rs,
            alpha,
            beta,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// The checked core of [`matmul`]: `C = scale · op(A) · op(B) (+ C if accumulate)` with an
/// explicit parallelism, on contiguous operands whose lengths must match exactly. Shared by
/// `matmul` and `bmm`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn gemm_checked(
    op: &'static str,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
    scale: f32,
    parallelism: Parallelism,
) -> Result<(), KernelError> {
    let shape = || format!("m={m}, k={k}, n={n}, trans_a={trans_a}, trans_b={trans_b}");
    check::len(op, "a", a.len(), check::mul(op, m, k)?, shape)?;
    check::len(op, "b", b.len(), check::mul(op, k, n)?, shape)?;
    check::len(op, "c", c.len(), check::mul(op, m, n)?, shape)?;
    gemm_view(
        op,
        a,
        View::dense(m, k, trans_a),
        b,
        View::dense(k, n, trans_b),
        c,
        n,
        accumulate,
        scale,
        parallelism,
    )
}

/// `C (m×n) = op(A) · op(B)`, plus the old `C` if `accumulate`; all row-major `f32`.
///
/// `A` is stored `m×k`, or `k×m` when `trans_a` (then `op(A) = Aᵀ`); `B` is stored `k×n`, or
/// `n×k` when `trans_b`. Transposes are expressed as strides handed to `gemm`, so nothing is
/// copied, and the wrapper allocates nothing; its overhead over a direct `gemm::gemm` call is a
/// few length checks. With `accumulate == false` the old contents of `c` are never read (NaNs
/// there do not leak into the result). With `k == 0`, `C` is zeroed (or left as is when
/// accumulating).
///
/// Threads: see [`set_matmul_threads`]. **Determinism**: the same inputs give the same bits on
/// every call, under every parallelism setting, and wherever the slices sit in memory (checked
/// by this module's tests against `gemm` 0.19 on x86-64). Different `trans_a`/`trans_b`
/// combinations of mathematically equal products may round differently.
///
/// # Errors
/// [`KernelError::LengthMismatch`] if `a`, `b` or `c` do not hold `m·k`, `k·n` and `m·n`
/// elements; [`KernelError::InvalidShape`] if a size product overflows.
///
/// # Calling `gemm` directly with the same semantics
/// `gemm::gemm` computes `dst = alpha·dst + beta·lhs·rhs` (note: `alpha` scales the *old* `dst`)
/// and takes each matrix as a pointer plus **column stride, then row stride**. This is exactly
/// the call `matmul` makes, so a benchmark can time it side by side:
///
/// ```
/// use fsdp_autograd::kernels::cpu::{matmul, matmul_parallelism};
/// let (m, k, n) = (3, 4, 2);
/// let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5).collect(); // m×k
/// let b: Vec<f32> = (0..n * k).map(|i| 1.0 - i as f32).collect(); // stored n×k (trans_b)
/// let mut ours = vec![0.0f32; m * n];
/// matmul(&a, &b, &mut ours, m, k, n, false, true, false).unwrap();
///
/// let mut raw = vec![0.0f32; m * n];
/// // Strides for row-major storage: A (not transposed) rs = k, cs = 1; A transposed: rs = 1,
/// // cs = m. B (not transposed) rs = n, cs = 1; B transposed: rs = 1, cs = k. C: rs = n, cs = 1.
/// // SAFETY: the three buffers hold m·k, n·k and m·n elements, matching the strides.
/// unsafe {
///     gemm::gemm(
///         m, n, k,
///         raw.as_mut_ptr(), 1, n as isize,    // dst, dst_cs, dst_rs
///         false,                              // read_dst: true to accumulate into dst
///         a.as_ptr(), 1, k as isize,          // lhs, lhs_cs, lhs_rs
///         b.as_ptr(), k as isize, 1,          // rhs, rhs_cs, rhs_rs (transposed storage)
///         1.0, 1.0,                           // alpha (old dst), beta (product)
///         false, false, false,                // conj_dst, conj_lhs, conj_rhs
///         matmul_parallelism(),
///     );
/// }
/// assert_eq!(ours, raw); // bit-identical
/// assert_eq!(ours[0], 0.0 * 1.0 + 0.5 * 0.0 + 1.0 * -1.0 + 1.5 * -2.0);
/// ```
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn matmul(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), KernelError> {
    gemm_checked(
        "matmul",
        a,
        b,
        c,
        m,
        k,
        n,
        trans_a,
        trans_b,
        accumulate,
        1.0,
        matmul_parallelism(),
    )
}

/// `batch` independent [`matmul`]s on consecutive blocks: block `i` of `a` (`m·k` elements,
/// stored `m×k` or `k×m` per `trans_a`), of `b` (`k·n`, per `trans_b`) and of `c` (`m·n`).
///
/// Each block is one `gemm` call with the current [`matmul_parallelism`]; blocks run in order.
/// Same determinism guarantees as [`matmul`].
///
/// # Errors
/// [`KernelError::LengthMismatch`] if the slices do not hold `batch` blocks of those sizes;
/// [`KernelError::InvalidShape`] on overflow.
///
/// ```
/// use fsdp_autograd::kernels::cpu::bmm;
/// // Two 1×2 · 2×1 products.
/// let a = [1.0, 2.0, 3.0, 4.0];
/// let b = [5.0, 6.0, 7.0, 8.0];
/// let mut c = [0.0; 2];
/// bmm(&a, &b, &mut c, 2, 1, 2, 1, false, false, false).unwrap();
/// assert_eq!(c, [1.0 * 5.0 + 2.0 * 6.0, 3.0 * 7.0 + 4.0 * 8.0]);
/// ```
#[allow(clippy::too_many_arguments)]
pub fn bmm(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
) -> Result<(), KernelError> {
    bmm_scaled(
        "bmm", a, b, c, batch, m, k, n, trans_a, trans_b, accumulate, 1.0,
    )
}

/// [`bmm`] with the product scaled by `scale` inside `gemm`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bmm_scaled(
    op: &'static str,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
    scale: f32,
) -> Result<(), KernelError> {
    let shape = || format!("batch={batch}, m={m}, k={k}, n={n}");
    let (sa, sb, sc) = (
        check::mul(op, m, k)?,
        check::mul(op, k, n)?,
        check::mul(op, m, n)?,
    );
    check::len(op, "a", a.len(), check::mul(op, batch, sa)?, shape)?;
    check::len(op, "b", b.len(), check::mul(op, batch, sb)?, shape)?;
    check::len(op, "c", c.len(), check::mul(op, batch, sc)?, shape)?;
    if sc == 0 {
        return Ok(());
    }
    let par = matmul_parallelism();
    // `sc > 0`, so `chunks_exact_mut(sc)` yields exactly `batch` blocks; `sa`/`sb` may be 0
    // (k == 0), which `chunks_exact` does not accept, hence the explicit ranges.
    for (i, cb) in c.chunks_exact_mut(sc).enumerate() {
        let ab = &a[i * sa..(i + 1) * sa];
        let bb = &b[i * sb..(i + 1) * sb];
        gemm_checked(
            op, ab, bb, cb, m, k, n, trans_a, trans_b, accumulate, scale, par,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{reference, Rng};

    /// Standard forward-error bound of a length-k dot product in f32: |err| ≤ γ_{k+1}·Σ|a·b|,
    /// γ_j = j·u/(1 − j·u), u = 2⁻²⁴; doubled for slack.
    fn check_against_reference(got: &[f32], want: &[f64], mag: &[f64], k: usize) {
        let u = f32::EPSILON as f64 / 2.0;
        let j = (k + 2) as f64;
        let gamma = j * u / (1.0 - j * u);
        for (idx, ((&g, &w), &s)) in got.iter().zip(want).zip(mag).enumerate() {
            let err = (g as f64 - w).abs();
            assert!(
                err <= 2.0 * gamma * s + 1e-30,
                "element {idx}: got {g}, want {w}, err {err}, bound {}",
                2.0 * gamma * s
            );
        }
    }

    #[test]
    fn matches_reference_all_transposes_and_accumulate() {
        let mut rng = Rng::new(1);
        let shapes = [
            (1, 1, 1),
            (1, 7, 1),
            (1, 5, 9),
            (9, 5, 1),
            (4, 1, 6),
            (3, 2, 5),
            (17, 33, 9),
            (70, 65, 66),
        ];
        for &(m, k, n) in &shapes {
            for trans_a in [false, true] {
                for trans_b in [false, true] {
                    for accumulate in [false, true] {
                        let a = rng.vec(m * k);
                        let b = rng.vec(k * n);
                        let c0 = rng.vec(m * n);
                        let mut c = c0.clone();
                        matmul(&a, &b, &mut c, m, k, n, trans_a, trans_b, accumulate).unwrap();
                        let (want, mag) =
                            reference(&a, &b, &c0, (m, k, n), trans_a, trans_b, accumulate);
                        check_against_reference(&c, &want, &mag, k);
                    }
                }
            }
        }
    }

    #[test]
    fn overwrite_ignores_nan_in_output_and_k_zero_zeroes() {
        let mut rng = Rng::new(2);
        let (m, k, n) = (5, 6, 7);
        let a = rng.vec(m * k);
        let b = rng.vec(k * n);
        let mut c = vec![f32::NAN; m * n];
        matmul(&a, &b, &mut c, m, k, n, false, false, false).unwrap();
        assert!(c.iter().all(|v| v.is_finite()));

        let mut z = vec![f32::NAN; 6];
        matmul(&[], &[], &mut z, 2, 0, 3, false, false, false).unwrap();
        assert_eq!(z, vec![0.0; 6]);
        let mut keep = vec![1.5f32; 6];
        matmul(&[], &[], &mut keep, 2, 0, 3, true, true, true).unwrap();
        assert_eq!(keep, vec![1.5; 6]);
        // Empty output: nothing to do, no error.
        matmul(&a[..0], &[], &mut [], 0, 4, 0, false, false, false).unwrap();
    }

    #[test]
    fn length_mismatches_are_errors_naming_the_argument() {
        let a = vec![0.0; 6];
        let b = vec![0.0; 12];
        let mut c = vec![0.0; 8];
        matmul(&a, &b, &mut c, 2, 3, 4, false, false, false).unwrap();
        let err = matmul(&a[..5], &b, &mut c, 2, 3, 4, false, false, false).unwrap_err();
        assert!(matches!(
            err,
            KernelError::LengthMismatch {
                arg: "a",
                expected: 6,
                actual: 5,
                ..
            }
        ));
        let msg = err.to_string();
        assert!(
            msg.contains("matmul") && msg.contains("m=2, k=3, n=4"),
            "{msg}"
        );
        let err = matmul(&a, &b[..11], &mut c, 2, 3, 4, false, false, false).unwrap_err();
        assert!(matches!(err, KernelError::LengthMismatch { arg: "b", .. }));
        let err = matmul(&a, &b, &mut c[..7], 2, 3, 4, false, false, false).unwrap_err();
        assert!(matches!(err, KernelError::LengthMismatch { arg: "c", .. }));
        let err = matmul(&a, &b, &mut c, usize::MAX, 2, 4, false, false, false).unwrap_err();
        assert!(matches!(err, KernelError::InvalidShape { .. }));
        let err = bmm(&a, &b, &mut c, 2, 2, 3, 4, false, false, false).unwrap_err();
        assert!(matches!(
            err,
            KernelError::LengthMismatch {
                op: "bmm",
                arg: "a",
                expected: 12,
                ..
            }
        ));
    }

    #[test]
    fn bmm_equals_per_block_matmul_bitwise() {
        let mut rng = Rng::new(3);
        let (batch, m, k, n) = (5, 7, 9, 4);
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                let a = rng.vec(batch * m * k);
                let b = rng.vec(batch * k * n);
                let c0 = rng.vec(batch * m * n);
                let mut c = c0.clone();
                bmm(&a, &b, &mut c, batch, m, k, n, trans_a, trans_b, true).unwrap();
                for i in 0..batch {
                    let mut ci = c0[i * m * n..(i + 1) * m * n].to_vec();
                    matmul(
                        &a[i * m * k..(i + 1) * m * k],
                        &b[i * k * n..(i + 1) * k * n],
                        &mut ci,
                        m,
                        k,
                        n,
                        trans_a,
                        trans_b,
                        true,
                    )
                    .unwrap();
                    assert_eq!(bits(&ci), bits(&c[i * m * n..(i + 1) * m * n]));
                }
            }
        }
        // k == 0 batches zero the output.
        let mut z = vec![f32::NAN; 2 * 3 * 4];
        bmm(&[], &[], &mut z, 2, 3, 0, 4, false, false, false).unwrap();
        assert!(z.iter().all(|&v| v == 0.0));
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Runs one product with an explicit parallelism, with the operands copied to `offset`
    /// elements into fresh buffers (to vary their alignment).
    #[allow(clippy::too_many_arguments)]
    fn run(
        a: &[f32],
        b: &[f32],
        (m, k, n): (usize, usize, usize),
        trans_a: bool,
        trans_b: bool,
        c0: &[f32],
        par: Parallelism,
        offset: usize,
    ) -> Vec<u32> {
        let place = |x: &[f32]| {
            let mut buf = vec![0.0f32; x.len() + offset];
            buf[offset..].copy_from_slice(x);
            buf
        };
        let (pa, pb, mut pc) = (place(a), place(b), place(c0));
        gemm_checked(
            "matmul",
            &pa[offset..],
            &pb[offset..],
            &mut pc[offset..],
            m,
            k,
            n,
            trans_a,
            trans_b,
            true,
            1.0,
            par,
        )
        .unwrap();
        bits(&pc[offset..])
    }

    /// The determinism contract: bit-identical results across calls, parallelism settings and
    /// operand alignments, including shapes large enough for gemm to actually use threads
    /// (m·n·k above its 48·48·256 threading threshold) and the GPT-mini bench's shapes.
    #[test]
    fn bitwise_deterministic_across_calls_parallelism_and_alignment() {
        let mut rng = Rng::new(4);
        let shapes = [
            (1, 64, 64),
            (64, 64, 1),
            (13, 17, 11),
            (96, 200, 80),
            (128, 64, 128),
            (128, 128, 64),
            (256, 256, 768),
            (300, 257, 129),
        ];
        let pars = [
            Parallelism::Rayon(2),
            Parallelism::None,
            Parallelism::Rayon(0),
            Parallelism::Rayon(3),
        ];
        for &(m, k, n) in &shapes {
            for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = rng.vec(m * k);
                let b = rng.vec(k * n);
                let c0 = rng.vec(m * n);
                let base = run(&a, &b, (m, k, n), trans_a, trans_b, &c0, pars[0], 0);
                for &par in &pars {
                    for offset in [0, 1, 3, 16] {
                        let got = run(&a, &b, (m, k, n), trans_a, trans_b, &c0, par, offset);
                        assert!(
                            got == base,
                            "m={m} k={k} n={n} ta={trans_a} tb={trans_b} {par:?} offset={offset}"
                        );
                    }
                }
            }
        }
    }

    /// Every level this CPU has: within the f32 error bound of the f64 reference, bit-identical
    /// across parallelism settings and alignments (the determinism contract holds per level);
    /// the detected level equals `gemm::gemm` bit for bit (our dispatch calls what it calls).
    #[test]
    fn every_isa_level_is_accurate_deterministic_and_the_detected_one_is_gemms() {
        use crate::kernels::cpu::isa::{detected_cpu_isa, forced};
        let mut rng = Rng::new(5);
        let shapes = [
            (1, 7, 1),
            (17, 33, 9),
            (70, 65, 66),
            (128, 64, 96),
            (96, 200, 80),
        ];
        let mut differ = false;
        for &(m, k, n) in &shapes {
            for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
                let a = rng.vec(m * k);
                let b = rng.vec(k * n);
                let c0 = rng.vec(m * n);
                let (want, mag) = reference(&a, &b, &c0, (m, k, n), trans_a, trans_b, true);
                let mut per_level = Vec::new();
                for level in forced::available() {
                    forced::with(level, || {
                        let base = run(
                            &a,
                            &b,
                            (m, k, n),
                            trans_a,
                            trans_b,
                            &c0,
                            Parallelism::None,
                            0,
                        );
                        let got: Vec<f32> = base.iter().map(|&u| f32::from_bits(u)).collect();
                        check_against_reference(&got, &want, &mag, k);
                        for (par, offset) in
                            [(Parallelism::Rayon(2), 3), (Parallelism::Rayon(0), 1)]
                        {
                            let again = run(&a, &b, (m, k, n), trans_a, trans_b, &c0, par, offset);
                            assert!(again == base, "{level}: m={m} k={k} n={n} {par:?}");
                        }
                        per_level.push((level, base));
                    });
                }
                differ |= per_level.windows(2).any(|w| w[0].1 != w[1].1);
                // gemm's own dispatch, at the level it detects (ours, uncapped).
                let mut raw = c0.clone();
                let (ars, acs) = if trans_a {
                    (1, m as isize)
                } else {
                    (k as isize, 1)
                };
                let (brs, bcs) = if trans_b {
                    (1, k as isize)
                } else {
                    (n as isize, 1)
                };
                // SAFETY: a, b, raw hold m·k, k·n, m·n elements laid out as the strides say.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        raw.as_mut_ptr(),
                        1,
                        n as isize,
                        true,
                        a.as_ptr(),
                        acs,
                        ars,
                        b.as_ptr(),
                        bcs,
                        brs,
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        Parallelism::None,
                    );
                }
                let detected = per_level.iter().find(|(l, _)| *l == detected_cpu_isa());
                assert_eq!(
                    detected.map(|d| &d.1),
                    Some(&bits(&raw)),
                    "m={m} k={k} n={n}"
                );
            }
        }
        // The levels really are different kernels (FMA vs separate rounding, other blocking).
        if forced::available().len() > 1 {
            assert!(differ, "no shape told the levels apart");
        }
    }

    /// A product with `B` pre-transposed equals the direct product bit for bit at every level
    /// (the scratch changes speed only; the transposes themselves: `transpose.rs`'s tests).
    #[test]
    fn pretransposed_b_is_the_same_product() {
        use crate::kernels::cpu::isa::forced;
        let mut rng = Rng::new(9);
        for &(m, k, n) in &[(128, 512, 64), (130, 600, 33), (64, 2048, 48), (16, 40, 24)] {
            let (a, b, c0) = (rng.vec(m * k), rng.vec(k * n), rng.vec(m * n));
            for level in forced::available() {
                let mut out = Vec::new();
                for pre in [false, true] {
                    let mut c = c0.clone();
                    gemm_view_at(
                        "matmul",
                        &a,
                        View::dense(m, k, false),
                        &b,
                        View::dense(k, n, true),
                        &mut c,
                        n,
                        true,
                        1.0,
                        Parallelism::None,
                        level,
                        pre,
                    )
                    .unwrap();
                    out.push(bits(&c));
                }
                assert!(out[0] == out[1], "m={m} k={k} n={n} at {level}");
            }
        }
        assert!(pretranspose_pays(512, 1024, 256) && !pretranspose_pays(512, 256, 1024));
    }

    #[test]
    fn thread_knob_maps_to_parallelism() {
        // Only reads the knob's mapping; other tests may run concurrently, so restore at once.
        let before = matmul_threads();
        set_matmul_threads(4);
        let p = matmul_parallelism();
        set_matmul_threads(before);
        assert!(matches!(p, Parallelism::Rayon(4)));
    }
}
