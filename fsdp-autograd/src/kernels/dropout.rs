//! Dropout with a counter-based mask: [`Dropout`], and its host-slice kernel [`dropout`].
//!
//! `y = x · m` with `m = 1/(1 − p)` where the element is kept and `0` where it is dropped (a NaN
//! or infinite input stays NaN where dropped, as in PyTorch, which multiplies by the mask). The
//! mask is never stored: it is a pure function of a [`DropoutKey`] (seed, step, the global index
//! of the first sample), the dropout *site* (which dropout of the model), the sample (row) and
//! the element inside the sample, so the backward (`dx = dy · m`) is the same op applied to the
//! upstream gradient, activation checkpointing recomputes the same mask, and a sample gets the
//! same mask whichever rank or micro-batch it lands on — FSDP on W ranks equals one rank with
//! W-way gradient accumulation, bit for bit, with dropout on.
//!
//! The random words are Philox4x32-10 blocks (Random123; [`rand_philox::philox4x32_10`]):
//! - key: the two 32-bit halves of `splitmix64(splitmix64(seed) ^ splitmix64(step ^ STREAM))`
//!   ([`DropoutKey::philox_key`]);
//! - counter: `[e / 4, site, sample low 32 bits, sample high 32 bits]` for element `e` of a
//!   sample; the element uses word `e mod 4` of its block.
//!
//! An element is kept when its word is at least `round(p · 2³²)` ([`DropoutMask::threshold`]):
//! an integer comparison, so the CPU kernel and the CUDA kernel (`dropout.cu`) draw the same
//! mask, and the product `x · m` is one f32 multiplication on both (half operands are widened
//! first and the result rounded once), so their outputs are equal bit for bit.

use fsdp_alloc::Stream;
use rand_philox::{philox4x32_10, splitmix64};

use super::op::{invalid, Check, Op, Rows, Spec};
use super::operand::Operand;
use super::KernelError;
use crate::error::Result;
use crate::launch::launch_f32;

/// Mixed into the step before it is hashed, so the dropout stream is not the init stream of
/// another seed (any constant would do; it is part of the reproducibility contract).
const STREAM: u64 = 0x6472_6f70_6f75_7421; // "dropout!"

/// Largest elements per sample: the counter's block word is 32 bits (four elements a block).
pub const MAX_SAMPLE_ELEMS: usize = 1 << 34;

/// What one training forward's dropout masks are keyed by: the run's seed, the optimizer step,
/// and the global index of the batch's first sample (the batch's row `r` is sample
/// `sample + r`). Evaluation and sampling have no key (no dropout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DropoutKey {
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step (0-based).
    pub step: u64,
    /// Global index of the first sample of the batch.
    pub sample: u64,
}

impl DropoutKey {
    /// The Philox key of this seed and step (see the module docs).
    pub fn philox_key(&self) -> u64 {
        splitmix64(splitmix64(self.seed) ^ splitmix64(self.step ^ STREAM))
    }
}

/// The mask of one dropout launch: probability, key, site.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    /// Drop probability, in `[0, 1)`.
    pub p: f32,
    /// The forward's key.
    pub key: DropoutKey,
    /// Which dropout of the model (a number per place; see `nn::Gpt`).
    pub site: u32,
}

impl DropoutMask {
    /// Words below this are dropped: `round(p · 2³²)`.
    pub fn threshold(&self) -> u64 {
        (f64::from(self.p) * 4_294_967_296.0).round() as u64
    }

    /// The factor of kept elements: `1/(1 − p)` rounded to f32.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - f64::from(self.p))) as f32
    }

    fn check(&self, op: &'static str) -> Result<()> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(invalid(
                op,
                format!("drop probability {} is not in [0, 1)", self.p),
            ));
        }
        Ok(())
    }
}

/// The four random words of block `block` of sample `sample` at `site` under `key`.
#[inline]
fn words(key: u64, site: u32, sample: u64, block: u32) -> [u32; 4] {
    let k = [key as u32, (key >> 32) as u32];
    philox4x32_10([block, site, sample as u32, (sample >> 32) as u32], k)
}

