//! Property tests for the flatten-concat-chunk layout (256 cases each).
//!
//! Shapes include zero-sized and one-element (scalar and `[1]`) parameters, the sharding factor
//! ranges over 1..=64, and many cases have fewer elements than ranks. Expected values come from a
//! plain reference (element-by-element enumeration of the concatenation), not from the layout.

use fsdp_flatparam::{bf16, FlatParamLayout, ParamPiece};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(256)
}

/// One dimension: often 0 or 1, otherwise small.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![2 => Just(0usize), 3 => Just(1usize), 6 => 2..7usize, 1 => 7..24usize]
}

/// A shape of rank 0..=3 (rank 0 is a scalar with one element).
fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        4 => prop::collection::vec(dim(), 0..=3),
        1 => (1..600usize).prop_map(|n| vec![n]),
    ]
}

fn shapes() -> impl Strategy<Value = Vec<Vec<usize>>> {
    prop_oneof![
        // Tiny units: total numel usually smaller than F.
        1 => prop::collection::vec(prop::collection::vec(0..=2usize, 0..=2), 0..4),
        3 => prop::collection::vec(shape(), 0..8),
    ]
}

fn case() -> impl Strategy<Value = (Vec<Vec<usize>>, usize)> {
    (shapes(), 1..=64usize)
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Distinct, non-zero values per (parameter, element), so misplacements are visible.
fn make_params(shapes: &[Vec<usize>]) -> Vec<Vec<f32>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            (0..numel(s))
                .map(|j| (i * 100_000 + j + 1) as f32)
                .collect()
        })
        .collect()
}

/// Reference: for every element of the padded flat parameter, `Some((param, element))` or
/// `None` for padding, by plain enumeration.
fn reference_owner(shapes: &[Vec<usize>], f: usize) -> Vec<Option<(usize, usize)>> {
    let mut v = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        for j in 0..numel(s) {
            v.push(Some((i, j)));
        }
    }
    while v.len() % f != 0 {
        v.push(None);
    }
    v
}

