//! The flatten-concat-chunk layout: where each parameter lives in the flat parameter and which
//! rank holds which part of it.

use std::ops::Range;

use crate::error::{LayoutError, Result};

/// One original parameter's place in the flat parameter.
///
/// ```
/// use fsdp_flatparam::FlatParamLayout;
///
/// let layout = FlatParamLayout::new(&[vec![3, 4], vec![3]], 16)?;
/// let bias = layout.param(1)?;
/// assert_eq!(bias.shape(), &[3]);
/// assert_eq!(bias.numel(), 3);
/// assert_eq!(bias.offset(), 12);
/// assert_eq!(bias.flat_range(), 12..15);
/// # Ok::<(), fsdp_flatparam::LayoutError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ParamInfo {
    shape: Vec<usize>,
    numel: usize,
    offset: usize,
}

impl ParamInfo {
    /// The parameter's shape, as given to [`FlatParamLayout::new`].
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements: the product of the shape's dimensions (1 for the scalar shape `[]`,
    /// 0 when any dimension is 0).
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Offset of the parameter's first element in the flat parameter.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The parameter's elements in the flat parameter: `offset..offset + numel`.
    pub fn flat_range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The part of one original parameter that one rank holds.
///
/// The piece's elements are `shard[offset_in_shard..offset_in_shard + len]` of rank `rank`'s
/// shard, and they are elements `offset_in_param..offset_in_param + len` of parameter
/// `param_index` flattened in row-major order. A rank's piece of a parameter is always one
/// contiguous run, because each parameter is contiguous in the flat parameter and each shard is a
/// contiguous chunk of it.
///
/// The methods that return pieces ([`FlatParamLayout::rank_pieces`],
/// [`FlatParamLayout::param_pieces`], [`RankShard::pieces`]) **omit empty pieces**: a piece they
/// return always has `len > 0`. [`FlatParamLayout::piece`] returns `None` where a rank holds
/// nothing of a parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParamPiece {
    /// The rank that holds the piece.
    pub rank: usize,
    /// Index of the original parameter.
    pub param_index: usize,
    /// Offset of the piece's first element in the rank's shard.
    pub offset_in_shard: usize,
    /// Offset of the piece's first element inside the (row-major flattened) parameter.
    pub offset_in_param: usize,
    /// Number of elements.
    pub len: usize,
}

impl ParamPiece {
    /// The piece's elements in the rank's shard.
    pub fn shard_range(&self) -> Range<usize> {
        self.offset_in_shard..self.offset_in_shard + self.len
    }

    /// The piece's elements in the flattened parameter.
    pub fn param_range(&self) -> Range<usize> {
        self.offset_in_param..self.offset_in_param + self.len
    }

    /// Whether the piece has no elements (never true for pieces this crate returns).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Everything about one rank's shard: its flat interval, the parameter pieces it holds and its
/// padding. Built by [`FlatParamLayout::shard`].
///
/// ```
/// use fsdp_flatparam::FlatParamLayout;
///
/// // 10 elements on 4 ranks: padded to 12, chunk 3.
/// let layout = FlatParamLayout::new(&[vec![6], vec![4]], 4)?;
/// let s = layout.shard(1)?;
/// assert_eq!(s.flat_range(), 3..6);
/// assert_eq!(s.pieces().len(), 1);
/// assert_eq!(s.pieces()[0].param_range(), 3..6);
/// let last = layout.shard(3)?;
/// assert_eq!(last.flat_range(), 9..12);
/// assert_eq!(last.padding_numel(), 2);
/// assert_eq!(last.padding_range_in_shard(), 1..3);
/// # Ok::<(), fsdp_flatparam::LayoutError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RankShard {
    rank: usize,
    flat_range: Range<usize>,
    pieces: Vec<ParamPiece>,
    padding_range_in_shard: Range<usize>,
}

impl RankShard {
    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The rank's chunk of the padded flat parameter: `rank * chunk..(rank + 1) * chunk`.
    pub fn flat_range(&self) -> Range<usize> {
        self.flat_range.clone()
    }

    /// Number of elements in the shard (the layout's chunk numel).
    pub fn numel(&self) -> usize {
        self.flat_range.len()
    }

    /// The non-empty parameter pieces the rank holds, in parameter order (which is also their
    /// order in the shard).
    pub fn pieces(&self) -> &[ParamPiece] {
        &self.pieces
    }

    /// Number of padding elements in the shard.
    pub fn padding_numel(&self) -> usize {
        self.padding_range_in_shard.len()
    }