/// Dropout of the rows of `x` (`cols` elements a row; row `r` is sample `mask.key.sample + r`):
/// `y = x · m`, `m = mask.scale()` where the element's word is at least `mask.threshold()`,
/// else `0`. The mask of an element depends only on the key, site, sample and its index in the
/// row.
///
/// # Errors
/// [`KernelError`] for `cols == 0`, `cols` above [`MAX_SAMPLE_ELEMS`], a partial row, or `y`
/// of another length than `x`.
pub fn dropout(
    x: &[f32],
    y: &mut [f32],
    cols: usize,
    mask: &DropoutMask,
) -> std::result::Result<(), KernelError> {
    const OP: &str = "dropout";
    let rows = super::check::rows(OP, "x", x.len(), cols)?;
    if cols > MAX_SAMPLE_ELEMS {
        return Err(KernelError::InvalidShape {
            op: OP,
            reason: format!("{cols} elements a sample (at most {MAX_SAMPLE_ELEMS})"),
        });
    }
    super::check::len(OP, "y", y.len(), x.len(), || {
        format!("rows={rows}, cols={cols}")
    })?;
    let (key, thr, scale) = (mask.key.philox_key(), mask.threshold(), mask.scale());
    for (r, (xr, yr)) in x
        .chunks_exact(cols)
        .zip(y.chunks_exact_mut(cols))
        .enumerate()
    {
        let sample = mask.key.sample.wrapping_add(r as u64);
        for (b, (xb, yb)) in xr.chunks(4).zip(yr.chunks_mut(4)).enumerate() {
            let w = words(key, mask.site, sample, b as u32);
            for ((y, &x), &w) in yb.iter_mut().zip(xb).zip(&w) {
                let m = if u64::from(w) >= thr { scale } else { 0.0 };
                *y = x * m;
            }
        }
    }
    Ok(())
}

/// Dropout of `rows × cols` elements (`rows` samples of `cols` elements): `y = x · m` with the
/// counter-based mask of `mask` (see the module docs). The backward is the same op on the
/// upstream gradient.
#[derive(Debug, Clone, Copy)]
pub struct Dropout<'a> {
    /// Samples × elements per sample.
    pub rows: Rows,
    /// Probability, key, site.
    pub mask: DropoutMask,
    /// Input.
    pub x: &'a Operand,
    /// Output.
    pub y: &'a Operand,
}

impl Op for Dropout<'_> {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, r) = (self.name(), self.rows);
        let n = r.numel(op)?;
        self.mask.check(op)?;
        if r.cols > MAX_SAMPLE_ELEMS {
            return Err(invalid(
                op,
                format!("{} elements a sample (at most {MAX_SAMPLE_ELEMS})", r.cols),
            ));
        }
        let table = [Spec::float("x", self.x, n), Spec::float("y", self.y, n)];
        c.args(op, || format!("{r:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let (cols, mask) = (self.rows.cols, self.mask);
        launch_f32(s, "dropout", [self.x], [self.y], false, move |[x], [y]| {
            dropout(x, y, cols, &mask)
        });
        Ok(())
    }

    /// The typed kernel (`x` and `y` each f32, f16 or bf16, read and written directly).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &super::cuda::CudaBackend, s: &Stream) -> Result<()> {
        use super::cuda::launcher::{err, tb};
        b.kernels()
            .dropout_t(s, tb(self.x), tb(self.y), self.rows.cols, &self.mask)
            .map_err(err("dropout"))
    }
}

/// The family's part of the CUDA program: `dropout.cu` and the op's kernel table.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("dropout.cu")],
    kernels: &[gpu::KERNELS],
};

