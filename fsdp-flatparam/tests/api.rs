//! Fixed-case tests: the paper's example, edge cases and every error path.

use fsdp_flatparam::{
    bf16, cast_f32_to_half_into, cast_half_to_f32_into, f16, FlatParamLayout, LayoutError,
    ParamPiece,
};

/// The paper's Figure 3: a 4x3 `nn.Linear` (in 4, out 3: weight [3, 4] = 12 elements, bias 3)
/// on 16 ranks. One element per rank; the last rank holds the padding.
#[test]
fn paper_example_linear_4x3_on_16_ranks() {
    let layout = FlatParamLayout::new(&[vec![3, 4], vec![3]], 16).unwrap();
    assert_eq!(layout.total_numel(), 15);
    assert_eq!(layout.padded_numel(), 16);
    assert_eq!(layout.padding_numel(), 1);
    assert_eq!(layout.chunk_numel(), 1);
    for rank in 0..16 {
        let s = layout.shard(rank).unwrap();
        assert_eq!(s.flat_range(), rank..rank + 1);
        if rank < 12 {
            assert_eq!(
                s.pieces(),
                &[ParamPiece {
                    rank,
                    param_index: 0,
                    offset_in_shard: 0,
                    offset_in_param: rank,
                    len: 1
                }]
            );
            assert_eq!(s.padding_numel(), 0);
        } else if rank < 15 {
            assert_eq!(
                s.pieces(),
                &[ParamPiece {
                    rank,
                    param_index: 1,
                    offset_in_shard: 0,
                    offset_in_param: rank - 12,
                    len: 1
                }]
            );
            assert_eq!(s.padding_numel(), 0);
        } else {
            assert!(s.pieces().is_empty());
            assert_eq!(s.padding_numel(), 1);
            assert_eq!(s.padding_range_in_shard(), 0..1);
        }
    }
    assert_eq!(layout.param_ranks(0).unwrap(), 0..12);
    assert_eq!(layout.param_ranks(1).unwrap(), 12..15);

    let w: Vec<f32> = (1..=12).map(|x| x as f32).collect();
    let b = [13.0f32, 14.0, 15.0];
    let flat = layout.flatten(&[&w[..], &b[..]]).unwrap();
    for rank in 0..16 {
        let expect = if rank < 15 { (rank + 1) as f32 } else { 0.0 };
        assert_eq!(layout.shard_of(&flat, rank).unwrap(), &[expect]);
    }
}

/// The same layer with a bias of 4 (weight [4, 3] + bias [4], as the issue text counts it):
/// 16 elements on 16 ranks, one element per rank and no padding at all.
#[test]
fn weight_4x3_bias_4_on_16_ranks_has_no_padding() {
    let layout = FlatParamLayout::new(&[vec![4, 3], vec![4]], 16).unwrap();
    assert_eq!(layout.total_numel(), 16);
    assert_eq!(layout.padded_numel(), 16);
    assert_eq!(layout.chunk_numel(), 1);
    for rank in 0..16 {
        let s = layout.shard(rank).unwrap();
        assert_eq!(s.pieces().len(), 1);
        assert_eq!(s.pieces()[0].param_index, usize::from(rank >= 12));
        assert_eq!(s.padding_numel(), 0);
    }
}

#[test]
fn shape_forms_agree_and_scalar_has_one_element() {
    let v = FlatParamLayout::new(&[vec![2, 3], vec![], vec![0, 5]], 4).unwrap();
    let s = FlatParamLayout::new(&[&[2usize, 3][..], &[][..], &[0, 5][..]], 4).unwrap();
    let shapes: [&[usize]; 3] = [&[2, 3], &[], &[0, 5]];
    let a = FlatParamLayout::new(&shapes, 4).unwrap();
    assert_eq!(v, s);
    assert_eq!(v, a);
    assert_eq!(v.param(1).unwrap().numel(), 1);
    assert_eq!(v.param(2).unwrap().numel(), 0);
    assert_eq!(v.param(2).unwrap().offset(), 7);
    assert_eq!(v.total_numel(), 7);
    assert_eq!(v.padded_numel(), 8);
}

