//! The 2-D device mesh of hybrid sharding.
//!
//! With W ranks and a sharding factor F dividing W, rank r belongs to
//! - the **shard group** S_i, i = r / F: the F consecutive ranks i·F … i·F+F−1 (parameters and
//!   gradients are sharded across it; rank r is member r mod F);
//! - the **replicate group** R_j, j = r mod F: the W/F ranks j, j+F, j+2F, … that hold the same
//!   shard (gradients are all-reduced across it; rank r is member r / F).
//!
//! Reduce-scatter in S_i followed by all-reduce in R_j leaves on rank r the sum over all W ranks
//! of chunk r mod F (F chunks) — the same numbers a global reduce-scatter produces for the W/F
//! consecutive global chunks that make up that chunk (the paper's hybrid sharding equivalence).

use std::sync::Arc;

use crate::error::{CollectiveError, Result};
use crate::group::ProcessGroup;
use crate::thread::{GroupConfig, ThreadGroup};

/// One rank's view of a (replicate × shard) mesh: its world group, shard group and replicate
/// group, all real [`ProcessGroup`]s.
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    world: Arc<dyn ProcessGroup>,
    shard: Arc<dyn ProcessGroup>,
    replicate: Arc<dyn ProcessGroup>,
    shard_size: usize,
}

/// Checks the mesh shape.
fn check_shape(world_size: usize, shard_size: usize) -> Result<()> {
    let bad = |reason: &str| CollectiveError::InvalidMesh {
        world_size,
        shard_size,
        reason: reason.to_string(),
    };
    if world_size == 0 {
        return Err(bad("the world has no ranks"));
    }
    if shard_size == 0 {
        return Err(bad("the shard group size must be at least 1"));
    }
    if world_size % shard_size != 0 {
        return Err(bad(&format!(
            "{shard_size} does not divide {world_size}; pick a sharding factor that divides the \
             world size (e.g. the number of GPUs per node)"
        )));
    }
    Ok(())
}

impl DeviceMesh {
    /// Builds this rank's mesh from its world group, collectively: every rank of `world` calls
    /// `new` with the same `shard_size` (F). F not dividing the world size is
    /// [`CollectiveError::InvalidMesh`].
    pub fn new(world: Arc<dyn ProcessGroup>, shard_size: usize) -> Result<DeviceMesh> {
        let w = world.size();
        check_shape(w, shard_size)?;
        let f = shard_size;
        let shard_parts: Vec<Vec<usize>> =
            (0..w / f).map(|i| (i * f..(i + 1) * f).collect()).collect();
        let replicate_parts: Vec<Vec<usize>> = (0..f)
            .map(|j| (0..w / f).map(|i| i * f + j).collect())
            .collect();
        let shard = world.split(&shard_parts)?;
        let replicate = world.split(&replicate_parts)?;
        Ok(DeviceMesh {
            world,
            shard,
            replicate,
            shard_size,
        })
    }

    /// A mesh over in-process threads: `world_size` ranks in shard groups of `shard_size`, one
    /// `DeviceMesh` per rank, in rank order (hand one to each rank thread).
    pub fn threads(
        world_size: usize,
        shard_size: usize,
        config: GroupConfig,
    ) -> Result<Vec<DeviceMesh>> {
        check_shape(world_size, shard_size)?;
        ThreadGroup::with_config(world_size, config)
            .into_iter()
            .map(|g| DeviceMesh::new(Arc::new(g), shard_size))
            .collect()
    }

    /// Assembles a mesh from groups built elsewhere, checking their sizes and this rank's
    /// positions against the mesh layout.
    pub fn from_groups(
        world: Arc<dyn ProcessGroup>,
        shard: Arc<dyn ProcessGroup>,
        replicate: Arc<dyn ProcessGroup>,
    ) -> Result<DeviceMesh> {
        let f = shard.size();
        check_shape(world.size(), f)?;
        let r = world.rank();
        let bad = |reason: String| CollectiveError::InvalidMesh {
            world_size: world.size(),
            shard_size: f,
            reason,
        };
        if replicate.size() * f != world.size() {
            return Err(bad(format!(
                "the replicate group has {} ranks, expected world / shard = {}",
                replicate.size(),
                world.size() / f
            )));
        }
        if shard.rank() != r % f || replicate.rank() != r / f {
            return Err(bad(format!(
                "world rank {r} should be shard rank {} and replicate rank {}, but the groups say \
                 {} and {}",
                r % f,
                r / f,
                shard.rank(),
                replicate.rank()
            )));
        }
        Ok(DeviceMesh {
            world,
            shard,
            replicate,
            shard_size: f,
        })
    }

    /// The world group.
    pub fn world(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }

    /// This rank's shard group S_i (F ranks).
    pub fn shard_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.shard
    }

    /// This rank's replicate group R_j (W / F ranks).
    pub fn replicate_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.replicate
    }

    /// The sharding factor F.
    pub fn shard_size(&self) -> usize {
        self.shard_size
    }

    /// Number of replicas (W / F).
    pub fn num_replicas(&self) -> usize {
        self.world.size() / self.shard_size
    }

    /// This rank's world rank.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// Index i of this rank's shard group (r / F).
    pub fn shard_group_index(&self) -> usize {
        self.rank() / self.shard_size
    }

    /// Index j of this rank's replicate group (r mod F) = which shard it holds.
    pub fn replicate_group_index(&self) -> usize {
        self.rank() % self.shard_size
    }

    /// World ranks of shard group `i`.
    pub fn shard_group_ranks(&self, i: usize) -> Vec<usize> {
        (i * self.shard_size..(i + 1) * self.shard_size).collect()
    }

    /// World ranks of replicate group `j`.
    pub fn replicate_group_ranks(&self, j: usize) -> Vec<usize> {
        (0..self.num_replicas())
            .map(|i| i * self.shard_size + j)
            .collect()
    }
}
