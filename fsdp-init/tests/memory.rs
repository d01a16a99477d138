//! Device memory of deferred materialization, from the allocator's statistics: shard-only never
//! holds more than the shards; unit by unit holds shards + one unit; a capped device succeeds
//! unit by unit when shard + one unit fits and fails with an out-of-memory error when not.

mod common;

use common::*;
use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{parameters, Gpt, GptConfig};
use fsdp_autograd::{InitContext, Parameter};
use fsdp_init::{materialize, InitPlan, MaterializeError};

const SEED: u64 = 99;
const WORLD: usize = 4;

fn unit_bytes(unit: &[Parameter]) -> usize {
    unit.iter().map(|p| round512(p.numel() * 4)).sum()
}

#[test]
fn shard_only_allocates_one_chunk_per_unit() {
    let fake = Gpt::new(&InitContext::fake(SEED), &GptConfig::mini()).unwrap();
    let plan = InitPlan::from_module(&fake).unwrap();
    let units = gpt_units(&fake);
    for rank in 0..WORLD {
        let dev = Device::cpu(100 + rank);
        let mut shards = Vec::new();
        for unit in &units {
            let layout = layout_of(unit, WORLD);
            let chunk_bytes = round512(layout.chunk_numel() * 4);
            let before = dev.memory_stats().allocated_bytes;
            dev.reset_peak_stats();
            shards.push(plan.materialize_shard(unit, &layout, rank, &dev).unwrap());
            let st = dev.memory_stats();
            assert!(
                st.peak_allocated_bytes <= before + chunk_bytes,
                "rank {rank}, unit of {}: peak {} > {} + one chunk {}",
                unit[0].name(),
                st.peak_allocated_bytes,
                before,
                chunk_bytes
            );
            assert_eq!(st.allocated_bytes, before + chunk_bytes);
        }
    }
}

#[test]
fn whole_tensor_fallback_builds_one_parameter_at_a_time() {
    let ctx = InitContext::fake(SEED);
    let specs = every_op_specs("fb");
    let unit = build(&ctx, &specs, DType::F32);
    let plan = InitPlan::new(unit.clone()).unwrap();
    let whole_ops: Vec<&Parameter> = unit
        .iter()
        .filter(|p| !plan.is_positionwise(p).unwrap())
        .collect();
    assert_eq!(
        whole_ops.len(),
        4,
        "custom, copy_custom and the two orthogonal parameters need the whole tensor"
    );
    let largest_whole = whole_ops
        .iter()
        .map(|p| round512(p.numel() * 4))
        .max()
        .unwrap();
    for world in [1, 3] {
        let layout = layout_of(&unit, world);
        for rank in 0..world {
            let dev = Device::cpu(110 + rank);
            dev.reset_peak_stats();
            let before = dev.memory_stats().allocated_bytes;
            let s = plan.materialize_shard(&unit, &layout, rank, &dev).unwrap();
            let st = dev.memory_stats();
            let chunk = round512(layout.chunk_numel() * 4);
            assert!(st.peak_allocated_bytes <= before + chunk + largest_whole);
            assert_eq!(st.allocated_bytes, before + chunk);
            drop(s);
        }
    }
}

#[test]
fn unit_by_unit_holds_shards_plus_one_unit() {
    let fake = Gpt::new(&InitContext::fake(SEED), &GptConfig::mini()).unwrap();
    let plan = InitPlan::from_module(&fake).unwrap();
    let units = gpt_units(&fake);
    let dev = Device::cpu(120);
    let mut shards = Vec::new();
    for unit in &units {
        let layout = layout_of(unit, WORLD);
        let chunk = round512(layout.chunk_numel() * 4);
        let before = dev.memory_stats().allocated_bytes;
        dev.reset_peak_stats();
        shards.push(
            plan.materialize_unit_sharded(unit, &layout, 1, &dev)
                .unwrap(),
        );
        let st = dev.memory_stats();
        // The whole unit was built (peak above it) but never more than unit + chunk.
        assert!(st.peak_allocated_bytes >= before + unit_bytes(unit));
        assert!(st.peak_allocated_bytes <= before + unit_bytes(unit) + chunk);
        assert_eq!(
            st.allocated_bytes,
            before + chunk,
            "the unit is freed again"
        );
        assert!(unit.iter().all(|p| !p.is_materialized()));
    }
}

/// The GPT-mini sizes a capped rank device is tested with.
struct Sizes {
    shard: usize,
    largest_unit: usize,
    full: usize,
}

fn sizes(units: &[Vec<Parameter>]) -> Sizes {
    Sizes {
        shard: units
            .iter()
            .map(|u| round512(layout_of(u, WORLD).chunk_numel() * 4))
            .sum(),
        largest_unit: units.iter().map(|u| unit_bytes(u)).max().unwrap(),
        full: units.iter().map(|u| unit_bytes(u)).sum(),
    }
}

