//! Graph nodes and edges: defined in `tensor.rs` (module `graph`), beside `Tensor`, which they
//! refer to and which refers to them; re-exported here under their usual path.

pub(crate) use crate::tensor::graph::*;
