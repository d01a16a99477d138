//! Int8 block quantization for collectives (ZeRO++-style): the codec that turns f32 values into
//! int8 codes with one f32 scale per block, and back.
//!
//! A block of `block` consecutive values `x` is stored as `scale = max|x| / 127` and codes
//! `q = round(x / scale)` (round to nearest, ties away from zero) in `-127..=127`; decoding gives
//! `q · scale`. The error of every element is at most `scale / 2 = max|x| / 254` (plus an f32
//! rounding of the product, a few units in the last place). An all-zero block has scale 0 and
//! decodes to zeros. A block holding a NaN or an infinity gets a NaN scale, so the whole block
//! decodes to NaN: non-finite values stay visible to non-finite checks (grad scalers) instead
//! of being clamped into finite numbers.
//!
//! ## Packet layout
//! [`Int8Codec::encode`] writes one *packet* for `n` values: the `ceil(n / block)` scales as
//! little-endian f32 bytes, then the `n` codes as bytes (two's complement). Its length is
//! [`Int8Codec::packed_len`]`(n) = 4 · ceil(n / block) + n` bytes — about a quarter of the f32
//! bytes plus `4 / block` per value. Packets have no alignment requirement, so W of them can be
//! gathered back to back into one `u8` buffer (all-gather) or exchanged by
//! [`crate::ProcessGroup::all_to_all_into`] (reduce-scatter).
//!
//! The codec is pure host code over slices; fsdp-core launches it on streams around the
//! collectives (see `FsdpConfig::quantize_collectives`).

use crate::error::{CollectiveError, Result};

/// Int8 block quantization with a per-block f32 scale (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int8Codec {
    block: usize,
}

impl Int8Codec {
    /// The largest code magnitude.
    pub const QMAX: f32 = 127.0;

    /// A codec with `block` values per scale.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidSlice`] if `block` is 0 (every block needs at least one value).
    pub fn new(block: usize) -> Result<Int8Codec> {
        if block == 0 {
            return Err(CollectiveError::InvalidSlice(
                "an int8 quantization block of 0 values; use a block of at least 1 (e.g. 256)"
                    .into(),
            ));
        }
        Ok(Int8Codec { block })
    }

    /// Values per scale.
    pub fn block(&self) -> usize {
        self.block
    }

    /// Number of blocks (scales) for `n` values.
    pub fn num_blocks(&self, n: usize) -> usize {
        n.div_ceil(self.block)
    }

    /// Bytes of the packet of `n` values: `4 · num_blocks(n) + n`.
    pub fn packed_len(&self, n: usize) -> usize {
        4 * self.num_blocks(n) + n
    }

    /// The scale of one block: `max|x| / 127`; 0 for an all-zero block, NaN if a value is not
    /// finite.
    pub fn scale_of(values: &[f32]) -> f32 {
        let mut absmax = 0f32;
        for &v in values {
            if !v.is_finite() {
                return f32::NAN;
            }
            absmax = absmax.max(v.abs());
        }
        absmax / Self::QMAX
    }

    /// The code of `v` under `scale` (round to nearest, clamped to ±127; 0 when the scale is 0
    /// or not finite).
    pub fn code_of(v: f32, scale: f32) -> i8 {
        if scale == 0.0 || !scale.is_finite() {
            return 0;
        }
        (v / scale).round().clamp(-Self::QMAX, Self::QMAX) as i8
    }

    /// Quantizes `src` into the packet `dst` (exactly [`Int8Codec::packed_len`]`(src.len())`
    /// bytes).
    ///
    /// # Errors
    /// [`CollectiveError::InvalidSlice`] if `dst` has another length.
    pub fn encode(&self, src: &[f32], dst: &mut [u8]) -> Result<()> {
        let n = src.len();
        self.check_packet(n, dst.len())?;
        let (scales, codes) = dst.split_at_mut(4 * self.num_blocks(n));
        for ((block, scale_bytes), code_block) in src
            .chunks(self.block)
            .zip(scales.chunks_exact_mut(4))
            .zip(codes.chunks_mut(self.block))
        {
            let scale = Self::scale_of(block);
            scale_bytes.copy_from_slice(&scale.to_le_bytes());
            for (c, &v) in code_block.iter_mut().zip(block) {
                *c = Self::code_of(v, scale) as u8;
            }
        }
        Ok(())
    }

