//! [`SumTo`]: the general broadcast-undoing sum (CPU only; the CUDA backend takes the row
//! broadcasts through [`ColSums`](super::ColSums)).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::op::{invalid, Check, Op, Spec};
use crate::kernels::operand::{Operand, View};
use crate::launch::launch_f32;

/// The index spaces of a [`SumTo`]: `out[t(i)] += x[i]` over `x`'s index space `shape`, with
/// `t(i) = Σ i·target_strides` (0 where the target broadcasts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SumToShape {
    /// The index space of `x` (contiguous).
    pub shape: Vec<usize>,
    /// Strides into `out` per dimension of `shape`.
    pub target_strides: Vec<usize>,
    /// Elements of `out`.
    pub out_numel: usize,
}

/// A general broadcast-undoing sum ([`SumToShape`]); `out` is overwritten.
#[derive(Debug, Clone, Copy)]
pub struct SumTo<'a> {
    /// The index spaces.
    pub shape: &'a SumToShape,
    /// Input.
    pub x: &'a Operand,
    /// Output (overwritten).
    pub out: &'a Operand,
}

impl Op for SumTo<'_> {
    fn name(&self) -> &'static str {
        "sum_to"
    }

    fn check(&self, c: &Check) -> Result<bool> {
        let (op, st) = (self.name(), self.shape);
        let n: usize = st.shape.iter().product();
        let table = [
            Spec::float("x", self.x, n),
            Spec::float("out", self.out, st.out_numel),
        ];
        c.args(op, || format!("{st:?}"), &table)?;
        let v = View {
            shape: st.shape.clone(),
            strides: st.target_strides.clone(),
            offset: 0,
        };
        if st.shape.len() != st.target_strides.len() || v.end().is_none_or(|e| e > st.out_numel) {
            let reason = format!("target strides reach outside the output: {st:?}");
            return Err(invalid(op, reason));
        }
        Ok(true)
    }

    fn cpu(&self, s: &Stream) -> Result<()> {
        let st = self.shape.clone();
        launch_f32(s, "sum_to", [self.x], [self.out], false, move |[x], [o]| {
            sum_to(&st, x, o);
            Ok(())
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, _b: &crate::kernels::cuda::CudaBackend, _s: &Stream) -> Result<()> {
        Err(crate::kernels::cuda::launcher::unsupported(
            "sum_to",
            &format!(
                "the general broadcast-undoing sum over {:?} has no CUDA kernel (only the row \
                 broadcast of bias-like shapes does); reshape so the broadcast dimensions lead",
                self.shape.shape
            ),
        ))
    }
}

/// [`SumTo`] on the host: `out` zeroed, then `out[t(i)] += x[i]` with an odometer over `x`'s
/// index space.
fn sum_to(st: &SumToShape, x: &[f32], o: &mut [f32]) {
    let (gs, tstrides) = (&st.shape, &st.target_strides);
    o.fill(0.0);
    let nd = gs.len();
    let mut idx = vec![0usize; nd];
    let mut t = 0usize;
    for &v in x {
        o[t] += v;
        let mut d = nd;
        while d > 0 {
            d -= 1;
            idx[d] += 1;
            t += tstrides[d];
            if idx[d] < gs[d] {
                break;
            }
            t -= tstrides[d] * gs[d];
            idx[d] = 0;
        }
    }
}