#[test]
fn sharding_factor_one_is_unsharded() {
    let layout = FlatParamLayout::new(&[vec![3], vec![2]], 1).unwrap();
    assert_eq!(layout.padded_numel(), 5);
    assert_eq!(layout.padding_numel(), 0);
    assert_eq!(layout.chunk_numel(), 5);
    assert_eq!(layout.rank_interval(0).unwrap(), 0..5);
    assert_eq!(layout.rank_pieces(0).unwrap().len(), 2);
    let flat = layout.flatten(&[vec![1, 2, 3], vec![4, 5]]).unwrap();
    assert_eq!(layout.shard_of(&flat, 0).unwrap(), &flat[..]);
}

#[test]
fn empty_layouts_have_zero_chunks() {
    for shapes in [vec![], vec![vec![0usize]], vec![vec![3, 0], vec![0]]] {
        let layout = FlatParamLayout::new(&shapes, 8).unwrap();
        assert_eq!(layout.total_numel(), 0);
        assert_eq!(layout.padded_numel(), 0);
        assert_eq!(layout.chunk_numel(), 0);
        for rank in 0..8 {
            let s = layout.shard(rank).unwrap();
            assert_eq!(s.flat_range(), 0..0);
            assert!(s.pieces().is_empty());
            assert_eq!(s.padding_numel(), 0);
        }
        for i in 0..shapes.len() {
            assert!(layout.param_pieces(i).unwrap().is_empty());
            assert!(layout.param_ranks(i).unwrap().is_empty());
        }
        let params: Vec<Vec<f32>> = shapes.iter().map(|_| Vec::new()).collect();
        let flat = layout.flatten(&params).unwrap();
        assert!(flat.is_empty());
        assert!(layout.shard_of(&flat, 7).unwrap().is_empty());
        assert!(layout
            .unflatten(&flat)
            .unwrap()
            .iter()
            .all(|v| v.is_empty()));
    }
}

#[test]
fn zero_sized_params_between_others() {
    let layout = FlatParamLayout::new(&[vec![3], vec![0], vec![2]], 2).unwrap();
    assert_eq!(layout.param(1).unwrap().offset(), 3);
    assert_eq!(layout.param(2).unwrap().offset(), 3);
    // 5 elements padded to 6: chunk 3, rank 1 holds flat [3, 6) = param 2 and one padding.
    assert_eq!(layout.chunk_numel(), 3);
    let pieces = layout.rank_pieces(1).unwrap();
    assert_eq!(pieces.len(), 1);
    assert_eq!(pieces[0].param_index, 2);
    assert_eq!(pieces[0].param_range(), 0..2);
    assert_eq!(layout.piece(0, 1).unwrap(), None);
    assert_eq!(layout.piece(1, 1).unwrap(), None);
    let flat = layout
        .flatten(&[&[1.0f32, 2.0, 3.0][..], &[][..], &[4.0, 5.0][..]])
        .unwrap();
    assert_eq!(flat, [1.0, 2.0, 3.0, 4.0, 5.0, 0.0]);
    let views = layout.unflatten(&flat).unwrap();
    assert!(views[1].is_empty());
}

#[test]
fn numel_smaller_than_sharding_factor() {
    let layout = FlatParamLayout::new(&[vec![1], vec![2]], 64).unwrap();
    assert_eq!(layout.padded_numel(), 64);
    assert_eq!(layout.chunk_numel(), 1);
    assert_eq!(layout.padding_numel(), 61);
    assert_eq!(layout.rank_pieces(0).unwrap()[0].param_index, 0);
    assert_eq!(layout.rank_pieces(2).unwrap()[0].offset_in_param, 1);
    for rank in 3..64 {
        assert!(layout.rank_pieces(rank).unwrap().is_empty());
        assert_eq!(layout.rank_padding_numel(rank).unwrap(), 1);
    }
}