    /// Dequantizes the packet `src` into `dst` (`dst.len()` values).
    ///
    /// # Errors
    /// [`CollectiveError::InvalidSlice`] if `src` is not a packet of `dst.len()` values.
    pub fn decode(&self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        self.decode_with(src, dst, |d, v| *d = v)
    }

    /// Dequantizes the packet `src` and adds it to `dst` in f32 (`dst[i] += q_i · scale`): the
    /// step of a rank-ordered sum of dequantized contributions.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidSlice`] if `src` is not a packet of `dst.len()` values.
    pub fn decode_add(&self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        self.decode_with(src, dst, |d, v| *d += v)
    }

    fn decode_with(&self, src: &[u8], dst: &mut [f32], put: impl Fn(&mut f32, f32)) -> Result<()> {
        let n = dst.len();
        self.check_packet(n, src.len())?;
        let (scales, codes) = src.split_at(4 * self.num_blocks(n));
        for ((out, scale_bytes), code_block) in dst
            .chunks_mut(self.block)
            .zip(scales.chunks_exact(4))
            .zip(codes.chunks(self.block))
        {
            let mut b = [0u8; 4];
            b.copy_from_slice(scale_bytes);
            let scale = f32::from_le_bytes(b);
            for (d, &c) in out.iter_mut().zip(code_block) {
                put(d, f32::from(c as i8) * scale);
            }
        }
        Ok(())
    }

    fn check_packet(&self, n: usize, bytes: usize) -> Result<()> {
        let want = self.packed_len(n);
        if bytes != want {
            return Err(CollectiveError::InvalidSlice(format!(
                "an int8 packet of {n} values in blocks of {} takes {want} bytes ({} scales + {n} \
                 codes), got {bytes}; size the buffer with Int8Codec::packed_len",
                self.block,
                self.num_blocks(n)
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_of_a_small_example() {
        let c = Int8Codec::new(4).unwrap();
        let x = [1.0, -0.5, 0.25, 0.0, 2.54, 0.0];
        let mut p = vec![0u8; c.packed_len(x.len())];
        assert_eq!(p.len(), 2 * 4 + 6);
        c.encode(&x, &mut p).unwrap();
        let mut y = vec![0f32; 6];
        c.decode(&p, &mut y).unwrap();
        assert_eq!(y[4], 2.54f32 / 127.0 * 127.0);
        assert_eq!(y[5], 0.0);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= 1.0 / 254.0 + 1e-7, "{a} vs {b}");
        }
        let first = y.clone();
        c.decode_add(&p, &mut y).unwrap();
        for (a, b) in first.iter().zip(&y) {
            assert_eq!(a + a, *b, "decode_add adds the decoded values");
        }
    }

    #[test]
    fn zero_and_non_finite_blocks() {
        let c = Int8Codec::new(2).unwrap();
        let x = [0.0, 0.0, f32::INFINITY, 1.0];
        let mut p = vec![0u8; c.packed_len(4)];
        c.encode(&x, &mut p).unwrap();
        let mut y = vec![7f32; 4];
        c.decode(&p, &mut y).unwrap();
        assert_eq!(&y[..2], &[0.0, 0.0]);
        assert!(y[2].is_nan() && y[3].is_nan(), "{y:?}");
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(Int8Codec::new(0).is_err());
        let c = Int8Codec::new(8).unwrap();
        let e = c.encode(&[1.0; 9], &mut [0u8; 9]).unwrap_err();
        assert!(e.to_string().contains("packed_len"), "{e}");
        assert!(c.decode(&[0u8; 3], &mut [0f32; 9]).is_err());
    }
}
