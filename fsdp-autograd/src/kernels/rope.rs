//! Rotary position embedding (RoPE, Llama's): [`Rope`] and [`RopeBackward`], with their
//! host-slice kernels [`rope`] and [`rope_backward`].
//!
//! Transformers' convention (`rotate_half`): a head's `d` values are two halves `x₁ = x[..d/2]`,
//! `x₂ = x[d/2..]`, and position `p` rotates pair `j` by the angle `p·θ_j`:
//! `y₁ = x₁·cos − x₂·sin`, `y₂ = x₂·cos + x₁·sin` (the exact f32 values of transformers'
//! `q·cos + rotate_half(q)·sin`: each product and the sum rounded on their own). The angles come
//! as tables, `cos` and `sin` of `[rows, d/2]` (f32, row `p` for position `p`), computed once on
//! the host (`nn::RotaryTables`), so both backends read the same values.
//!
//! The op does the attention's head split in the same pass: it reads the projection's layout
//! `[batch, t, heads, d]` and writes the attention's `[batch, heads, t, d]` (for `t = 1` the two
//! are the same bytes), so rotating costs no extra copy. The backward rotates the other way,
//! `dx₁ = dy₁·cos + dy₂·sin`, `dx₂ = dy₂·cos − dy₁·sin`, from `[batch, heads, t, d]` back to
//! `[batch, t, heads, d]`. Positions are `pos0 .. pos0 + t` (a KV-cache decoder passes its
//! position). In f32 the CPU and CUDA kernels give the same bits; half operands are widened,
//! computed in f32 and rounded once.

use fsdp_alloc::{DType, Stream};

use crate::error::Result;
use crate::kernels::check;
use crate::kernels::op::{Check, Op, Spec};
use crate::kernels::operand::Operand;
use crate::kernels::KernelError;
use crate::launch::launch_f32;

/// What the tables hold (for dtype errors).
const TABLE: &str = "rotary cos/sin table";

/// The sizes of a rotary embedding: `batch × t × heads` rows of `head_dim` values, at positions
/// `pos0 .. pos0 + t` of tables with `table_rows` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Values per head (even).
    pub head_dim: usize,
    /// Position of the first token.
    pub pos0: usize,
    /// Positions the `cos`/`sin` tables hold (`pos0 + seq` at most).
    pub table_rows: usize,
}

impl RopeShape {
    /// Elements of the input (and of the output), `batch · seq · heads · head_dim`, and of each
    /// table, `table_rows · head_dim / 2`.
    ///
    /// # Errors
    /// [`KernelError::InvalidShape`] for an odd or zero `head_dim`, positions past the tables,
    /// an overflow.
    pub fn sizes(&self, op: &'static str) -> std::result::Result<(usize, usize), KernelError> {
        let bad = |reason: String| KernelError::InvalidShape { op, reason };
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return Err(bad(format!(
                "head_dim {} must be even and positive (RoPE rotates pairs)",
                self.head_dim
            )));
        }
        if self
            .pos0
            .checked_add(self.seq)
            .is_none_or(|end| end > self.table_rows)
        {
            return Err(bad(format!(
                "positions {}..{} are past the tables' {} rows",
                self.pos0,
                self.pos0.saturating_add(self.seq),
                self.table_rows
            )));
        }
        let rows = check::mul(op, check::mul(op, self.batch, self.seq)?, self.heads)?;
        let n = check::mul(op, rows, self.head_dim)?;
        Ok((n, check::mul(op, self.table_rows, self.head_dim / 2)?))
    }
}

