//! Moving data through a layout: flatten (concat + zero pad), unflatten (views), shard views.
//!
//! Every function here is generic over `T: bytemuck::Pod` (`f32`, `half::f16`, `half::bf16`,
//! integers, …); padding is written as `T::zeroed()` (all-zero bytes, i.e. `0.0` for floats).
//! Copies are whole-slice `copy_from_slice` calls, one per parameter, so they run at memcpy speed.

use crate::error::{LayoutError, Result};
use crate::layout::{FlatParamLayout, ParamPiece};

const PADDED_ONLY: &str = "only the padded length is accepted";
const PADDED_OR_TOTAL: &str = "the padded or the unpadded length is accepted";

impl FlatParamLayout {
    /// Writes the flat parameter into `out`: every parameter's elements at its offset, in layout
    /// order, then zeros in the padding.
    ///
    /// `params` holds one slice per parameter (anything `AsRef<[T]>`: `&[f32]`, `Vec<f32>`, …),
    /// each exactly as long as the parameter's numel; `out` must be exactly
    /// [`padded_numel`](Self::padded_numel) long. Nothing is written if a size is wrong.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![2, 2], vec![2]], 4)?;
    /// let weight = [1.0f32, 2.0, 3.0, 4.0];
    /// let bias = [5.0f32, 6.0];
    /// let mut flat = vec![f32::NAN; layout.padded_numel()];
    /// layout.flatten_into(&[&weight[..], &bias[..]], &mut flat)?;
    /// assert_eq!(flat, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::ParamCountMismatch`], [`LayoutError::ParamLenMismatch`],
    /// [`LayoutError::FlatLenMismatch`].
    pub fn flatten_into<T, P>(&self, params: &[P], out: &mut [T]) -> Result<()>
    where
        T: bytemuck::Pod,
        P: AsRef<[T]>,
    {
        const OP: &str = "flatten_into";
        self.check_params(OP, params)?;
        self.check_flat_len(OP, out.len(), false)?;
        for (p, info) in params.iter().zip(self.params()) {
            out[info.flat_range()].copy_from_slice(p.as_ref());
        }
        bytemuck::fill_zeroes(&mut out[self.total_numel()..]);
        Ok(())
    }

    /// Like [`flatten_into`](Self::flatten_into) but allocates the flat parameter.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![3], vec![]], 3)?; // the scalar shape [] has 1 element
    /// let flat = layout.flatten(&[vec![1u16, 2, 3], vec![4]])?;
    /// assert_eq!(flat, [1, 2, 3, 4, 0, 0]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::ParamCountMismatch`], [`LayoutError::ParamLenMismatch`].
    pub fn flatten<T, P>(&self, params: &[P]) -> Result<Vec<T>>
    where
        T: bytemuck::Pod,
        P: AsRef<[T]>,
    {
        self.check_params("flatten", params)?;
        let mut out = vec![T::zeroed(); self.padded_numel()];
        self.flatten_into(params, &mut out)?;
        Ok(out)
    }

    /// Writes only rank `rank`'s shard of the flat parameter into `out` (exactly
    /// [`chunk_numel`](Self::chunk_numel) long), straight from the full parameters, without
    /// building the flat parameter: what a rank needs to shard parameters it already holds whole.
    /// Equal to `shard_of(&flatten(params)?, rank)?`.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![5], vec![3]], 3)?; // chunk 3, 1 padding
    /// let params = [vec![1.0f32, 2.0, 3.0, 4.0, 5.0], vec![6.0, 7.0, 8.0]];
    /// let mut shard = vec![f32::NAN; 3];
    /// layout.flatten_shard_into(&params, 1, &mut shard)?;
    /// assert_eq!(shard, [4.0, 5.0, 6.0]);
    /// layout.flatten_shard_into(&params, 2, &mut shard)?;
    /// assert_eq!(shard, [7.0, 8.0, 0.0]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`], [`LayoutError::ParamCountMismatch`],
    /// [`LayoutError::ParamLenMismatch`], [`LayoutError::ShardLenMismatch`].
    pub fn flatten_shard_into<T, P>(&self, params: &[P], rank: usize, out: &mut [T]) -> Result<()>
    where
        T: bytemuck::Pod,
        P: AsRef<[T]>,
    {
        const OP: &str = "flatten_shard_into";
        self.check_rank(OP, rank)?;
        self.check_params(OP, params)?;
        self.check_shard_len(OP, rank, out.len())?;
        let shard = self.shard(rank)?;
        for piece in shard.pieces() {
            out[piece.shard_range()]
                .copy_from_slice(&params[piece.param_index].as_ref()[piece.param_range()]);
        }
        bytemuck::fill_zeroes(&mut out[shard.padding_range_in_shard()]);
        Ok(())
    }

