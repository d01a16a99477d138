//! Elementwise ops: [`Binary`] (add, mul, row broadcasts), [`Scale`], [`ScaleInplace`],
//! [`AxpyRows`], GELU ([`GeluForward`], [`GeluBackward`]), [`Cast`], [`Fill`], [`Arange`].

mod axpy;
mod binary;
mod cast;
mod fill;
mod gelu;
mod scale;

pub use axpy::AxpyRows;
pub use binary::{Binary, BinaryOp};
pub use cast::Cast;
pub use fill::{Arange, Fill};
pub use gelu::{GeluBackward, GeluForward};
pub use scale::{Scale, ScaleInplace};