/// The slice kernels' check: [`RopeShape::sizes`], then the four lengths (input, cos, sin,
/// output).
fn check_slices(
    op: &'static str,
    s: &RopeShape,
    lens: [(&'static str, usize); 4],
) -> std::result::Result<(), KernelError> {
    let (n, t) = s.sizes(op)?;
    let shape = || format!("{s:?}");
    let [(a, la), (b, lb), (c, lc), (d, ld)] = lens;
    check::len(op, a, la, n, shape)?;
    check::len(op, b, lb, t, shape)?;
    check::len(op, c, lc, t, shape)?;
    check::len(op, d, ld, n, shape)
}

/// For every row `(b, t, h)` of the input layout: `(input offset, output offset, table row)`,
/// with the input `[batch, seq, heads, d]` when `from_seq_major` (the forward) and
/// `[batch, heads, seq, d]` otherwise, the output the other.
fn rows(s: &RopeShape, from_seq_major: bool) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let (t_n, h_n, d) = (s.seq, s.heads, s.head_dim);
    (0..s.batch).flat_map(move |b| {
        (0..t_n).flat_map(move |t| {
            (0..h_n).map(move |h| {
                let seq_major = ((b * t_n + t) * h_n + h) * d;
                let head_major = ((b * h_n + h) * t_n + t) * d;
                let (i, o) = if from_seq_major {
                    (seq_major, head_major)
                } else {
                    (head_major, seq_major)
                };
                (i, o, s.pos0 + t)
            })
        })
    })
}

/// Rotates `x` (`[batch, seq, heads, d]`) into `y` (`[batch, heads, seq, d]`):
/// `y₁ = x₁·cos − x₂·sin`, `y₂ = x₂·cos + x₁·sin` with the tables' row `pos0 + t`.
///
/// # Errors
/// [`KernelError`] for an odd head dim, positions past the tables, lengths that do not match.
pub fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    y: &mut [f32],
    s: &RopeShape,
) -> std::result::Result<(), KernelError> {
    const OP: &str = "rope";
    let lens = [
        ("x", x.len()),
        ("cos", cos.len()),
        ("sin", sin.len()),
        ("y", y.len()),
    ];
    check_slices(OP, s, lens)?;
    let half = s.head_dim / 2;
    for (i, o, p) in rows(s, true) {
        let (c, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
        let (x1, x2) = x[i..i + s.head_dim].split_at(half);
        let (y1, y2) = y[o..o + s.head_dim].split_at_mut(half);
        for j in 0..half {
            y1[j] = x1[j] * c[j] - x2[j] * sn[j];
            y2[j] = x2[j] * c[j] + x1[j] * sn[j];
        }
    }
    Ok(())
}

/// Gradient of [`rope`]: `dy` (`[batch, heads, seq, d]`) rotated back into `dx`
/// (`[batch, seq, heads, d]`): `dx₁ = dy₁·cos + dy₂·sin`, `dx₂ = dy₂·cos − dy₁·sin`.
///
/// # Errors
/// As [`rope`].
pub fn rope_backward(
    dy: &[f32],
    cos: &[f32],
    sin: &[f32],
    dx: &mut [f32],
    s: &RopeShape,
) -> std::result::Result<(), KernelError> {
    const OP: &str = "rope_backward";
    let lens = [
        ("dy", dy.len()),
        ("cos", cos.len()),
        ("sin", sin.len()),
        ("dx", dx.len()),
    ];
    check_slices(OP, s, lens)?;
    let half = s.head_dim / 2;
    for (i, o, p) in rows(s, false) {
        let (c, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
        let (g1, g2) = dy[i..i + s.head_dim].split_at(half);
        let (d1, d2) = dx[o..o + s.head_dim].split_at_mut(half);
        for j in 0..half {
            d1[j] = g1[j] * c[j] + g2[j] * sn[j];
            d2[j] = g2[j] * c[j] - g1[j] * sn[j];
        }
    }
    Ok(())
}

/// RoPE forward: `x` `[batch, seq, heads, d]` → `y` `[batch, heads, seq, d]`, rotated.
#[derive(Debug, Clone, Copy)]
pub struct Rope<'a> {
    /// The sizes and positions.
    pub s: RopeShape,
    /// Input.
    pub x: &'a Operand,
    /// `cos` table `[table_rows, d/2]` (`f32`).
    pub cos: &'a Operand,
    /// `sin` table `[table_rows, d/2]` (`f32`).
    pub sin: &'a Operand,
    /// Output.
    pub y: &'a Operand,
}

impl Op for Rope<'_> {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, s) = (self.name(), self.s);
        let (n, t) = s.sizes(op)?;
        let table = [
            Spec::float("x", self.x, n),
            Spec::exact("cos", self.cos, DType::F32, TABLE, t),
            Spec::exact("sin", self.sin, DType::F32, TABLE, t),
            Spec::float("y", self.y, n),
        ];
        c.args(op, || format!("{s:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, st: &Stream) -> Result<()> {
        let s = self.s;
        let (ins, outs) = ([self.x, self.cos, self.sin], [self.y]);
        launch_f32(st, "rope", ins, outs, false, move |[x, c, sn], [y]| {
            rope(x, c, sn, y, &s)
        });
        Ok(())
    }

    /// The typed kernel (`x`, `y` each f32, f16 or bf16; the tables f32).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, st: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb};
        let (x, y) = (tb(self.x), tb(self.y));
        b.kernels()
            .rope_t(st, false, x, &self.cos.buf, &self.sin.buf, y, &self.s)
            .map_err(err("rope"))
    }
}

