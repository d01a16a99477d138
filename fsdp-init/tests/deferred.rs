//! Deferred init == eager init, bit for bit: whole, unit by unit, and shard by shard on 1–4
//! ranks, for every init op and for a GPT.

mod common;

use common::*;
use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{parameters, Gpt, GptConfig};
use fsdp_autograd::InitContext;
use fsdp_init::{materialize, InitPlan, MaterializeError};

const SEED: u64 = 1234;

#[test]
fn every_op_whole_model_equals_eager() {
    let dev = Device::cpu(0);
    for (dtype, prefix) in [
        (DType::F32, "f32"),
        (DType::F16, "f16"),
        (DType::BF16, "bf16"),
    ] {
        let specs = every_op_specs(prefix);
        let eager = build(&InitContext::eager(&dev, SEED), &specs, dtype);
        let fake = build(&InitContext::fake(SEED), &specs, dtype);
        assert!(fake.iter().all(|p| !p.is_materialized()));
        let model = ParamList::new(fake.clone());
        materialize(&model, &dev).unwrap();
        let plan = InitPlan::new(fake.clone()).unwrap();
        for (e, f) in eager.iter().zip(&fake) {
            let (te, tf) = (e.get().unwrap(), f.get().unwrap());
            assert_eq!(tf.dtype(), dtype);
            assert_eq!(tf.shape(), e.shape());
            assert!(tf.requires_grad() && tf.is_leaf(), "{}", f.name());
            assert_eq!(bits(&tf), bits(&te), "{} ({dtype})", f.name());
            // The host reference agrees too (as f32 after rounding to the dtype).
            let host: Vec<f32> = plan.values(f).unwrap();
            assert_eq!(
                host.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                te.to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                "{}",
                f.name()
            );
        }
        // Sanity: the random ops did produce varied values.
        let normal = eager
            .iter()
            .find(|p| p.name().ends_with(".normal"))
            .unwrap();
        let v = normal.get().unwrap().to_vec_f32().unwrap();
        assert!(v.iter().any(|&x| x != v[0]));
    }
}

#[test]
fn every_op_shards_on_1_to_4_ranks_equal_eager_flat_parameter() {
    let dev = Device::cpu(0);
    for (dtype, prefix) in [
        (DType::F32, "f32"),
        (DType::F16, "f16"),
        (DType::BF16, "bf16"),
    ] {
        let specs = every_op_specs(prefix);
        let eager = build(&InitContext::eager(&dev, SEED), &specs, dtype);
        let fake = build(&InitContext::fake(SEED), &specs, dtype);
        let plan = InitPlan::new(fake.clone()).unwrap();
        for world in 1..=4 {
            let layout = layout_of(&fake, world);
            let want = eager_flat_bits(&eager, &layout);
            let mut shard_only = Vec::new();
            let mut unit_path = Vec::new();
            for rank in 0..world {
                let rdev = Device::cpu(10 + rank);
                let s = plan.materialize_shard(&fake, &layout, rank, &rdev).unwrap();
                assert_eq!(s.shape(), &[layout.chunk_numel()]);
                assert_eq!(s.dtype(), dtype);
                shard_only.extend(bits(&s));
                let u = plan
                    .materialize_unit_sharded(&fake, &layout, rank, &rdev)
                    .unwrap();
                unit_path.extend(bits(&u));
            }
            assert_eq!(shard_only, want, "{dtype} shard-only, world {world}");
            assert_eq!(unit_path, want, "{dtype} unit-by-unit, world {world}");
            // The parameters are left unmaterialized.
            assert!(fake.iter().all(|p| !p.is_materialized()));
        }
    }
}

