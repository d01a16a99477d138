//! Reductions: [`Sum`] (sum or mean of all elements), [`ColSums`] (column sums in row order)
//! and [`SumTo`] (the general broadcast-undoing sum).

mod col_sums;
mod sum;
mod sum_to;

pub use col_sums::ColSums;
pub use sum::Sum;
pub use sum_to::{SumTo, SumToShape};