/// RoPE backward: `dy` `[batch, heads, seq, d]` → `dx` `[batch, seq, heads, d]`, rotated back.
#[derive(Debug, Clone, Copy)]
pub struct RopeBackward<'a> {
    /// The forward's sizes and positions.
    pub s: RopeShape,
    /// Upstream gradient.
    pub dy: &'a Operand,
    /// `cos` table (`f32`).
    pub cos: &'a Operand,
    /// `sin` table (`f32`).
    pub sin: &'a Operand,
    /// Gradient of the forward's input.
    pub dx: &'a Operand,
}

impl Op for RopeBackward<'_> {
    fn name(&self) -> &'static str {
        "rope_backward"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, s) = (self.name(), self.s);
        let (n, t) = s.sizes(op)?;
        let table = [
            Spec::float("dy", self.dy, n),
            Spec::exact("cos", self.cos, DType::F32, TABLE, t),
            Spec::exact("sin", self.sin, DType::F32, TABLE, t),
            Spec::float("dx", self.dx, n),
        ];
        c.args(op, || format!("{s:?}"), &table)?;
        Ok(n > 0)
    }

    fn cpu(&self, st: &Stream) -> Result<()> {
        let s = self.s;
        let (ins, outs) = ([self.dy, self.cos, self.sin], [self.dx]);
        launch_f32(
            st,
            "rope_backward",
            ins,
            outs,
            false,
            move |[g, c, sn], [dx]| rope_backward(g, c, sn, dx, &s),
        );
        Ok(())
    }

    /// The typed kernel (`dy`, `dx` each f32, f16 or bf16; the tables f32).
    #[cfg(feature = "cuda")]
    fn cuda(&self, b: &crate::kernels::cuda::CudaBackend, st: &Stream) -> Result<()> {
        use crate::kernels::cuda::launcher::{err, tb};
        let (dy, dx) = (tb(self.dy), tb(self.dx));
        b.kernels()
            .rope_t(st, true, dy, &self.cos.buf, &self.sin.buf, dx, &self.s)
            .map_err(err("rope_backward"))
    }
}

/// The family's part of the CUDA program: `rope.cu` and the op's kernel table.
#[cfg(feature = "cuda")]
pub(crate) const FAMILY: super::cuda::kernel::Family = super::cuda::kernel::Family {
    sources: &[include_str!("rope.cu")],
    kernels: &[gpu::KERNELS],
};