#[test]
fn gpt_mini_on_1_to_4_ranks_equals_eager() {
    for tied in [false, true] {
        let cfg = GptConfig::mini().with_tied(tied);
        let dev = Device::cpu(0);
        let eager = Gpt::new(&InitContext::eager(&dev, SEED), &cfg).unwrap();
        let fake = Gpt::new(&InitContext::fake(SEED), &cfg).unwrap();
        assert!(parameters(&fake).iter().all(|p| !p.is_materialized()));
        let eager_units = gpt_units(&eager);
        let fake_units = gpt_units(&fake);
        let plan = InitPlan::from_module(&fake).unwrap();
        for world in 1..=4 {
            for (ue, uf) in eager_units.iter().zip(&fake_units) {
                let layout = layout_of(uf, world);
                let want = eager_flat_bits(ue, &layout);
                let mut got = Vec::new();
                for rank in 0..world {
                    let rdev = Device::cpu(20 + rank);
                    got.extend(bits(
                        &plan.materialize_shard(uf, &layout, rank, &rdev).unwrap(),
                    ));
                }
                assert_eq!(
                    got,
                    want,
                    "tied {tied}, world {world}, unit of {}",
                    uf[0].name()
                );
            }
        }
        // Unit by unit into parameters, then the whole model.
        for unit in &fake_units[..2] {
            plan.materialize_unit(unit, &dev).unwrap();
        }
        materialize(&fake, &dev).unwrap();
        for (e, f) in parameters(&eager).iter().zip(parameters(&fake)) {
            assert_eq!(e.name(), f.name());
            assert_eq!(
                bits(&e.get().unwrap()),
                bits(&f.get().unwrap()),
                "{}",
                f.name()
            );
        }
    }
}

#[test]
fn materializing_twice_keeps_the_first_tensors() {
    let dev = Device::cpu(0);
    let fake = Gpt::new(&InitContext::fake(1), &GptConfig::tiny()).unwrap();
    materialize(&fake, &dev).unwrap();
    let before: Vec<u64> = parameters(&fake)
        .iter()
        .map(|p| p.get().unwrap().id())
        .collect();
    materialize(&fake, &dev).unwrap();
    let after: Vec<u64> = parameters(&fake)
        .iter()
        .map(|p| p.get().unwrap().id())
        .collect();
    assert_eq!(before, after);
}

#[test]
fn different_seeds_differ_and_names_key_the_streams() {
    let dev = Device::cpu(0);
    let a = InitContext::fake(1)
        .param(
            "w",
            &[64],
            DType::F32,
            vec![fsdp_autograd::init::InitOp::Normal {
                mean: 0.0,
                std: 1.0,
            }],
        )
        .unwrap();
    let b = InitContext::fake(2)
        .param("w", &[64], DType::F32, a.init_ops().to_vec())
        .unwrap();
    let c = InitContext::fake(1)
        .param("v", &[64], DType::F32, a.init_ops().to_vec())
        .unwrap();
    for p in [&a, &b, &c] {
        fsdp_init::materialize_unit(std::slice::from_ref(p), &dev).unwrap();
    }
    assert_ne!(bits(&a.get().unwrap()), bits(&b.get().unwrap()));
    assert_ne!(bits(&a.get().unwrap()), bits(&c.get().unwrap()));
}