#[test]
fn capped_device_succeeds_unit_by_unit_when_shard_plus_one_unit_fits() {
    let fake = Gpt::new(&InitContext::fake(SEED), &GptConfig::mini()).unwrap();
    let plan = InitPlan::from_module(&fake).unwrap();
    let units = gpt_units(&fake);
    let s = sizes(&units);
    let cap = s.shard + s.largest_unit;
    assert!(
        cap < s.full,
        "the model must not fit: cap {cap}, model {}",
        s.full
    );

    // The whole model does not fit: a clear out-of-memory error.
    let dev = capped_device(130, cap);
    let err = materialize(&fake, &dev).unwrap_err();
    match &err {
        MaterializeError::OutOfMemory { what, .. } => assert!(what.contains("parameter `")),
        e => panic!("expected OutOfMemory, got {e}"),
    }
    assert!(err.to_string().contains("out of memory"), "{err}");
    for p in parameters(&fake) {
        p.take(); // undo the partial materialization
    }

    // Unit by unit fits, on every rank, and gives the eager values.
    let eager = Gpt::new(
        &InitContext::eager(&Device::cpu(0), SEED),
        &GptConfig::mini(),
    )
    .unwrap();
    let eager_units = gpt_units(&eager);
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); units.len()];
    for rank in 0..WORLD {
        let dev = capped_device(140 + rank, cap);
        let mut shards = Vec::new();
        for (i, unit) in units.iter().enumerate() {
            let t = plan
                .materialize_unit_sharded(unit, &layout_of(unit, WORLD), rank, &dev)
                .unwrap();
            got[i].extend(bits(&t));
            shards.push(t);
        }
        let st = dev.memory_stats();
        assert!(st.peak_reserved_bytes <= cap);
        assert_eq!(st.allocated_bytes, s.shard);
    }
    for (i, (ue, g)) in eager_units.iter().zip(&got).enumerate() {
        assert_eq!(*g, eager_flat_bits(ue, &layout_of(ue, WORLD)), "unit {i}");
    }
}

#[test]
fn capped_device_fails_unit_by_unit_when_one_unit_does_not_fit() {
    let fake = Gpt::new(&InitContext::fake(SEED), &GptConfig::mini()).unwrap();
    let plan = InitPlan::from_module(&fake).unwrap();
    let units = gpt_units(&fake);
    let s = sizes(&units);
    let cap = s.shard + s.largest_unit / 2;
    let dev = capped_device(150, cap);
    let mut shards = Vec::new();
    let mut failure = None;
    for unit in &units {
        match plan.materialize_unit_sharded(unit, &layout_of(unit, WORLD), 0, &dev) {
            Ok(t) => shards.push(t),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let err = failure.expect("shard + half a unit must not be enough");
    assert!(matches!(err, MaterializeError::OutOfMemory { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("out of memory") && msg.contains("capacity"),
        "{msg}"
    );
    assert!(msg.contains("smaller FSDP units"), "{msg}");
    // Nothing is left materialized, and shard-only fits on the same capacity.
    assert!(parameters(&fake).iter().all(|p| !p.is_materialized()));
    drop(shards);
    let dev = capped_device(151, cap);
    let shards: Vec<_> = units
        .iter()
        .map(|u| {
            plan.materialize_shard(u, &layout_of(u, WORLD), 0, &dev)
                .unwrap()
        })
        .collect();
    assert_eq!(dev.memory_stats().allocated_bytes, s.shard);
    drop(shards);
}

#[test]
fn streaming_an_existing_cpu_model_moves_only_the_shard() {
    let host = Device::cpu(0);
    let model = Gpt::new(&InitContext::eager(&host, SEED), &GptConfig::mini()).unwrap();
    let units = gpt_units(&model);
    for world in [1, 3] {
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); units.len()];
        for rank in 0..world {
            let dev = Device::cpu(160 + rank);
            let mut held = 0;
            let mut shards = Vec::new();
            for (i, unit) in units.iter().enumerate() {
                let layout = layout_of(unit, world);
                dev.reset_peak_stats();
                let t = fsdp_init::stream_shard(unit, &layout, rank, &dev).unwrap();
                held += round512(layout.chunk_numel() * 4);
                assert!(dev.memory_stats().peak_allocated_bytes <= held);
                got[i].extend(bits(&t));
                shards.push(t);
            }
        }
        for (i, (u, g)) in units.iter().zip(&got).enumerate() {
            assert_eq!(
                *g,
                eager_flat_bits(u, &layout_of(u, world)),
                "unit {i}, world {world}"
            );
        }
    }
    // The source model is untouched.
    assert!(parameters(&model).iter().all(|p| p.is_materialized()));
    // Fake parameters are refused by the streaming entry point.
    let fake = Gpt::new(&InitContext::fake(SEED), &GptConfig::tiny()).unwrap();
    let unit = parameters(&fake);
    let err = fsdp_init::stream_shard(&unit, &layout_of(&unit, 2), 0, &host).unwrap_err();
    assert!(matches!(err, MaterializeError::Unreadable { .. }), "{err}");
}

#[test]
fn streaming_converts_to_the_units_dtype() {
    // A unit declared f16 whose parameters currently hold f32 tensors (e.g. loaded in f32).
    let host = Device::cpu(0);
    let ctx = InitContext::fake(0);
    let p = ctx.param("w", &[3, 3], DType::F16, vec![]).unwrap();
    let vals: Vec<f32> = (0..9).map(|i| i as f32 / 3.0).collect();
    p.set(fsdp_autograd::Tensor::from_vec(vals.clone(), &[3, 3], &host).unwrap())
        .unwrap();
    let unit = vec![p];
    let layout = layout_of(&unit, 2);
    let dev = Device::cpu(170);
    let s = fsdp_init::materialize_shard(&unit, &layout, 0, &dev).unwrap();
    assert_eq!(s.dtype(), DType::F16);
    let want: Vec<f32> = vals[..5]
        .iter()
        .map(|&x| half::f16::from_f32(x).to_f32())
        .collect();
    assert_eq!(s.to_vec_f32().unwrap(), want);
}
