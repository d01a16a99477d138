//! The crate's error type.

/// Everything that can go wrong when building a [`FlatParamLayout`](crate::FlatParamLayout) or
/// moving data through one.
///
/// Every variant carries the operation (`op`, the name of the method that failed) and the sizes
/// involved, and its message says what to change.
///
/// ```
/// use fsdp_flatparam::{FlatParamLayout, LayoutError};
///
/// let err = FlatParamLayout::new(&[vec![4, 3]], 0).unwrap_err();
/// assert_eq!(err, LayoutError::ZeroShardingFactor);
///
/// let layout = FlatParamLayout::new(&[vec![4, 3]], 4).unwrap();
/// let err = layout.shard(4).unwrap_err();
/// assert!(err.to_string().contains("rank 4 is out of range"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// The sharding factor was 0.
    #[error(
        "sharding factor must be at least 1, got 0: pass the number of ranks that shard this \
         flat parameter (1 means unsharded)"
    )]
    ZeroShardingFactor,

    /// The product of one parameter's dimensions does not fit in `usize`.
    #[error(
        "parameter {param_index} with shape {shape:?} has more elements than fit in usize: \
         check the shape"
    )]
    ParamNumelOverflow {
        /// Index of the parameter in the list given to `FlatParamLayout::new`.
        param_index: usize,
        /// Its shape.
        shape: Vec<usize>,
    },

    /// The running sum of the parameters' numels does not fit in `usize`.
    #[error(
        "total numel overflows usize at parameter {param_index}: {running_total} elements before \
         it plus its {numel}; split the parameters into several flat parameters"
    )]
    TotalNumelOverflow {
        /// Index of the parameter whose numel made the sum overflow.
        param_index: usize,
        /// Sum of the numels of the parameters before it.
        running_total: usize,
        /// Its numel.
        numel: usize,
    },

    /// Rounding the total numel up to a multiple of the sharding factor does not fit in `usize`.
    #[error(
        "padding total numel {total_numel} up to a multiple of sharding factor {sharding_factor} \
         overflows usize; split the parameters into several flat parameters"
    )]
    PaddedNumelOverflow {
        /// Total numel of the parameters.
        total_numel: usize,
        /// The sharding factor.
        sharding_factor: usize,
    },

    /// A rank was not in `0..sharding_factor`.
    #[error(
        "{op}: rank {rank} is out of range for sharding factor {sharding_factor}; \
         ranks are 0..{sharding_factor}"
    )]
    RankOutOfRange {
        /// The operation.
        op: &'static str,
        /// The rank given.
        rank: usize,
        /// The layout's sharding factor.
        sharding_factor: usize,
    },

    /// A parameter index was not in `0..num_params`.
    #[error(
        "{op}: parameter index {param_index} is out of range; the layout has {num_params} \
         parameters"
    )]
    ParamIndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// The index given.
        param_index: usize,
        /// Number of parameters in the layout.
        num_params: usize,
    },

    /// The number of parameter slices differs from the layout's number of parameters.
    #[error(
        "{op}: got {got} parameter slices but the layout has {expected} parameters; pass one \
         slice per parameter, in layout order"
    )]
    ParamCountMismatch {
        /// The operation.
        op: &'static str,
        /// Number of parameters in the layout.
        expected: usize,
        /// Number of slices given.
        got: usize,
    },

    /// One parameter slice has the wrong number of elements.
    #[error(
        "{op}: parameter {param_index} has {got} elements but the layout expects {expected} \
         (shape {shape:?}); pass parameters in layout order, each with all of its elements"
    )]
    ParamLenMismatch {
        /// The operation.
        op: &'static str,
        /// Index of the offending parameter.
        param_index: usize,
        /// Numel the layout records for it.
        expected: usize,
        /// Length of the slice given.
        got: usize,
        /// Shape the layout records for it.
        shape: Vec<usize>,
    },

    /// A flat (unsharded) buffer has the wrong number of elements.
    #[error(
        "{op}: flat buffer has {got} elements, but this layout's flat parameter has \
         {padded_numel} elements ({total_numel} without padding; {accepted})"
    )]
    FlatLenMismatch {
        /// The operation.
        op: &'static str,
        /// Length of the buffer given.
        got: usize,
        /// Padded numel of the layout.
        padded_numel: usize,
        /// Unpadded (total) numel of the layout.
        total_numel: usize,
        /// Which lengths the operation accepts.
        accepted: &'static str,
    },

    /// A shard buffer has the wrong number of elements.
    #[error(
        "{op}: shard buffer for rank {rank} has {got} elements but this layout's chunk numel is \
         {expected}; pass exactly one rank's chunk"
    )]
    ShardLenMismatch {
        /// The operation.
        op: &'static str,
        /// The rank the shard belongs to.
        rank: usize,
        /// Chunk numel of the layout.
        expected: usize,
        /// Length of the buffer given.
        got: usize,
    },

    /// A dtype cast was given source and destination buffers of different lengths.
    #[error(
        "{op}: source has {src_len} {src_dtype} elements but destination has {dst_len} \
         {dst_dtype} elements; a cast needs buffers of equal length"
    )]
    CastLenMismatch {
        /// The operation.
        op: &'static str,
        /// Element type of the source.
        src_dtype: &'static str,
        /// Element type of the destination.
        dst_dtype: &'static str,
        /// Length of the source.
        src_len: usize,
        /// Length of the destination.
        dst_len: usize,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = LayoutError> = std::result::Result<T, E>;