#[test]
fn errors_are_typed() {
    let dev = Device::cpu(0);
    let ctx = InitContext::fake(0);
    let specs = every_op_specs("e");
    let unit = build(&ctx, &specs[..4], DType::F32);
    let plan = InitPlan::new(unit.clone()).unwrap();
    // Layout of other shapes.
    let wrong = fsdp_flatparam::FlatParamLayout::new(&[vec![3]], 2).unwrap();
    assert!(matches!(
        plan.materialize_shard(&unit, &wrong, 0, &dev),
        Err(MaterializeError::LayoutMismatch { .. })
    ));
    // Rank out of range.
    let layout = layout_of(&unit, 2);
    assert!(matches!(
        plan.materialize_shard(&unit, &layout, 2, &dev),
        Err(MaterializeError::Layout(_))
    ));
    // Mixed dtypes in one flat parameter.
    let h = ctx.param("h", &[4], DType::F16, vec![]).unwrap();
    let mixed = vec![unit[0].clone(), h];
    let err = InitPlan::new(mixed.clone())
        .unwrap()
        .materialize_shard(&mixed, &layout_of(&mixed, 1), 0, &dev)
        .unwrap_err();
    assert!(matches!(err, MaterializeError::MixedDtypes { .. }), "{err}");
    assert!(err.to_string().contains("e.zeros") && err.to_string().contains("`h`"));
    // Two different parameters with one name.
    let dup = InitContext::fake(0)
        .param("e.zeros", &[7], DType::F32, vec![])
        .unwrap();
    assert!(matches!(
        InitPlan::new(vec![unit[0].clone(), dup]),
        Err(MaterializeError::DuplicateName { .. })
    ));
    // Invalid op arguments are reported before anything is allocated.
    let bad = ctx
        .param(
            "bad",
            &[4],
            DType::F32,
            vec![fsdp_autograd::init::InitOp::Normal {
                mean: 0.0,
                std: -1.0,
            }],
        )
        .unwrap();
    let before = dev.memory_stats().allocated_bytes;
    let err = fsdp_init::materialize_unit(std::slice::from_ref(&bad), &dev).unwrap_err();
    assert!(matches!(err, MaterializeError::Init(_)), "{err}");
    assert_eq!(dev.memory_stats().allocated_bytes, before);
    assert!(!bad.is_materialized());
}

#[test]
fn rank_threads_share_one_fake_model() {
    let cfg = GptConfig::tiny();
    let fake = Gpt::new(&InitContext::fake(SEED), &cfg).unwrap();
    let plan = InitPlan::from_module(&fake).unwrap();
    let units = gpt_units(&fake);
    let world = 3;
    let per_rank: Vec<Vec<(Vec<u32>, Vec<u32>)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (plan, units) = (&plan, &units);
                s.spawn(move || {
                    let dev = Device::cpu(50 + rank);
                    units
                        .iter()
                        .map(|u| {
                            let l = layout_of(u, world);
                            let a = plan.materialize_unit_sharded(u, &l, rank, &dev).unwrap();
                            let b = plan.materialize_shard(u, &l, rank, &dev).unwrap();
                            (bits(&a), bits(&b))
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let eager = Gpt::new(&InitContext::eager(&Device::cpu(0), SEED), &cfg).unwrap();
    for (i, ue) in gpt_units(&eager).iter().enumerate() {
        let want = eager_flat_bits(ue, &layout_of(ue, world));
        let unit_path: Vec<u32> = (0..world).flat_map(|r| per_rank[r][i].0.clone()).collect();
        let shard_path: Vec<u32> = (0..world).flat_map(|r| per_rank[r][i].1.clone()).collect();
        assert_eq!(unit_path, want, "unit {i}");
        assert_eq!(shard_path, want, "unit {i}");
    }
    assert!(parameters(&fake).iter().all(|p| !p.is_materialized()));
}

#[test]
fn empty_units_and_zero_sized_parameters() {
    let dev = Device::cpu(60);
    let plan = InitPlan::new(Vec::new()).unwrap();
    assert!(plan.is_empty());
    let layout = fsdp_flatparam::FlatParamLayout::new::<Vec<usize>>(&[], 2).unwrap();
    let s = plan.materialize_shard(&[], &layout, 1, &dev).unwrap();
    assert_eq!(s.numel(), 0);
    // A unit of only zero-sized parameters: every rank gets an empty shard.
    let ctx = InitContext::fake(0);
    let unit = vec![
        ctx.param(
            "a",
            &[0],
            DType::F32,
            vec![fsdp_autograd::init::InitOp::Fill(1.0)],
        )
        .unwrap(),
        ctx.param("b", &[3, 0], DType::F32, vec![]).unwrap(),
    ];
    let layout = layout_of(&unit, 3);
    for rank in 0..3 {
        assert_eq!(
            fsdp_init::materialize_shard(&unit, &layout, rank, &dev)
                .unwrap()
                .numel(),
            0
        );
    }
}