    /// The padding elements in shard coordinates. Padding sits at the end of the flat parameter,
    /// so it is always the tail of a shard (empty range `numel..numel` when there is none).
    pub fn padding_range_in_shard(&self) -> Range<usize> {
        self.padding_range_in_shard.clone()
    }
}

/// The flatten-concat-chunk layout of one FSDP unit's parameters: a pure function of the
/// parameters' shapes and the sharding factor `F`.
///
/// The flat parameter is the row-major flattening of every parameter, concatenated in the order
/// given, then padded on the right with the fewest zeros (at most `F - 1`) that make its length a
/// multiple of `F`. It is cut into `F` equal chunks; rank `r` holds chunk `r`.
///
/// # Shapes
/// [`new`](Self::new) takes a slice of anything that is `AsRef<[usize]>`: `&[Vec<usize>]`,
/// `&[&[usize]]` or `&[[usize; N]]` all work. A shape's numel is the product of its dimensions,
/// so the scalar shape `[]` has one element and any zero dimension gives an empty parameter.
///
/// # Empty layouts
/// Zero-sized parameters are legal and take no room. If *all* parameters are empty (or there
/// are none), the total, padded and chunk numels are all 0: every rank's interval is empty and
/// every flat or shard buffer has length 0. This is consistent (0 is the smallest multiple of
/// `F` that is at least 0) and lets callers treat such a unit uniformly; a runtime that wants to
/// skip communication for it can test [`chunk_numel`](Self::chunk_numel)` == 0`.
///
/// # Example: the paper's Figure 3
/// A 4×3 `nn.Linear` (in = 4, out = 3: weight `[3, 4]`, bias `[3]`, 15 elements) sharded across
/// 16 ranks: every rank holds one element and the last rank holds the one padding element.
///
/// ```
/// use fsdp_flatparam::FlatParamLayout;
///
/// let layout = FlatParamLayout::new(&[vec![3, 4], vec![3]], 16)?;
/// assert_eq!(layout.total_numel(), 15);
/// assert_eq!(layout.padded_numel(), 16);
/// assert_eq!(layout.chunk_numel(), 1);
/// assert_eq!(layout.rank_interval(13)?, 13..14);
///
/// // Rank 13 holds element 1 of the bias.
/// let pieces = layout.rank_pieces(13)?;
/// assert_eq!(pieces.len(), 1);
/// assert_eq!((pieces[0].param_index, pieces[0].offset_in_param), (1, 1));
///
/// // Rank 15 holds only padding.
/// let last = layout.shard(15)?;
/// assert!(last.pieces().is_empty());
/// assert_eq!(last.padding_numel(), 1);
/// # Ok::<(), fsdp_flatparam::LayoutError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FlatParamLayout {
    params: Vec<ParamInfo>,
    total_numel: usize,
    padded_numel: usize,
    sharding_factor: usize,
    chunk_numel: usize,
}