#[test]
fn construction_errors() {
    assert_eq!(
        FlatParamLayout::new(&[vec![1]], 0).unwrap_err(),
        LayoutError::ZeroShardingFactor
    );
    assert_eq!(
        FlatParamLayout::new(&[vec![2], vec![usize::MAX, 2]], 1).unwrap_err(),
        LayoutError::ParamNumelOverflow {
            param_index: 1,
            shape: vec![usize::MAX, 2]
        }
    );
    assert_eq!(
        FlatParamLayout::new(&[vec![usize::MAX], vec![1]], 1).unwrap_err(),
        LayoutError::TotalNumelOverflow {
            param_index: 1,
            running_total: usize::MAX,
            numel: 1
        }
    );
    assert_eq!(
        FlatParamLayout::new(&[vec![usize::MAX]], 2).unwrap_err(),
        LayoutError::PaddedNumelOverflow {
            total_numel: usize::MAX,
            sharding_factor: 2
        }
    );
    // A zero dimension makes an otherwise huge shape legal.
    let l = FlatParamLayout::new(&[vec![usize::MAX, usize::MAX, 0]], 3).unwrap();
    assert_eq!(l.total_numel(), 0);
    // usize::MAX elements with F = 1 fit (no padding needed).
    let l = FlatParamLayout::new(&[vec![usize::MAX]], 1).unwrap();
    assert_eq!(l.padded_numel(), usize::MAX);
    assert_eq!(l.param_ranks(0).unwrap(), 0..1);
}

#[test]
fn rank_and_index_errors() {
    let layout = FlatParamLayout::new(&[vec![5], vec![3]], 4).unwrap();
    let rank_err = |op| LayoutError::RankOutOfRange {
        op,
        rank: 4,
        sharding_factor: 4,
    };
    assert_eq!(
        layout.rank_interval(4).unwrap_err(),
        rank_err("rank_interval")
    );
    assert_eq!(layout.rank_pieces(4).unwrap_err(), rank_err("rank_pieces"));
    assert_eq!(layout.shard(4).unwrap_err(), rank_err("shard"));
    assert_eq!(
        layout.rank_padding_numel(4).unwrap_err(),
        rank_err("rank_padding_numel")
    );
    assert_eq!(layout.piece(4, 0).unwrap_err(), rank_err("piece"));
    let flat = vec![0.0f32; 8];
    assert_eq!(layout.shard_of(&flat, 4).unwrap_err(), rank_err("shard_of"));
    let idx_err = |op| LayoutError::ParamIndexOutOfRange {
        op,
        param_index: 2,
        num_params: 2,
    };
    assert_eq!(layout.param(2).unwrap_err(), idx_err("param"));
    assert_eq!(layout.piece(0, 2).unwrap_err(), idx_err("piece"));
    assert_eq!(layout.param_pieces(2).unwrap_err(), idx_err("param_pieces"));
    assert_eq!(layout.param_ranks(2).unwrap_err(), idx_err("param_ranks"));
}

#[test]
fn size_errors_name_sizes_and_write_nothing() {
    let layout = FlatParamLayout::new(&[vec![2, 2], vec![2]], 4).unwrap();
    let w = [1.0f32; 4];
    let b = [2.0f32; 2];
    let mut out = vec![9.0f32; 8];

    let err = layout.flatten_into(&[&w[..]], &mut out).unwrap_err();
    assert_eq!(
        err,
        LayoutError::ParamCountMismatch {
            op: "flatten_into",
            expected: 2,
            got: 1
        }
    );
    let err = layout
        .flatten_into(&[&w[..], &w[..]], &mut out)
        .unwrap_err();
    assert_eq!(
        err,
        LayoutError::ParamLenMismatch {
            op: "flatten_into",
            param_index: 1,
            expected: 2,
            got: 4,
            shape: vec![2]
        }
    );
    assert_eq!(
        err.to_string(),
        "flatten_into: parameter 1 has 4 elements but the layout expects 2 (shape [2]); pass \
         parameters in layout order, each with all of its elements"
    );
    let mut short = vec![9.0f32; 6];
    let err = layout
        .flatten_into(&[&w[..], &b[..]], &mut short)
        .unwrap_err();
    assert_eq!(
        err,
        LayoutError::FlatLenMismatch {
            op: "flatten_into",
            got: 6,
            padded_numel: 8,
            total_numel: 6,
            accepted: "only the padded length is accepted"
        }
    );
    assert!(out.iter().all(|&x| x == 9.0));
    assert!(short.iter().all(|&x| x == 9.0));

    // unflatten accepts padded (8) or unpadded (6), nothing else.
    assert!(layout.unflatten(&out).is_ok());
    assert!(layout.unflatten(&out[..6]).is_ok());
    let err = layout.unflatten(&out[..7]).unwrap_err();
    assert!(
        err.to_string().contains("flat buffer has 7 elements"),
        "{err}"
    );
    assert!(layout.unflatten_mut(&mut out[..5]).is_err());
    // shard_of needs the padded flat.
    assert!(matches!(
        layout.shard_of(&out[..6], 0).unwrap_err(),
        LayoutError::FlatLenMismatch {
            op: "shard_of",
            got: 6,
            ..
        }
    ));
    assert!(layout.shard_of_mut(&mut out[..7], 0).is_err());

    // Shard-sized buffers.
    let mut shard = vec![9.0f32; 3];
    let err = layout
        .flatten_shard_into(&[&w[..], &b[..]], 1, &mut shard)
        .unwrap_err();
    assert_eq!(
        err,
        LayoutError::ShardLenMismatch {
            op: "flatten_shard_into",
            rank: 1,
            expected: 2,
            got: 3
        }
    );
    assert!(shard.iter().all(|&x| x == 9.0));
    assert!(matches!(
        layout.split_shard(&shard, 0).unwrap_err(),
        LayoutError::ShardLenMismatch {
            op: "split_shard",
            got: 3,
            ..
        }
    ));
    assert!(layout.split_shard_mut(&mut shard, 0).is_err());
    assert!(matches!(
        layout.flatten_shard_into(&[&w[..], &b[..]], 9, &mut shard[..2]),
        Err(LayoutError::RankOutOfRange { rank: 9, .. })
    ));
    assert!(matches!(
        layout.flatten(&[&w[..]]),
        Err(LayoutError::ParamCountMismatch { op: "flatten", .. })
    ));
}

