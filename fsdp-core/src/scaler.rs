//! The sharded gradient scaler (being written).
