//! The counter-based random stream (Philox4x32-10 keyed by the seed, counter from the parameter
//! name, op index and element index; layout in the [module docs](super)) and the words-to-numbers
//! conversions every random op shares.

use rand_philox::{splitmix64, Philox};

use super::error::InitError;
use super::ops::InitOp;

/// FNV-1a, 64-bit, over the UTF-8 bytes of `s` (offset basis `0xcbf29ce484222325`, prime
/// `0x100000001b3`). The stable parameter-name hash of the RNG counter.
///
/// ```
/// use fsdp_autograd::init::fnv1a64;
/// assert_eq!(fnv1a64(""), 0xcbf2_9ce4_8422_2325);
/// assert_eq!(fnv1a64("a"), 0xaf63_dc4c_8601_ec8c);
/// ```
pub fn fnv1a64(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in s.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Element index bits of the counter.
pub(super) const ELEM_BITS: u32 = 48;
/// Elements per RNG batch.
const BATCH: usize = 64;

/// The key words for a seed.
pub(super) fn key_for(seed: u64) -> [u32; 2] {
    let k = splitmix64(seed);
    [k as u32, (k >> 32) as u32]
}

/// The counter of element 0 of op `op_index` of parameter `fqn`.
pub(super) fn counter_base(fqn: &str, op_index: usize) -> u128 {
    (u128::from(fnv1a64(fqn)) << 64) | ((op_index as u128) << ELEM_BITS)
}

/// 53-bit uniform in (0, 1) from two words.
#[inline]
pub(super) fn unit53(w0: u32, w1: u32) -> f64 {
    let m = (u64::from(w0) << 21) | u64::from(w1 >> 11);
    (m as f64 + 0.5) * (1.0 / 9_007_199_254_740_992.0) // 2⁻⁵³
}

/// 32-bit uniform in (0, 1) from one word.
#[inline]
fn unit32(w: u32) -> f64 {
    (f64::from(w) + 0.5) * (1.0 / 4_294_967_296.0)
}

/// One Box–Muller standard normal from an element's block.
#[inline]
pub(super) fn std_normal(b: &[u32]) -> f64 {
    let u = unit53(b[0], b[1]);
    let v = unit32(b[2]);
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

/// `out[j] = sample(block of element start + j)`, generating Philox blocks `BATCH` at a time.
#[inline]
pub(super) fn fill_random<T>(
    key: [u32; 2],
    base: u128,
    start: usize,
    out: &mut [T],
    sample: impl Fn(&[u32]) -> T,
) {
    let mut words = [0u32; 4 * BATCH];
    let mut pos = start;
    for chunk in out.chunks_mut(BATCH) {
        let w = &mut words[..4 * chunk.len()];
        Philox::new(key, base + pos as u128).fill_u32(w);
        for (x, b) in chunk.iter_mut().zip(w.chunks_exact(4)) {
            *x = sample(b);
        }
        pos += chunk.len();
    }
}

/// Check the sizes shared by both fills.
pub(super) fn check_limits(fqn: &str, ops: &[InitOp], numel: usize) -> Result<(), InitError> {
    if numel as u128 >= (1u128 << ELEM_BITS) || ops.len() > (1 << (64 - ELEM_BITS)) {
        return Err(InitError::TooLarge {
            fqn: fqn.to_string(),
            numel,
            ops: ops.len(),
        });
    }
    Ok(())
}
