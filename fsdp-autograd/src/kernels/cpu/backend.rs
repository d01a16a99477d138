//! [`CpuBackend`]: the seam's CPU implementation — every launch is the op's own CPU launch
//! ([`Op::cpu`]: one closure on the CPU stream running the matching `kernels::cpu` function on
//! the operands' memory; half dtypes are computed in `f32` through a temporary, as everywhere on
//! the CPU).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::attention::Attention;
use crate::kernels::backend::{Backend, ReadFn};
use crate::kernels::op::Op;
use crate::kernels::operand::Operand;
use crate::launch::launch;

/// The CPU kernels behind the seam (stateless; one value serves every CPU device).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    /// The CPU takes the packed layout (gathered inside the kernel, bit for bit the head-split
    /// result).
    fn attention_packed(&self, _a: &Attention) -> bool {
        true
    }

    fn launch(&self, s: &Stream, op: &dyn Op) -> Result<()> {
        op.cpu(s)
    }

    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
        let a = dst.clone();
        launch(s, "from_vec", move || {
            a.typed_mut::<u8, _>("from_vec", |d| d.copy_from_slice(&bytes))
        });
        Ok(())
    }

    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
        let a = src.clone();
        launch(s, "to_vec", move || a.typed::<u8, _>("to_vec", f));
        Ok(())
    }
}