/// The CUDA side of the op (feature `cuda`): its kernels' declarations, launch plans and
/// [`CudaKernels`](crate::kernels::cuda::CudaKernels) methods. One set of typed kernels serves
/// every dtype (all-f32 operands have the code word 0).
#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use fsdp_alloc::{BufferRef, Stream};

    use super::RopeShape;
    use crate::kernels::cuda::context::{expect_len, CudaKernels};
    use crate::kernels::cuda::error::Result;
    use crate::kernels::cuda::plan::{PArg, Plan, Ptr};
    use crate::kernels::cuda::typed::{operand, plan_map_t, types_word, TBuf};

    crate::kernels::cuda::kernel::declare_kernels! {
        ROPE_FWD = "rope_fwd_t" [U64, U64, U64, U64, U64, U64, Ptr, Ptr, Ptr, Ptr];
        ROPE_BWD = "rope_bwd_t" [U64, U64, U64, U64, U64, U64, Ptr, Ptr, Ptr, Ptr];
    }

    /// RoPE forward (`backward == false`) or backward; `p = [input, cos, sin, output]`,
    /// `codes = [input, output]` (the tables are f32). One thread per rotated pair.
    pub(crate) fn plan_rope(backward: bool, codes: [u64; 2], s: &RopeShape, p: [Ptr; 4]) -> Plan {
        let pairs = (s.batch * s.seq * s.heads * (s.head_dim / 2)) as u64;
        let mut args = vec![
            PArg::U64(types_word(&codes)),
            PArg::U64(s.batch as u64),
            PArg::U64(s.seq as u64),
            PArg::U64(s.heads as u64),
            PArg::U64(s.head_dim as u64),
            PArg::U64(s.pos0 as u64),
        ];
        args.extend(p.map(PArg::Ptr));
        plan_map_t(if backward { ROPE_BWD } else { ROPE_FWD }, pairs, args)
    }

    impl CudaKernels {
        /// RoPE (CPU: [`rope`](super::rope)), or its backward
        /// ([`rope_backward`](super::rope_backward)) when `backward`: `input` and `output` each
        /// f32, f16 or bf16, the `cos`/`sin` tables f32 `[table_rows, d/2]`; the same bits as
        /// the CPU kernel in f32.
        ///
        /// # Errors
        /// The CPU kernel's shape errors; a non-float operand; buffer/stream errors; the output
        /// overlapping an input.
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn rope_t(
            &self,
            stream: &Stream,
            backward: bool,
            input: TBuf<'_>,
            cos: &BufferRef,
            sin: &BufferRef,
            output: TBuf<'_>,
            s: &RopeShape,
        ) -> Result<()> {
            let op = if backward { "rope_backward" } else { "rope" };
            let c = self.call(op, stream)?;
            let (n, t) = s.sizes(op)?;
            let shape = || format!("{s:?}");
            let (bi, ci) = operand(&c, op, "input", input)?;
            let (bo, co) = operand(&c, op, "output", output)?;
            expect_len(op, "input", bi.len, n, shape)?;
            expect_len(op, "output", bo.len, n, shape)?;
            let [bc, bs] = c.f32_sized([("cos", cos, t), ("sin", sin, t)], shape)?;
            c.disjoint(
                &[("output", output.0)],
                &[("input", input.0), ("cos", cos), ("sin", sin)],
            )?;
            let plan = plan_rope(backward, [ci, co], s, [bi, bc, bs, bo].map(|d| d.as_ptr()));
            // SAFETY: input and output hold n elements of their dtypes, the tables t f32, all on
            // this device; the output overlaps no input; each thread writes one pair of the
            // output only (the layout map is a bijection).
            unsafe { c.exec(&plan) }.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(rows: usize, half: usize) -> (Vec<f32>, Vec<f32>) {
        let mut c = Vec::new();
        let mut s = Vec::new();
        for p in 0..rows {
            for j in 0..half {
                let a = p as f64 * 10000f64.powf(-(2.0 * j as f64) / (2 * half) as f64);
                c.push(a.cos() as f32);
                s.push(a.sin() as f32);
            }
        }
        (c, s)
    }

    /// The forward equals transformers' `q·cos + rotate_half(q)·sin` written plainly on the
    /// `[b, h, t, d]` layout (bit for bit: the same f32 expressions), at an offset position.
    #[test]
    fn forward_is_rotate_half_and_splits_heads() {
        let s = RopeShape {
            batch: 2,
            seq: 3,
            heads: 2,
            head_dim: 4,
            pos0: 1,
            table_rows: 5,
        };
        let (c, sn) = tables(5, 2);
        let n = 2 * 3 * 2 * 4;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
        let mut y = vec![f32::NAN; n];
        rope(&x, &c, &sn, &mut y, &s).unwrap();
        for b in 0..2 {
            for h in 0..2 {
                for t in 0..3 {
                    let xi = &x[((b * 3 + t) * 2 + h) * 4..][..4];
                    let yo = &y[((b * 2 + h) * 3 + t) * 4..][..4];
                    let p = t + 1;
                    // cos/sin as transformers builds them: cat(freqs, freqs).
                    let cf = [c[p * 2], c[p * 2 + 1], c[p * 2], c[p * 2 + 1]];
                    let sf = [sn[p * 2], sn[p * 2 + 1], sn[p * 2], sn[p * 2 + 1]];
                    let rot = [-xi[2], -xi[3], xi[0], xi[1]];
                    for k in 0..4 {
                        assert_eq!(yo[k], xi[k] * cf[k] + rot[k] * sf[k], "b{b} h{h} t{t} {k}");
                    }
                }
            }
        }
    }

    /// The backward is the adjoint: ⟨rope(x), g⟩ = ⟨x, rope_backward(g)⟩ (in f64 up to
    /// rounding), and rotating back undoes the forward (rotations are orthogonal).
    #[test]
    fn backward_is_the_adjoint_and_the_inverse() {
        let s = RopeShape {
            batch: 1,
            seq: 4,
            heads: 3,
            head_dim: 6,
            pos0: 0,
            table_rows: 4,
        };
        let (c, sn) = tables(4, 3);
        let n = 4 * 3 * 6;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let g: Vec<f32> = (0..n).map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.2).collect();
        let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
        rope(&x, &c, &sn, &mut y, &s).unwrap();
        rope_backward(&g, &c, &sn, &mut dx, &s).unwrap();
        let dot = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(p, q)| *p as f64 * *q as f64)
                .sum::<f64>()
        };
        let (l, r) = (dot(&y, &g), dot(&x, &dx));
        assert!((l - r).abs() <= 1e-5 * l.abs().max(1.0), "{l} vs {r}");
        let mut back = vec![0.0; n];
        rope_backward(&y, &c, &sn, &mut back, &s).unwrap();
        for (a, b) in back.iter().zip(&x) {
            assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut y = vec![0.0; 6];
        let odd = RopeShape {
            batch: 1,
            seq: 1,
            heads: 2,
            head_dim: 3,
            pos0: 0,
            table_rows: 1,
        };
        assert!(rope(&[0.0; 6], &[0.0; 1], &[0.0; 1], &mut y, &odd).is_err());
        let past = RopeShape {
            head_dim: 2,
            heads: 3,
            pos0: 1,
            ..odd
        };
        let e = rope(&[0.0; 6], &[0.0; 1], &[0.0; 1], &mut y, &past).unwrap_err();
        assert!(e.to_string().contains("past the tables"), "{e}");
        let ok = RopeShape { pos0: 0, ..past };
        let e = rope(&[0.0; 6], &[0.0; 2], &[0.0; 1], &mut y, &ok).unwrap_err();
        assert!(
            matches!(e, KernelError::LengthMismatch { arg: "cos", .. }),
            "{e}"
        );
    }
}
