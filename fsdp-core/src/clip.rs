//! Gradient clipping across shards (being written).