impl FlatParamLayout {
    /// Computes the layout of parameters with the given shapes, in the given order, sharded
    /// across `sharding_factor` ranks.
    ///
    /// # Errors
    /// [`LayoutError::ZeroShardingFactor`] if `sharding_factor == 0`;
    /// [`LayoutError::ParamNumelOverflow`], [`LayoutError::TotalNumelOverflow`] or
    /// [`LayoutError::PaddedNumelOverflow`] if a numel does not fit in `usize`.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// // Shapes may be given as Vecs, slices or arrays.
    /// let a = FlatParamLayout::new(&[vec![2, 3], vec![3]], 4)?;
    /// let b = FlatParamLayout::new(&[&[2usize, 3][..], &[3][..]], 4)?;
    /// assert_eq!(a, b);
    /// assert_eq!(a.total_numel(), 9);
    /// assert_eq!(a.padded_numel(), 12);
    /// assert_eq!(a.padding_numel(), 3);
    /// assert_eq!(a.chunk_numel(), 3);
    /// assert_eq!(a.param(1)?.offset(), 6);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    pub fn new<S: AsRef<[usize]>>(shapes: &[S], sharding_factor: usize) -> Result<Self> {
        if sharding_factor == 0 {
            return Err(LayoutError::ZeroShardingFactor);
        }
        let mut params = Vec::with_capacity(shapes.len());
        let mut total: usize = 0;
        for (param_index, shape) in shapes.iter().enumerate() {
            let shape = shape.as_ref();
            // The mathematical product: a zero dimension makes the numel 0 even when the
            // product of the other dimensions would overflow.
            let numel = if shape.contains(&0) {
                0
            } else {
                shape
                    .iter()
                    .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                    .ok_or_else(|| LayoutError::ParamNumelOverflow {
                        param_index,
                        shape: shape.to_vec(),
                    })?
            };
            let offset = total;
            total = total
                .checked_add(numel)
                .ok_or(LayoutError::TotalNumelOverflow {
                    param_index,
                    running_total: total,
                    numel,
                })?;
            params.push(ParamInfo {
                shape: shape.to_vec(),
                numel,
                offset,
            });
        }
        let chunk_numel = total.div_ceil(sharding_factor);
        let padded_numel =
            chunk_numel
                .checked_mul(sharding_factor)
                .ok_or(LayoutError::PaddedNumelOverflow {
                    total_numel: total,
                    sharding_factor,
                })?;
        Ok(Self {
            params,
            total_numel: total,
            padded_numel,
            sharding_factor,
            chunk_numel,
        })
    }

    /// Number of original parameters.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    /// Every parameter's shape, numel and offset, in layout order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// One parameter's shape, numel and offset.
    ///
    /// # Errors
    /// [`LayoutError::ParamIndexOutOfRange`] if `param_index >= num_params()`.
    pub fn param(&self, param_index: usize) -> Result<&ParamInfo> {
        self.check_param("param", param_index)
    }

    /// Sum of the parameters' numels (Ψ in the paper), without padding.
    pub fn total_numel(&self) -> usize {
        self.total_numel
    }

    /// Numel of the flat parameter: the smallest multiple of the sharding factor that is at least
    /// [`total_numel`](Self::total_numel).
    pub fn padded_numel(&self) -> usize {
        self.padded_numel
    }

    /// Number of padding elements at the end of the flat parameter (at most `F - 1`).
    pub fn padding_numel(&self) -> usize {
        self.padded_numel - self.total_numel
    }

    /// The sharding factor `F`: the number of ranks (chunks) the flat parameter is split across.
    pub fn sharding_factor(&self) -> usize {
        self.sharding_factor
    }

    /// Numel of each rank's shard: `padded_numel / F`.
    pub fn chunk_numel(&self) -> usize {
        self.chunk_numel
    }

    /// Rank `rank`'s chunk of the padded flat parameter: `rank * chunk..(rank + 1) * chunk`.
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] if `rank >= sharding_factor()`.
    pub fn rank_interval(&self, rank: usize) -> Result<Range<usize>> {
        self.check_rank("rank_interval", rank)?;
        Ok(self.interval_unchecked(rank))
    }

    /// Number of padding elements rank `rank` holds (always at the tail of its shard).
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] if `rank >= sharding_factor()`.
    pub fn rank_padding_numel(&self, rank: usize) -> Result<usize> {
        self.check_rank("rank_padding_numel", rank)?;
        Ok(self.padding_in_shard_unchecked(rank).len())
    }

    /// The non-empty pieces of original parameters that rank `rank` holds, in parameter order.
    ///
    /// ```
    /// use fsdp_flatparam::{FlatParamLayout, ParamPiece};
    ///
    /// // Params of 5 and 3 elements on 2 ranks: chunk 4.
    /// let layout = FlatParamLayout::new(&[vec![5], vec![3]], 2)?;
    /// assert_eq!(
    ///     layout.rank_pieces(1)?,
    ///     vec![
    ///         ParamPiece { rank: 1, param_index: 0, offset_in_shard: 0, offset_in_param: 4, len: 1 },
    ///         ParamPiece { rank: 1, param_index: 1, offset_in_shard: 1, offset_in_param: 0, len: 3 },
    ///     ]
    /// );
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] if `rank >= sharding_factor()`.
    pub fn rank_pieces(&self, rank: usize) -> Result<Vec<ParamPiece>> {
        self.check_rank("rank_pieces", rank)?;
        Ok(self.pieces_unchecked(rank))
    }

    /// Everything about rank `rank`'s shard: interval, pieces and padding.
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] if `rank >= sharding_factor()`.
    pub fn shard(&self, rank: usize) -> Result<RankShard> {
        self.check_rank("shard", rank)?;
        Ok(RankShard {
            rank,
            flat_range: self.interval_unchecked(rank),
            pieces: self.pieces_unchecked(rank),
            padding_range_in_shard: self.padding_in_shard_unchecked(rank),
        })
    }

    /// The piece of parameter `param_index` that rank `rank` holds, or `None` if it holds none
    /// of it.
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] or [`LayoutError::ParamIndexOutOfRange`].
    pub fn piece(&self, rank: usize, param_index: usize) -> Result<Option<ParamPiece>> {
        self.check_rank("piece", rank)?;
        let info = self.check_param("piece", param_index)?;
        Ok(self.piece_unchecked(rank, param_index, info))
    }

    /// The ranks that hold some of parameter `param_index`, as a range (empty for a zero-sized
    /// parameter).
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![5], vec![0], vec![3]], 2)?;
    /// assert_eq!(layout.param_ranks(0)?, 0..2);
    /// assert_eq!(layout.param_ranks(1)?.len(), 0);
    /// assert_eq!(layout.param_ranks(2)?, 1..2);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::ParamIndexOutOfRange`] if `param_index >= num_params()`.
    pub fn param_ranks(&self, param_index: usize) -> Result<Range<usize>> {
        let info = self.check_param("param_ranks", param_index)?;
        Ok(self.ranks_of(info))
    }

    /// The reverse map: the non-empty pieces of parameter `param_index`, one per rank that holds
    /// some of it, in rank order. Their `param_range`s tile `0..numel` exactly once.
    ///
    /// ```
    /// use fsdp_flatparam::FlatParamLayout;
    ///
    /// let layout = FlatParamLayout::new(&[vec![5], vec![3]], 2)?;
    /// let pieces = layout.param_pieces(0)?;
    /// let spans: Vec<_> = pieces.iter().map(|p| (p.rank, p.param_range())).collect();
    /// assert_eq!(spans, vec![(0, 0..4), (1, 4..5)]);
    /// # Ok::<(), fsdp_flatparam::LayoutError>(())
    /// ```
    ///
    /// # Errors
    /// [`LayoutError::ParamIndexOutOfRange`] if `param_index >= num_params()`.
    pub fn param_pieces(&self, param_index: usize) -> Result<Vec<ParamPiece>> {
        let info = self.check_param("param_pieces", param_index)?;
        Ok(self
            .ranks_of(info)
            .filter_map(|rank| self.piece_unchecked(rank, param_index, info))
            .collect())
    }

    pub(crate) fn check_rank(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank < self.sharding_factor {
            Ok(())
        } else {
            Err(LayoutError::RankOutOfRange {
                op,
                rank,
                sharding_factor: self.sharding_factor,
            })
        }
    }

    fn check_param(&self, op: &'static str, param_index: usize) -> Result<&ParamInfo> {
        self.params
            .get(param_index)
            .ok_or(LayoutError::ParamIndexOutOfRange {
                op,
                param_index,
                num_params: self.params.len(),
            })
    }

    /// `rank < F` must hold; then `(rank + 1) * chunk <= padded_numel` cannot overflow.
    pub(crate) fn interval_unchecked(&self, rank: usize) -> Range<usize> {
        let lo = rank * self.chunk_numel;
        lo..lo + self.chunk_numel
    }

    fn padding_in_shard_unchecked(&self, rank: usize) -> Range<usize> {
        let Range { start: lo, end: hi } = self.interval_unchecked(rank);
        let pad_start = self.total_numel.clamp(lo, hi);
        (pad_start - lo)..(hi - lo)
    }

    fn pieces_unchecked(&self, rank: usize) -> Vec<ParamPiece> {
        let Range { start: lo, end: hi } = self.interval_unchecked(rank);
        // Parameter ends are non-decreasing, so the first parameter reaching past `lo` is found
        // by binary search; then walk forward while parameters start before `hi`.
        let first = self.params.partition_point(|p| p.offset + p.numel <= lo);
        self.params[first..]
            .iter()
            .enumerate()
            .take_while(|(_, p)| p.offset < hi)
            .filter_map(|(i, p)| self.piece_unchecked(rank, first + i, p))
            .collect()
    }

    fn piece_unchecked(
        &self,
        rank: usize,
        param_index: usize,
        p: &ParamInfo,
    ) -> Option<ParamPiece> {
        let Range { start: lo, end: hi } = self.interval_unchecked(rank);
        let start = p.offset.max(lo);
        let end = (p.offset + p.numel).min(hi);
        (start < end).then(|| ParamPiece {
            rank,
            param_index,
            offset_in_shard: start - lo,
            offset_in_param: start - p.offset,
            len: end - start,
        })
    }

    fn ranks_of(&self, p: &ParamInfo) -> Range<usize> {
        if p.numel == 0 {
            // chunk_numel may be 0 here; an empty parameter is held by no rank.
            return 0..0;
        }
        // numel > 0 implies total > 0, hence chunk_numel > 0.
        let first = p.offset / self.chunk_numel;
        let last = (p.offset + p.numel - 1) / self.chunk_numel;
        first..last + 1
    }
}