#[test]
fn cast_roundtrip_and_errors() {
    let src = [0.0f32, 1.0, -2.5, 65504.0, 1.0e-8, f32::INFINITY];
    let mut h = [f16::ZERO; 6];
    cast_f32_to_half_into(&src, &mut h).unwrap();
    let mut back = [0.0f32; 6];
    cast_half_to_f32_into(&h, &mut back).unwrap();
    // Representable values survive exactly; 1e-8 underflows to 0 in f16.
    assert_eq!(back, [0.0, 1.0, -2.5, 65504.0, 0.0, f32::INFINITY]);

    let mut b = [bf16::ZERO; 6];
    cast_f32_to_half_into(&src, &mut b).unwrap();
    cast_half_to_f32_into(&b, &mut back).unwrap();
    assert_eq!(back[..3], [0.0, 1.0, -2.5]);
    assert!((back[4] - 1.0e-8).abs() < 1.0e-10); // bf16 keeps f32's exponent range

    let mut short = [bf16::ZERO; 2];
    let err = cast_f32_to_half_into(&src, &mut short).unwrap_err();
    assert_eq!(
        err,
        LayoutError::CastLenMismatch {
            op: "cast_f32_to_half_into",
            src_dtype: "f32",
            dst_dtype: "bf16",
            src_len: 6,
            dst_len: 2
        }
    );
    assert_eq!(short, [bf16::ZERO; 2]);
    let err = cast_half_to_f32_into(&h, &mut back[..1]).unwrap_err();
    assert!(err.to_string().contains("6 f16 elements"), "{err}");
}

/// A shard cast to bf16, gathered and unflattened, gives the bf16 parameters: the
/// mixed-precision all-gather path.
#[test]
fn low_precision_shards_gather_to_low_precision_params() {
    let layout = FlatParamLayout::new(&[vec![3, 3], vec![3]], 5).unwrap();
    let w: Vec<f32> = (0..9).map(|x| x as f32 * 0.1).collect();
    let b = vec![1.5f32, -0.5, 2.0];
    let flat = layout.flatten(&[&w, &b]).unwrap();
    let mut gathered = Vec::new();
    for rank in 0..5 {
        let shard = layout.shard_of(&flat, rank).unwrap();
        gathered.extend(fsdp_flatparam::cast_f32_to_half::<bf16>(shard));
    }
    let views = layout.unflatten(&gathered).unwrap();
    let expect_w: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(views[0], &expect_w[..]);
    assert_eq!(fsdp_flatparam::cast_half_to_f32(views[1]), b);
}
