//! Sharded optimizers (being written).
