//! The crate's error type.

/// Everything that can go wrong in FSDP.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// Unit planning failed (bad policy, bad module tree).
    #[error("wrapping: {0}")]
    Wrap(String),
    /// A configuration that cannot work (e.g. a shard size that does not divide the world).
    #[error("configuration: {0}")]
    Config(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = FsdpError> = std::result::Result<T, E>;
