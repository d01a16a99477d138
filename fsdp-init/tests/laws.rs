//! Property: for random units (shapes, ops, copies between them) and any world size, the
//! concatenation of every rank's shard equals the eager unit's flat parameter, bit for bit.

mod common;

use common::*;
use fsdp_alloc::{DType, Device};
use fsdp_autograd::init::{FanMode, InitOp, Nonlinearity};
use fsdp_autograd::InitContext;
use fsdp_init::InitPlan;
use proptest::prelude::*;

fn op() -> impl Strategy<Value = InitOp> {
    prop_oneof![
        (-1.0f32..1.0).prop_map(InitOp::Fill),
        (0.1f32..2.0).prop_map(InitOp::Scale),
        (-1.0f32..0.0, 0.0f32..1.0).prop_map(|(low, high)| InitOp::Uniform { low, high }),
        (0.0f32..0.5).prop_map(|std| InitOp::Normal { mean: 0.0, std }),
        (0.1f32..1.0).prop_map(|std| InitOp::TruncatedNormal {
            mean: 0.0,
            std,
            a: -std,
            b: 2.0 * std
        }),
        Just(InitOp::KaimingUniform {
            mode: FanMode::FanIn,
            nonlinearity: Nonlinearity::Gelu
        }),
        Just(InitOp::KaimingNormal {
            mode: FanMode::FanOut,
            nonlinearity: Nonlinearity::Tanh
        }),
        Just(InitOp::XavierUniform { gain: 1.0 }),
        Just(InitOp::XavierNormal { gain: 0.5 }),
        Just(normalize_rows()),
    ]
}

/// A parameter spec: shape, ops, and optionally "copy the parameter `k` back" (k ≥ 1) first.
fn param() -> impl Strategy<Value = (Vec<usize>, Vec<InitOp>, Option<usize>)> {
    (
        proptest::collection::vec(1usize..9, 1..3),
        proptest::collection::vec(op(), 0..3),
        proptest::option::of(1usize..4),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn shards_concatenate_to_the_eager_flat_parameter(
        specs in proptest::collection::vec(param(), 1..6),
        world in 1usize..6,
        seed in any::<u64>(),
        half in any::<bool>(),
    ) {
        let dtype = if half { DType::BF16 } else { DType::F32 };
        let dev = Device::cpu(0);
        let eager_ctx = InitContext::eager(&dev, seed);
        let fake_ctx = InitContext::fake(seed);
        let mut shapes: Vec<Vec<usize>> = Vec::new();
        let mut eager = Vec::new();
        let mut fake = Vec::new();
        for (i, (shape, ops, copy)) in specs.into_iter().enumerate() {
            let mut all = Vec::new();
            let mut shape = shape;
            if let Some(k) = copy.filter(|&k| k <= i) {
                // Copy an earlier parameter (same shape, so sizes match).
                all.push(InitOp::CopyFrom { source: format!("p{}", i - k) });
                shape = shapes[i - k].clone();
            }
            all.extend(ops);
            let name = format!("p{i}");
            eager.push(eager_ctx.param(&name, &shape, dtype, all.clone()).unwrap());
            fake.push(fake_ctx.param(&name, &shape, dtype, all).unwrap());
            shapes.push(shape);
        }
        let plan = InitPlan::new(fake.clone()).unwrap();
        let layout = layout_of(&fake, world);
        let want = eager_flat_bits(&eager, &layout);
        let mut got = Vec::new();
        for rank in 0..world {
            got.extend(bits(&plan.materialize_shard(&fake, &layout, rank, &Device::cpu(1 + rank)).unwrap()));
        }
        prop_assert_eq!(got, want);
    }
}
