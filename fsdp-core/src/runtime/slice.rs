//! [`tensor_slice`]: a tensor's memory as a collective's operand. Its own file (re-exported by
//! `comm.rs`) so that `offload.rs`, which `comm.rs` calls, does not import `comm.rs` back.

use fsdp_autograd::Tensor;
use fsdp_collectives::DeviceSlice;

use crate::error::{FsdpError, Result};

/// The memory of `t` (its elements, in its dtype) as a [`DeviceSlice`] for collectives.
///
/// # Errors
/// [`FsdpError::State`] if the tensor's storage is released (no memory attached); an access
/// error if the tensor does not fit its buffer.
pub fn tensor_slice(t: &Tensor) -> Result<DeviceSlice> {
    let r = t.storage().buffer_ref().ok_or_else(|| {
        FsdpError::State(
            "a tensor given to a collective has no memory attached (its storage was released); \
             pass a tensor whose storage is allocated"
                .into(),
        )
    })?;
    let size = t.dtype().size();
    let r = r.slice(t.offset() * size, t.numel() * size)?;
    Ok(DeviceSlice::new(r, t.dtype())?)
}