    /// Splits a flat buffer into one view per parameter, without copying.
    ///
    /// `flat` may be the padded flat parameter ([`padded_numel`](Self::padded_numel) long) or
    /// the unpadded concatenation ([`total_numel`](Self::total_numel) long); the padding is not
    /// part of any view. A view is the parameter flattened in row-major order; its shape is
    /// [`param(i)?.shape()`](crate::ParamInfo::shape).
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![2, 2], vec![2]], 4)?;
    /// let flat = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0];
    /// let views = layout.unflatten(&flat)?;
    /// assert_eq!(views, [&[1.0, 2.0, 3.0, 4.0][..], &[5.0, 6.0][..]]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::FlatLenMismatch`].
    pub fn unflatten<'a, T: bytemuck::Pod>(&self, flat: &'a [T]) -> Result<Vec<&'a [T]>> {
        self.check_flat_len("unflatten", flat.len(), true)?;
        Ok(self
            .params()
            .iter()
            .map(|p| &flat[p.flat_range()])
            .collect())
    }

    /// Mutable variant of [`unflatten`](Self::unflatten): one disjoint mutable view per
    /// parameter.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![2], vec![1]], 2)?;
    /// let mut flat = vec![0.0f32; 4];
    /// let mut views = layout.unflatten_mut(&mut flat)?;
    /// views[1][0] = 7.0;
    /// views[0].fill(1.0);
    /// assert_eq!(flat, [1.0, 1.0, 7.0, 0.0]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::FlatLenMismatch`].
    pub fn unflatten_mut<'a, T: bytemuck::Pod>(
        &self,
        flat: &'a mut [T],
    ) -> Result<Vec<&'a mut [T]>> {
        self.check_flat_len("unflatten_mut", flat.len(), true)?;
        let mut rest = flat;
        let mut views = Vec::with_capacity(self.num_params());
        // Parameters are contiguous and in order, so peel them off the front one by one.
        for p in self.params() {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(p.numel());
            views.push(head);
            rest = tail;
        }
        Ok(views)
    }

    /// Rank `rank`'s shard of the padded flat parameter, as a view.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![5]], 3)?; // padded 6, chunk 2
    /// let flat = [1, 2, 3, 4, 5, 0];
    /// assert_eq!(layout.shard_of(&flat, 2)?, &[5, 0]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`]; [`LayoutError::FlatLenMismatch`] unless
    /// `flat.len() == padded_numel()`.
    pub fn shard_of<'a, T: bytemuck::Pod>(&self, flat: &'a [T], rank: usize) -> Result<&'a [T]> {
        const OP: &str = "shard_of";
        self.check_rank(OP, rank)?;
        self.check_flat_len(OP, flat.len(), false)?;
        Ok(&flat[self.interval_unchecked(rank)])
    }

    /// Mutable variant of [`shard_of`](Self::shard_of).
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`]; [`LayoutError::FlatLenMismatch`] unless
    /// `flat.len() == padded_numel()`.
    pub fn shard_of_mut<'a, T: bytemuck::Pod>(
        &self,
        flat: &'a mut [T],
        rank: usize,
    ) -> Result<&'a mut [T]> {
        const OP: &str = "shard_of_mut";
        self.check_rank(OP, rank)?;
        self.check_flat_len(OP, flat.len(), false)?;
        Ok(&mut flat[self.interval_unchecked(rank)])
    }

    /// Splits rank `rank`'s shard into its parameter pieces, each with its view: what
    /// per-parameter math on a sharded flat parameter (per-parameter gradient norms, a sharded
    /// state dict) needs. Padding is not part of any view.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![5], vec![3]], 2)?; // chunk 4
    /// let shard1 = [5.0f32, 6.0, 7.0, 8.0];
    /// let parts = layout.split_shard(&shard1, 1)?;
    /// assert_eq!(parts.len(), 2);
    /// assert_eq!((parts[0].0.param_index, parts[0].1), (0, &[5.0][..]));
    /// assert_eq!((parts[1].0.param_index, parts[1].1), (1, &[6.0, 7.0, 8.0][..]));
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`], [`LayoutError::ShardLenMismatch`].
    pub fn split_shard<'a, T: bytemuck::Pod>(
        &self,
        shard: &'a [T],
        rank: usize,
    ) -> Result<Vec<(ParamPiece, &'a [T])>> {
        const OP: &str = "split_shard";
        self.check_rank(OP, rank)?;
        self.check_shard_len(OP, rank, shard.len())?;
        Ok(self
            .rank_pieces(rank)?
            .into_iter()
            .map(|piece| (piece, &shard[piece.shard_range()]))
            .collect())
    }

    /// Mutable variant of [`split_shard`](Self::split_shard): one disjoint mutable view per
    /// piece.
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`], [`LayoutError::ShardLenMismatch`].
    pub fn split_shard_mut<'a, T: bytemuck::Pod>(
        &self,
        shard: &'a mut [T],
        rank: usize,
    ) -> Result<Vec<(ParamPiece, &'a mut [T])>> {
        const OP: &str = "split_shard_mut";
        self.check_rank(OP, rank)?;
        self.check_shard_len(OP, rank, shard.len())?;
        let pieces = self.rank_pieces(rank)?;
        let mut out = Vec::with_capacity(pieces.len());
        let mut rest = shard;
        let mut consumed = 0;
        // Pieces are in shard order and contiguous (padding only at the tail).
        for piece in pieces {
            let skip = piece.offset_in_shard - consumed;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
            let (head, tail) = tail.split_at_mut(piece.len);
            out.push((piece, head));
            rest = tail;
            consumed = piece.offset_in_shard + piece.len;
        }
        Ok(out)
    }

    fn check_params<T, P: AsRef<[T]>>(&self, op: &'static str, params: &[P]) -> Result<()> {
        if params.len() != self.num_params() {
            return Err(LayoutError::ParamCountMismatch {
                op,
                expected: self.num_params(),
                got: params.len(),
            });
        }
        for (param_index, (p, info)) in params.iter().zip(self.params()).enumerate() {
            let got = p.as_ref().len();
            if got != info.numel() {
                return Err(LayoutError::ParamLenMismatch {
                    op,
                    param_index,
                    expected: info.numel(),
                    got,
                    shape: info.shape().to_vec(),
                });
            }
        }
        Ok(())
    }

    fn check_flat_len(&self, op: &'static str, got: usize, allow_unpadded: bool) -> Result<()> {
        if got == self.padded_numel() || (allow_unpadded && got == self.total_numel()) {
            Ok(())
        } else {
            Err(LayoutError::FlatLenMismatch {
                op,
                got,
                padded_numel: self.padded_numel(),
                total_numel: self.total_numel(),
                accepted: if allow_unpadded {
                    PADDED_OR_TOTAL
                } else {
                    PADDED_ONLY
                },
            })
        }
    }

    fn check_shard_len(&self, op: &'static str, rank: usize, got: usize) -> Result<()> {
        if got == self.chunk_numel() {
            Ok(())
        } else {
            Err(LayoutError::ShardLenMismatch {
                op,
                rank,
                expected: self.chunk_numel(),
                got,
            })
        }
    }
}
