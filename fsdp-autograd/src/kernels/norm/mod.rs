//! Row normalizations: [`Softmax`] and [`LayerNorm`], each with its backward.

mod layer_norm;
mod softmax;

pub use layer_norm::{LayerNorm, LayerNormBackward, LayerNormShape};
pub use softmax::{Softmax, SoftmaxBackward};
