//! [`InitError`]: what can go wrong when init ops are evaluated.

use super::ops::InitOp;

/// Errors of init-op evaluation. Each says which parameter and op failed and what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InitError {
    /// A whole-tensor op was passed to a position-wise fill.
    #[error(
        "op {op_index} ({op}) of parameter `{fqn}` needs the whole tensor and cannot be computed \
         for a sub-range; materialize the whole parameter with fill_whole instead"
    )]
    NotPositionwise {
        /// Parameter name.
        fqn: String,
        /// Index of the op in the parameter's op list.
        op_index: usize,
        /// The op, described.
        op: String,
    },
    /// An op's arguments are invalid (non-finite, negative std, low > high, ...).
    #[error("op {op_index} ({op}) of parameter `{fqn}` is invalid: {reason}")]
    InvalidOp {
        /// Parameter name.
        fqn: String,
        /// Index of the op.
        op_index: usize,
        /// The op, described.
        op: String,
        /// What is wrong and what is expected.
        reason: String,
    },
    /// Kaiming/Xavier on a tensor without a fan (0-D).
    #[error(
        "op {op_index} ({op}) of parameter `{fqn}` needs a fan, which is undefined for shape \
         {shape:?}; use a tensor with at least one dimension or an explicit uniform/normal op"
    )]
    FanUndefined {
        /// Parameter name.
        fqn: String,
        /// Index of the op.
        op_index: usize,
        /// The op, described.
        op: String,
        /// The parameter's shape.
        shape: Vec<usize>,
    },
    /// The requested element range does not fit in the parameter.
    #[error(
        "elements [{start}, {end}) requested of parameter `{fqn}` with {numel} elements (shape \
         {shape:?}); pass a range inside the parameter"
    )]
    RangeOutOfBounds {
        /// Parameter name.
        fqn: String,
        /// First requested element.
        start: usize,
        /// One past the last requested element.
        end: usize,
        /// Elements in the parameter.
        numel: usize,
        /// The parameter's shape.
        shape: Vec<usize>,
    },
    /// The output buffer of a whole-tensor fill has the wrong length.
    #[error(
        "output for parameter `{fqn}` has {got} elements but shape {shape:?} has {expected}; \
         pass a buffer of exactly numel elements"
    )]
    LengthMismatch {
        /// Parameter name.
        fqn: String,
        /// Elements the shape has.
        expected: usize,
        /// Elements the buffer has.
        got: usize,
        /// The parameter's shape.
        shape: Vec<usize>,
    },
    /// A copy source resolved to a different number of elements than the destination.
    #[error(
        "parameter `{fqn}` copies from `{source_fqn}`, which has {got} elements, but `{fqn}` has \
         {expected}; copy only between parameters of the same size"
    )]
    CopySizeMismatch {
        /// Destination parameter.
        fqn: String,
        /// Source parameter.
        source_fqn: String,
        /// Destination elements.
        expected: usize,
        /// Source elements.
        got: usize,
    },
    /// A resolver could not provide a copy source's values.
    #[error("cannot resolve copy source `{source_fqn}`: {reason}")]
    Unresolved {
        /// The source parameter's name.
        source_fqn: String,
        /// Why, and what to do.
        reason: String,
    },
    /// The parameter has more elements or ops than the RNG counter layout addresses.
    #[error(
        "parameter `{fqn}` has {numel} elements and {ops} init ops; the counter-based RNG \
         addresses at most 2^48 elements and 2^16 ops per parameter; split the parameter"
    )]
    TooLarge {
        /// Parameter name.
        fqn: String,
        /// Its elements.
        numel: usize,
        /// Its ops.
        ops: usize,
    },
}

/// [`InitError::InvalidOp`] for op `op_index` (`op`) of parameter `fqn` (here, not in `fill.rs`,
/// so that `orthogonal.rs` and `fill.rs` do not import each other).
pub(super) fn invalid(
    fqn: &str,
    op_index: usize,
    op: &InitOp,
    reason: impl Into<String>,
) -> InitError {
    InitError::InvalidOp {
        fqn: fqn.to_string(),
        op_index,
        op: op.describe(),
        reason: reason.into(),
    }
}
