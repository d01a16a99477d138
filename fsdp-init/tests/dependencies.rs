//! Cross-parameter dependencies: CopyFrom sources in other units are replayed from their
//! recorded ops when position-wise and refused (naming both parameters) when not; unknown
//! sources, cycles and failing closures are typed errors.

mod common;

use common::*;
use fsdp_alloc::{AllocError, DType, Device};
use fsdp_autograd::init::{InitError, InitOp};
use fsdp_autograd::{InitContext, Parameter};
use fsdp_init::{CrossUnitDependency, InitPlan, MaterializeError};

const SEED: u64 = 5;

fn normal() -> Vec<InitOp> {
    vec![InitOp::Normal {
        mean: 0.0,
        std: 0.5,
    }]
}

fn copy(src: &str, scale: f32) -> Vec<InitOp> {
    vec![
        InitOp::CopyFrom { source: src.into() },
        InitOp::Scale(scale),
    ]
}

/// (name, shape, ops) in creation order.
type Spec = (&'static str, Vec<usize>, Vec<InitOp>);

fn both(specs: &[Spec]) -> (Vec<Parameter>, Vec<Parameter>) {
    let dev = Device::cpu(0);
    let e = InitContext::eager(&dev, SEED);
    let f = InitContext::fake(SEED);
    let mk = |ctx: &InitContext| -> Vec<Parameter> {
        specs
            .iter()
            .map(|(n, s, o)| ctx.param(n, s, DType::F32, o.clone()).unwrap())
            .collect()
    };
    (mk(&e), mk(&f))
}

#[test]
fn positionwise_source_in_another_unit_is_replayed() {
    let (eager, fake) = both(&[
        ("emb", vec![16, 6], normal()),
        ("mid", vec![6, 16], copy("emb", 0.25)),
        ("head", vec![96], copy("mid", 3.0)),
    ]);
    let plan = InitPlan::new(fake.clone()).unwrap();
    // Unit {head}: its chain head <- mid <- emb leaves the unit at the first link.
    let unit = vec![fake[2].clone()];
    assert_eq!(
        plan.cross_unit_dependencies(&unit).unwrap(),
        vec![
            CrossUnitDependency {
                param: "head".into(),
                source: "mid".into(),
                replayable: true
            },
            CrossUnitDependency {
                param: "mid".into(),
                source: "emb".into(),
                replayable: true
            },
        ]
    );
    for world in 1..=4 {
        let layout = layout_of(&unit, world);
        let mut got = Vec::new();
        for rank in 0..world {
            got.extend(bits(
                &plan
                    .materialize_shard(&unit, &layout, rank, &Device::cpu(1))
                    .unwrap(),
            ));
        }
        assert_eq!(got, eager_flat_bits(&eager[2..], &layout), "world {world}");
    }
    plan.materialize_unit(&unit, &Device::cpu(1)).unwrap();
    assert_eq!(
        bits(&fake[2].get().unwrap()),
        bits(&eager[2].get().unwrap())
    );
    // The sources stay unmaterialized: they belong to other units.
    assert!(!fake[0].is_materialized() && !fake[1].is_materialized());
}

#[test]
fn whole_tensor_source_in_another_unit_is_refused_naming_both() {
    let (eager, fake) = both(&[
        (
            "enc.w",
            vec![8, 8],
            vec![
                InitOp::Uniform {
                    low: -1.0,
                    high: 1.0,
                },
                normalize_rows(),
            ],
        ),
        ("dec.w", vec![8, 8], copy("enc.w", 1.0)),
    ]);
    let plan = InitPlan::new(fake.clone()).unwrap();
    let unit = vec![fake[1].clone()];
    assert!(!plan.cross_unit_dependencies(&unit).unwrap()[0].replayable);
    let err = plan.materialize_unit(&unit, &Device::cpu(2)).unwrap_err();
    match &err {
        MaterializeError::CrossUnitDependency {
            param,
            source_param,
            reason,
        } => {
            assert_eq!((param.as_str(), source_param.as_str()), ("dec.w", "enc.w"));
            assert!(reason.contains("normalize_rows"), "{reason}");
        }
        e => panic!("expected CrossUnitDependency, got {e}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("`dec.w`") && msg.contains("`enc.w`") && msg.contains("one FSDP unit"),
        "{msg}"
    );
    // Every rank refuses, including ranks holding none of `dec.w`... and the shard path too.
    let layout = layout_of(&unit, 2);
    for rank in 0..2 {
        assert!(matches!(
            plan.materialize_shard(&unit, &layout, rank, &Device::cpu(2)),
            Err(MaterializeError::CrossUnitDependency { .. })
        ));
    }
    assert!(!fake[1].is_materialized());
    // In one unit it works, and equals eager.
    let layout = layout_of(&fake, 3);
    let mut got = Vec::new();
    for rank in 0..3 {
        got.extend(bits(
            &plan
                .materialize_shard(&fake, &layout, rank, &Device::cpu(2))
                .unwrap(),
        ));
    }
    assert_eq!(got, eager_flat_bits(&eager, &layout));
}

#[test]
fn whole_tensor_link_in_the_middle_of_a_chain_is_refused() {
    let (_, fake) = both(&[
        ("a", vec![4, 4], normal()),
        (
            "b",
            vec![4, 4],
            vec![InitOp::CopyFrom { source: "a".into() }, normalize_rows()],
        ),
        ("c", vec![16], copy("b", 2.0)),
    ]);
    let plan = InitPlan::new(fake.clone()).unwrap();
    // {c} alone: b is outside and not replayable.
    let err = plan
        .materialize_unit(&fake[2..], &Device::cpu(3))
        .unwrap_err();
    assert!(
        matches!(&err, MaterializeError::CrossUnitDependency { param, source_param, .. } if param == "c" && source_param == "b"),
        "{err}"
    );
    // {b, c}: b's source a is position-wise, so it is replayed.
    assert_eq!(
        plan.cross_unit_dependencies(&fake[1..]).unwrap(),
        vec![CrossUnitDependency {
            param: "b".into(),
            source: "a".into(),
            replayable: true
        }]
    );
    plan.materialize_unit(&fake[1..], &Device::cpu(3)).unwrap();
    assert_eq!(
        plan.values(&fake[2]).unwrap(),
        fake[2].get().unwrap().to_vec::<f32>().unwrap()
    );
}

#[test]
fn source_outside_a_plan_of_the_unit_alone_is_an_unknown_source() {
    let (_, fake) = both(&[
        ("emb", vec![4, 2], normal()),
        ("head", vec![4, 2], copy("emb", 1.0)),
    ]);
    let err = fsdp_init::materialize_unit(&fake[1..], &Device::cpu(4)).unwrap_err();
    match &err {
        MaterializeError::UnknownSource {
            param,
            source_param,
            ..
        } => {
            assert_eq!((param.as_str(), source_param.as_str()), ("head", "emb"));
        }
        e => panic!("expected UnknownSource, got {e}"),
    }
    assert!(err.to_string().contains("InitPlan::from_module"));
}

#[test]
fn copy_cycles_and_size_mismatches_are_detected() {
    let a = Parameter::unmaterialized(
        "a",
        &[3],
        DType::F32,
        true,
        vec![InitOp::CopyFrom { source: "b".into() }],
        0,
    );
    let b = Parameter::unmaterialized(
        "b",
        &[3],
        DType::F32,
        true,
        vec![InitOp::CopyFrom { source: "a".into() }],
        0,
    );
    let plan = InitPlan::new(vec![a.clone(), b]).unwrap();
    let err = plan
        .materialize_unit(std::slice::from_ref(&a), &Device::cpu(5))
        .unwrap_err();
    assert_eq!(
        err,
        MaterializeError::DependencyCycle {
            cycle: vec!["a".into(), "b".into(), "a".into()]
        }
    );
    assert!(err.to_string().contains("a -> b -> a"));

    let big = Parameter::unmaterialized("big", &[4], DType::F32, true, normal(), 0);
    let small = Parameter::unmaterialized("small", &[3], DType::F32, true, copy("big", 1.0), 0);
    let plan = InitPlan::new(vec![big, small.clone()]).unwrap();
    assert!(matches!(
        plan.materialize_unit(&[small], &Device::cpu(5)),
        Err(MaterializeError::Init(InitError::CopySizeMismatch {
            expected: 3,
            got: 4,
            ..
        }))
    ));
}

#[test]
fn a_panicking_closure_is_an_error_not_a_panic() {
    let p = Parameter::unmaterialized(
        "boom",
        &[4],
        DType::F32,
        true,
        vec![InitOp::custom("explodes", |_: &mut [f32], _: &[usize]| {
            panic!("closure exploded")
        })],
        0,
    );
    let dev = Device::cpu(6);
    let err = fsdp_init::materialize_unit(&[p], &dev).unwrap_err();
    match err {
        MaterializeError::Alloc(AllocError::StreamFailed { message, .. }) => {
            assert!(message.contains("closure exploded"), "{message}")
        }
        e => panic!("expected a stream failure, got {e}"),
    }
}

#[test]
fn tied_parameters_are_one_entry() {
    let dev = Device::cpu(7);
    let ctx = InitContext::fake(SEED);
    let w = ctx
        .param("tok_emb.weight", &[5, 3], DType::F32, normal())
        .unwrap();
    // The same parameter reached twice (as a tied head would be).
    let plan = InitPlan::new(vec![w.clone(), w.clone()]).unwrap();
    assert_eq!(plan.len(), 1);
    plan.materialize_unit(&[w.clone(), w.clone()], &dev)
        .unwrap();
    assert!(w.is_materialized());
}