/// The CUDA side of the op (feature `cuda`): its kernel's declaration, launch plan and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) method.
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::Stream;

    use super::DropoutMask;
    use crate::kernels::cuda::context::{expect_len, rows_of, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        DROPOUT_T = "dropout_t" [U64, U64, U64, U64, U64, U64, U64, F32, Ptr, Ptr];
    }

    /// Dropout of `rows × cols` (codes: x, y): one thread per four-element block of a row.
    pub(crate) fn plan_dropout_t(
        types: u64,
        rows: u64,
        cols: u64,
        mask: &DropoutMask,
        x: Ptr,
        y: Ptr,
    ) -> Plan {
        let blocks = rows * cols.div_ceil(4);
        let args = vec![
            PArg::U64(types),
            PArg::U64(rows),
            PArg::U64(cols),
            PArg::U64(mask.key.philox_key()),
            PArg::U64(u64::from(mask.site)),
            PArg::U64(mask.key.sample),
            PArg::U64(mask.threshold()),
            PArg::F32(mask.scale()),
            PArg::Ptr(x),
            PArg::Ptr(y),
        ];
        plan_map_t(DROPOUT_T, blocks, args)
    }

    impl CudaKernels {
        /// Dropout of the rows of `x` (`cols` elements each) into `y` (CPU:
        /// [`dropout`](super::dropout)), each f32, f16 or bf16; the same mask and bits as the
        /// CPU kernel.
        ///
        /// # Errors
        /// The CPU kernel's shape errors; a non-float operand; buffer/stream errors; `y`
        /// overlapping `x`.
        pub(crate) fn dropout_t(
            &self,
            stream: &Stream,
            x: TBuf<'_>,
            y: TBuf<'_>,
            cols: usize,
            mask: &DropoutMask,
        ) -> Result<()> {
            let op = "dropout";
            let c = self.call(op, stream)?;
            let (bx, cx) = operand(&c, op, "x", x)?;
            let rows = rows_of(op, "x", bx.len, cols)?;
            let (by, cy) = operand(&c, op, "y", y)?;
            expect_len(op, "y", by.len, bx.len, || {
                format!("rows={rows}, cols={cols}")
            })?;
            c.disjoint(&[("y", y.0)], &[("x", x.0)])?;
            let plan = plan_dropout_t(
                types_word(&[cx, cy]),
                rows as u64,
                cols as u64,
                mask,
                bx.as_ptr(),
                by.as_ptr(),
            );
            // SAFETY: x and y hold rows·cols elements of their dtypes on this device and do not
            // overlap; each thread reads and writes only the elements of its own block.
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(p: f32, seed: u64, step: u64, sample: u64, site: u32) -> DropoutMask {
        DropoutMask {
            p,
            key: DropoutKey { seed, step, sample },
            site,
        }
    }

    /// The kept fraction is 1 − p within a few standard deviations, kept elements are scaled
    /// by 1/(1 − p) and dropped ones are zero.
    #[test]
    fn keeps_one_minus_p_scaled() {
        for p in [0.1f32, 0.5, 0.9] {
            let n = 200_000;
            let x = vec![1.0f32; n];
            let mut y = vec![f32::NAN; n];
            dropout(&x, &mut y, 1000, &mask(p, 1, 2, 3, 4)).unwrap();
            let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            let sd = (p as f64 * (1.0 - p as f64) / n as f64).sqrt();
            assert!(
                (kept - (1.0 - p as f64)).abs() < 6.0 * sd,
                "p {p}: kept {kept}"
            );
            let s = (1.0 / (1.0 - p as f64)) as f32;
            assert!(y.iter().all(|&v| v == 0.0 || v == s), "p {p}");
        }
    }

    /// A sample's mask depends on its global index, not on where it sits in a batch: rows 2..4
    /// of a batch starting at sample 10 equal a batch of two starting at sample 12. Other
    /// seeds, steps and sites give other masks.
    #[test]
    fn the_mask_follows_the_sample_not_the_batch() {
        let cols = 37;
        let x: Vec<f32> = (0..5 * cols).map(|i| i as f32 * 0.25 - 3.0).collect();
        let mut all = vec![0.0; x.len()];
        dropout(&x, &mut all, cols, &mask(0.3, 9, 4, 10, 7)).unwrap();
        let mut part = vec![0.0; 2 * cols];
        dropout(
            &x[2 * cols..4 * cols],
            &mut part,
            cols,
            &mask(0.3, 9, 4, 12, 7),
        )
        .unwrap();
        assert_eq!(
            all[2 * cols..4 * cols]
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            part.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        for other in [
            mask(0.3, 8, 4, 10, 7),
            mask(0.3, 9, 5, 10, 7),
            mask(0.3, 9, 4, 10, 6),
        ] {
            let mut y = vec![0.0; x.len()];
            dropout(&x, &mut y, cols, &other).unwrap();
            assert_ne!(y, all, "{other:?}");
        }
    }

    /// The mask is the documented Philox draw: element `e` of sample `s` is kept iff word
    /// `e mod 4` of block `[e/4, site, s, s >> 32]` is at least round(p·2³²); NaN inputs stay
    /// NaN where dropped (x·0).
    #[test]
    fn the_mask_is_the_documented_philox_draw() {
        let m = mask(0.25, 5, 6, (1u64 << 32) + 3, 2);
        let cols = 10;
        let mut x: Vec<f32> = (0..2 * cols).map(|i| i as f32 + 1.0).collect();
        x[3] = f32::NAN;
        let mut y = vec![0.0; x.len()];
        dropout(&x, &mut y, cols, &m).unwrap();
        let key = m.key.philox_key();
        let k = [key as u32, (key >> 32) as u32];
        for r in 0..2u64 {
            let s = m.key.sample + r;
            for e in 0..cols {
                let w = philox4x32_10([(e / 4) as u32, 2, s as u32, (s >> 32) as u32], k)[e % 4];
                let i = r as usize * cols + e;
                let want = x[i]
                    * if w as u64 >= m.threshold() {
                        m.scale()
                    } else {
                        0.0
                    };
                assert_eq!(y[i].to_bits(), want.to_bits(), "row {r} element {e}");
            }
        }
        assert!(y[3].is_nan());
        assert_eq!(m.threshold(), 1 << 30);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let mut y = vec![0.0; 6];
        assert!(dropout(&[1.0; 6], &mut y, 4, &mask(0.1, 0, 0, 0, 0)).is_err());
        assert!(dropout(&[1.0; 6], &mut y, 0, &mask(0.1, 0, 0, 0, 0)).is_err());
        let mut short = vec![0.0; 5];
        assert!(dropout(&[1.0; 6], &mut short, 3, &mask(0.1, 0, 0, 0, 0)).is_err());
        assert!(mask(1.0, 0, 0, 0, 0).check("dropout").is_err());
        assert!(mask(-0.1, 0, 0, 0, 0).check("dropout").is_err());
        assert!(mask(0.0, 0, 0, 0, 0).check("dropout").is_ok());
    }
}
