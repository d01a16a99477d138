//! Device mesh: group membership for W = 8, F ∈ {1, 2, 4, 8}, and the hybrid-sharding
//! equivalence (reduce-scatter in shard groups, then all-reduce in replicate groups, equals a
//! global reduce-scatter).
//!
//! Exactness: a global reduce-scatter sums the 8 ranks in order ((x0+x1)+x2)+…; the hybrid path
//! sums within each shard group first and then across groups, a different association. So the
//! results are bitwise equal when the arithmetic is exact (integers; floats holding small
//! integers) or when the association coincides (F = 1: one replicate group of all ranks in
//! order; F = 8: one shard group of all ranks in order). For general floats and 1 < F < 8 they
//! agree to rounding, which is what is checked there.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use fsdp_alloc::Device;
use fsdp_collectives::{
    CollectiveError, DeviceMesh, GroupConfig, ProcessGroup, ReduceOp, ThreadGroup,
};

const W: usize = 8;

fn cfg() -> GroupConfig {
    GroupConfig::default().with_timeout(Duration::from_secs(30))
}

fn on_mesh<T: Send>(meshes: Vec<DeviceMesh>, f: impl Fn(DeviceMesh, Device) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = meshes
            .into_iter()
            .map(|m| {
                let f = &f;
                s.spawn(move || {
                    let dev = Device::cpu(m.rank());
                    f(m, dev)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[test]
fn groups_have_the_documented_members() {
    for f in [1, 2, 4, 8] {
        let meshes = DeviceMesh::threads(W, f, cfg()).unwrap();
        let seen = on_mesh(meshes, |m, dev| {
            let st = dev.new_stream("comm");
            assert_eq!(m.shard_size(), f);
            assert_eq!(m.num_replicas(), W / f);
            assert_eq!(m.shard_group().size(), f);
            assert_eq!(m.replicate_group().size(), W / f);
            assert_eq!(m.shard_group().rank(), m.rank() % f);
            assert_eq!(m.replicate_group().rank(), m.rank() / f);
            assert_eq!(m.shard_group_index(), m.rank() / f);
            assert_eq!(m.replicate_group_index(), m.rank() % f);
            // Gather world ranks through each subgroup: the members, in subgroup rank order.
            let me = [m.rank() as i64];
            let (_b, mine) = upload(&dev, &st, &me);
            let gather = |pg: &Arc<dyn ProcessGroup>| {
                let (_o, out) = alloc_out::<i64>(&dev, &st, pg.size());
                pg.all_gather_into(&mine, &out, &st).wait().unwrap();
                download::<i64>(&out)
                    .into_iter()
                    .map(|x| x as usize)
                    .collect::<Vec<_>>()
            };
            let shard = gather(m.shard_group());
            let replicate = gather(m.replicate_group());
            assert_eq!(shard, m.shard_group_ranks(m.shard_group_index()));
            assert_eq!(
                replicate,
                m.replicate_group_ranks(m.replicate_group_index())
            );
            (shard, replicate)
        });
        for (r, (shard, replicate)) in seen.iter().enumerate() {
            let i = r / f;
            let j = r % f;
            assert_eq!(
                *shard,
                (i * f..(i + 1) * f).collect::<Vec<_>>(),
                "F={f} rank {r}"
            );
            assert_eq!(
                *replicate,
                (0..W / f).map(|k| k * f + j).collect::<Vec<_>>(),
                "F={f} rank {r}"
            );
        }
    }
}

/// Per rank: (hybrid result: RS in the shard group then AR in the replicate group, global RS).
fn hybrid_vs_global<T: TestElem>(
    f: usize,
    n: usize,
    make: impl Fn(usize) -> Vec<T> + Sync,
) -> Vec<(Vec<T>, Vec<T>)> {
    let meshes = DeviceMesh::threads(W, f, cfg()).unwrap();
    on_mesh(meshes, |m, dev| {
        let st = dev.new_stream("comm");
        let grad = make(m.rank()); // length W * n
        let (_g, input) = upload(&dev, &st, &grad);
        // Hybrid: reduce-scatter over F ranks (chunk r mod F of F chunks) ...
        let (_h, shard_out) = alloc_out::<T>(&dev, &st, W * n / f);
        let w1 = m
            .shard_group()
            .reduce_scatter(&input, &shard_out, ReduceOp::Sum, &st);
        // ... then all-reduce across the W/F replicas, queued behind it on the same stream.
        let w2 = m
            .replicate_group()
            .all_reduce(&shard_out, ReduceOp::Sum, &st);
        // Global reduce-scatter over all W ranks, for comparison.
        let (_o, global_out) = alloc_out::<T>(&dev, &st, n);
        let w3 = m
            .world()
            .reduce_scatter(&input, &global_out, ReduceOp::Sum, &st);
        w1.wait().unwrap();
        w2.wait().unwrap();
        w3.wait().unwrap();
        (download::<T>(&shard_out), download::<T>(&global_out))
    })
}

/// Chunk r mod F of the hybrid result covers global chunks j·W/F … (j+1)·W/F.
fn global_equivalent<T: Clone>(results: &[(Vec<T>, Vec<T>)], f: usize, r: usize) -> Vec<T> {
    let j = r % f;
    (j * (W / f)..(j + 1) * (W / f))
        .flat_map(|g| results[g].1.clone())
        .collect()
}

#[test]
fn hybrid_equals_global_reduce_scatter_bitwise_when_exact() {
    let n = 24;
    for f in [1, 2, 4, 8] {
        // Small integers in f32: every partial sum is exact, so any association gives the same bits.
        let res = hybrid_vs_global::<f32>(f, n, |r| {
            data::<i32>(17, r, W * n)
                .iter()
                .map(|&x| (x % 64) as f32)
                .collect()
        });
        for r in 0..W {
            assert_eq!(
                bits(&res[r].0),
                bits(&global_equivalent(&res, f, r)),
                "f32 F={f} rank {r}"
            );
        }
        // Integers (wrapping): exact.
        let res = hybrid_vs_global::<i64>(f, n, |r| data::<i64>(18, r, W * n));
        for r in 0..W {
            assert_eq!(
                res[r].0,
                global_equivalent(&res, f, r),
                "i64 F={f} rank {r}"
            );
        }
    }
}

#[test]
fn hybrid_equals_global_reduce_scatter_for_general_floats() {
    let n = 40;
    for f in [1, 2, 4, 8] {
        let res = hybrid_vs_global::<f32>(f, n, |r| data::<f32>(19, r, W * n));
        for r in 0..W {
            let want = global_equivalent(&res, f, r);
            if f == 1 || f == W {
                // Same association as the global rank-order fold.
                assert_eq!(bits(&res[r].0), bits(&want), "F={f} rank {r}");
            } else {
                for (a, b) in res[r].0.iter().zip(&want) {
                    // 8 addends of magnitude ≤ 100: a few ulps of 800 at most.
                    assert!((a - b).abs() <= 1e-3, "F={f} rank {r}: {a} vs {b}");
                }
            }
        }
    }
}

#[test]
fn shard_sizes_that_do_not_divide_the_world_are_refused() {
    for f in [0, 3, 5, 16] {
        let e = DeviceMesh::threads(W, f, cfg()).unwrap_err();
        assert!(
            matches!(e, CollectiveError::InvalidMesh { world_size: 8, shard_size, .. } if shard_size == f),
            "{e}"
        );
    }
    let world: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(6).remove(0));
    let e = DeviceMesh::new(world, 4).unwrap_err();
    assert!(e.to_string().contains("4 does not divide 6"), "{e}");
}

#[test]
fn from_groups_checks_the_layout() {
    let meshes = DeviceMesh::threads(W, 2, cfg()).unwrap();
    let m = &meshes[3];
    let ok = DeviceMesh::from_groups(
        m.world().clone(),
        m.shard_group().clone(),
        m.replicate_group().clone(),
    )
    .unwrap();
    assert_eq!(ok.shard_group_index(), 1);
    // Shard and replicate swapped: sizes 4 and 2 give F = 4, but rank 3 is not member 3 % 4.
    let e = DeviceMesh::from_groups(
        m.world().clone(),
        m.replicate_group().clone(),
        m.shard_group().clone(),
    )
    .unwrap_err();
    assert!(matches!(e, CollectiveError::InvalidMesh { .. }), "{e}");
}

#[test]
fn splits_must_be_partitions_and_agree_across_ranks() {
    let mut g = ThreadGroup::new(4);
    let e = g[0].split(&[vec![0, 1], vec![2]]).unwrap_err();
    assert!(e.to_string().contains("rank 3 is in no part"), "{e}");
    let e = g[0].split(&[vec![0, 1], vec![1, 2, 3]]).unwrap_err();
    assert!(e.to_string().contains("more than one place"), "{e}");
    // Rank 0 and rank 1 ask for different partitions at the same position.
    let g1 = g.remove(1);
    g[0].split(&[vec![0, 1], vec![2, 3]]).unwrap();
    let e = g1.split(&[vec![0, 2], vec![1, 3]]).unwrap_err();
    assert!(
        matches!(e, CollectiveError::InvalidGroup { rank: 1, .. }),
        "{e}"
    );
}

#[test]
fn a_dead_rank_fails_its_subgroup_peers() {
    let meshes = DeviceMesh::threads(4, 2, cfg()).unwrap();
    let errs = on_mesh(meshes, |m, dev| {
        if m.rank() == 1 {
            return None; // drops its mesh (all its handles)
        }
        let st = dev.new_stream("comm");
        let (_b, buf) = upload(&dev, &st, &[1.0f32, 2.0]);
        Some(
            m.shard_group()
                .all_reduce(&buf, ReduceOp::Sum, &st)
                .wait()
                .map_err(|e| e.to_string()),
        )
    });
    // Rank 0 shares shard group {0, 1} with the dead rank; ranks 2 and 3 are unaffected.
    assert!(errs[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .unwrap_err()
        .contains("rank 1 left the group"));
    assert!(errs[2].as_ref().unwrap().is_ok());
    assert!(errs[3].as_ref().unwrap().is_ok());
}