proptest! {
    #![proptest_config(config())]

    /// Chunks of all ranks are disjoint, equal-sized, and their union is the padded flat.
    #[test]
    fn chunks_partition_padded_flat((shapes, f) in case()) {
        let layout = FlatParamLayout::new(&shapes, f).unwrap();
        let padded = layout.padded_numel();
        prop_assert_eq!(layout.sharding_factor(), f);
        prop_assert_eq!(layout.chunk_numel() * f, padded);
        let mut cover = vec![0u32; padded];
        for rank in 0..f {
            let iv = layout.rank_interval(rank).unwrap();
            prop_assert_eq!(iv.len(), layout.chunk_numel());
            prop_assert_eq!(layout.shard(rank).unwrap().flat_range(), iv.clone());
            prop_assert!(iv.end <= padded);
            for k in iv {
                cover[k] += 1;
            }
        }
        prop_assert!(cover.iter().all(|&c| c == 1), "coverage {:?}", cover);
        prop_assert!(layout.rank_interval(f).is_err());
    }

    /// Padding is at most F - 1 and the padded numel is the smallest multiple of F >= total.
    #[test]
    fn padding_bound((shapes, f) in case()) {
        let layout = FlatParamLayout::new(&shapes, f).unwrap();
        let total: usize = shapes.iter().map(|s| numel(s)).sum();
        prop_assert_eq!(layout.total_numel(), total);
        prop_assert_eq!(layout.padded_numel() % f, 0);
        prop_assert!(layout.padded_numel() >= total);
        prop_assert!(layout.padding_numel() < f);
        prop_assert_eq!(layout.padding_numel(), layout.padded_numel() - total);
        // Per-rank padding adds up to the total padding, and matches the reference.
        let owner = reference_owner(&shapes, f);
        prop_assert_eq!(owner.len(), layout.padded_numel());
        let mut sum = 0;
        for rank in 0..f {
            let s = layout.shard(rank).unwrap();
            let expect = owner[s.flat_range()].iter().filter(|o| o.is_none()).count();
            prop_assert_eq!(s.padding_numel(), expect);
            prop_assert_eq!(layout.rank_padding_numel(rank).unwrap(), expect);
            prop_assert_eq!(s.padding_range_in_shard().end, s.numel());
            sum += expect;
        }
        prop_assert_eq!(sum, layout.padding_numel());
        // Per-parameter numels and offsets match the concatenation.
        let mut off = 0;
        for (i, s) in shapes.iter().enumerate() {
            let p = layout.param(i).unwrap();
            prop_assert_eq!(p.shape(), &s[..]);
            prop_assert_eq!(p.numel(), numel(s));
            prop_assert_eq!(p.offset(), off);
            off += numel(s);
        }
    }

    /// flatten -> unflatten returns every parameter unchanged; padding is zero.
    #[test]
    fn flatten_unflatten_roundtrip((shapes, f) in case()) {
        let layout = FlatParamLayout::new(&shapes, f).unwrap();
        let params = make_params(&shapes);
        let mut flat = vec![f32::NAN; layout.padded_numel()];
        layout.flatten_into(&params, &mut flat).unwrap();
        prop_assert!(flat[layout.total_numel()..].iter().all(|&x| x == 0.0));
        let views = layout.unflatten(&flat).unwrap();
        prop_assert_eq!(views.len(), params.len());
        for (v, p) in views.iter().zip(&params) {
            prop_assert_eq!(*v, &p[..]);
        }
        // The unpadded prefix unflattens to the same views.
        let views2 = layout.unflatten(&flat[..layout.total_numel()]).unwrap();
        prop_assert_eq!(views2, views);
        // Mutable views write through to the same places.
        let mut flat2 = vec![0.0f32; layout.padded_numel()];
        for (v, p) in layout.unflatten_mut(&mut flat2).unwrap().into_iter().zip(&params) {
            v.copy_from_slice(p);
        }
        prop_assert_eq!(flat2, layout.flatten(&params).unwrap());
    }

    /// flatten -> shard for every rank -> concat in rank order -> unflatten returns every
    /// parameter unchanged (this is the all-gather path), for f32 and bf16.
    #[test]
    fn shard_gather_roundtrip((shapes, f) in case()) {
        let layout = FlatParamLayout::new(&shapes, f).unwrap();
        let params = make_params(&shapes);
        let flat = layout.flatten(&params).unwrap();
        let mut gathered = Vec::with_capacity(layout.padded_numel());
        let mut direct = vec![f32::NAN; layout.chunk_numel()];
        for rank in 0..f {
            let shard = layout.shard_of(&flat, rank).unwrap();
            prop_assert_eq!(shard.len(), layout.chunk_numel());
            // Building the shard straight from the parameters gives the same elements.
            layout.flatten_shard_into(&params, rank, &mut direct).unwrap();
            prop_assert_eq!(&direct[..], shard);
            gathered.extend_from_slice(shard);
        }
        prop_assert_eq!(&gathered, &flat);
        for (v, p) in layout.unflatten(&gathered).unwrap().iter().zip(&params) {
            prop_assert_eq!(*v, &p[..]);
        }

        // Same path with a 16-bit element type.
        let low: Vec<Vec<bf16>> = params
            .iter()
            .map(|p| p.iter().map(|&x| bf16::from_f32(x)).collect())
            .collect();
        let flat_low = layout.flatten(&low).unwrap();
        let mut gathered_low = Vec::new();
        for rank in 0..f {
            gathered_low.extend_from_slice(layout.shard_of(&flat_low, rank).unwrap());
        }
        for (v, p) in layout.unflatten(&gathered_low).unwrap().iter().zip(&low) {
            prop_assert_eq!(*v, &p[..]);
        }
    }

    /// The per-rank pieces of each parameter tile it exactly once, agree with the reference
    /// owner map, with the reverse map, and with the data in the shards.
    #[test]
    fn pieces_tile_each_param_once((shapes, f) in case()) {
        let layout = FlatParamLayout::new(&shapes, f).unwrap();
        let owner = reference_owner(&shapes, f);
        let params = make_params(&shapes);
        let flat = layout.flatten(&params).unwrap();
        let chunk = layout.chunk_numel();
        let mut cover: Vec<Vec<u32>> = shapes.iter().map(|s| vec![0; numel(s)]).collect();
        let mut by_param: Vec<Vec<ParamPiece>> = vec![Vec::new(); shapes.len()];
        for rank in 0..f {
            let pieces = layout.rank_pieces(rank).unwrap();
            prop_assert_eq!(&pieces, &layout.shard(rank).unwrap().pieces().to_vec());
            let shard = layout.shard_of(&flat, rank).unwrap();
            let mut last_param = None;
            for pc in &pieces {
                prop_assert!(pc.len > 0);
                prop_assert_eq!(pc.rank, rank);
                prop_assert!(pc.shard_range().end <= chunk);
                prop_assert!(last_param < Some(pc.param_index), "pieces not in param order");
                last_param = Some(pc.param_index);
                // Reference: each element of the piece is owned by this param at this offset.
                for k in 0..pc.len {
                    let flat_pos = rank * chunk + pc.offset_in_shard + k;
                    prop_assert_eq!(owner[flat_pos], Some((pc.param_index, pc.offset_in_param + k)));
                    cover[pc.param_index][pc.offset_in_param + k] += 1;
                }
                prop_assert_eq!(&shard[pc.shard_range()], &params[pc.param_index][pc.param_range()]);
                prop_assert_eq!(layout.piece(rank, pc.param_index).unwrap(), Some(*pc));
                by_param[pc.param_index].push(*pc);
            }
            // Every non-padding element of the shard belongs to some piece.
            let held: usize = pieces.iter().map(|p| p.len).sum();
            prop_assert_eq!(held + layout.rank_padding_numel(rank).unwrap(), chunk);
            // Ranks holding nothing of a parameter report None.
            for i in 0..shapes.len() {
                if !pieces.iter().any(|p| p.param_index == i) {
                    prop_assert_eq!(layout.piece(rank, i).unwrap(), None);
                }
            }
            // split_shard gives the same pieces with the right views, split_shard_mut too.
            let split = layout.split_shard(shard, rank).unwrap();
            prop_assert_eq!(split.len(), pieces.len());
            for ((pc, view), expect) in split.iter().zip(&pieces) {
                prop_assert_eq!(pc, expect);
                prop_assert_eq!(*view, &shard[pc.shard_range()]);
            }
            let mut shard_copy = shard.to_vec();
            for (pc, view) in layout.split_shard_mut(&mut shard_copy, rank).unwrap() {
                prop_assert_eq!(view.len(), pc.len);
                view.fill(-1.0);
            }
            for (k, x) in shard_copy.iter().enumerate() {
                let in_piece = pieces.iter().any(|p| p.shard_range().contains(&k));
                prop_assert_eq!(*x == -1.0, in_piece);
            }
        }
        for (i, c) in cover.iter().enumerate() {
            prop_assert!(c.iter().all(|&n| n == 1), "param {} covered {:?}", i, c);
            // The reverse map lists the same pieces in rank order.
            prop_assert_eq!(&layout.param_pieces(i).unwrap(), &by_param[i]);
            let ranks: Vec<usize> = by_param[i].iter().map(|p| p.rank).collect();
            prop_assert_eq!(ranks, layout.param_ranks(i).unwrap().collect::<Vec<_>>());
        }
    }

    /// f32 -> f16/bf16 -> f32 agrees with the scalar conversions of `half`.
    #[test]
    fn casts_match_scalar_reference(v in prop::collection::vec(any::<f32>(), 0..300)) {
        use fsdp_flatparam::{cast_f32_to_half_into, cast_half_to_f32_into, f16};
        let mut h = vec![f16::ZERO; v.len()];
        cast_f32_to_half_into(&v, &mut h).unwrap();
        let mut b = vec![bf16::ZERO; v.len()];
        cast_f32_to_half_into(&v, &mut b).unwrap();
        let mut back_h = vec![0.0f32; v.len()];
        cast_half_to_f32_into(&h, &mut back_h).unwrap();
        let mut back_b = vec![0.0f32; v.len()];
        cast_half_to_f32_into(&b, &mut back_b).unwrap();
        for i in 0..v.len() {
            prop_assert_eq!(h[i].to_bits(), f16::from_f32(v[i]).to_bits());
            prop_assert_eq!(b[i].to_bits(), bf16::from_f32(v[i]).to_bits());
            prop_assert_eq!(back_h[i].to_bits(), h[i].to_f32().to_bits());
            prop_assert_eq!(back_b[i].to_bits(), b[i].to_f32().to_bits());
        }
    }
}
