//! What each rank launches for one collective: pure arithmetic on the ranks' device addresses,
//! shared by the CUDA path (`exec.rs`) and the host emulator tests, so both run the same
//! launches with the same arguments and grids.
//!
//! Every rank *pulls*: its launches write only its own output (or, for all-reduce, its own
//! buffer) and read the peers' inputs, so the ranks' launches of one phase may run in any order
//! or at the same time. All-reduce has two phases: each rank reduces its chunk of every rank's
//! buffer into its own buffer (in place), then, after every rank's first phase, copies the
//! other ranks' reduced chunks into its buffer.

// Without the `cuda` feature only the emulator tests launch, so the launch-side items are
// unused there.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use fsdp_alloc::DType;

use crate::desc::OpDesc;
use crate::types::OpKind;

/// Threads per block of every launch (`SG_BLOCK` in `kernels.cu`).
pub(crate) const BLOCK: u32 = 256;

/// Most sources one launch takes (`SG_MAX_SOURCES` in `kernels.cu`): the largest group.
pub(crate) const MAX_SOURCES: usize = 64;

/// Largest grid (x) of a launch: the kernels loop over the grid, so this only bounds
/// parallelism (2048 blocks of 256 threads keep every SM of a current GPU busy).
pub(crate) const MAX_GRID: u64 = 2048;

/// The reduction entry points of `kernels.cu`, one per (buffer, accumulation) dtype pair that
/// [`crate::desc::check_reduce`] allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReduceKernel {
    /// `sg_reduce_f32`.
    F32,
    /// `sg_reduce_f16_f32`: f16 buffers, f32 accumulation.
    F16F32,
    /// `sg_reduce_f16`: f16 buffers and accumulation.
    F16,
    /// `sg_reduce_bf16_f32`.
    Bf16F32,
    /// `sg_reduce_bf16`.
    Bf16,
    /// `sg_reduce_i32`.
    I32,
    /// `sg_reduce_i64`.
    I64,
}

impl ReduceKernel {
    /// Every reduction kernel.
    pub(crate) const ALL: [ReduceKernel; 7] = [
        ReduceKernel::F32,
        ReduceKernel::F16F32,
        ReduceKernel::F16,
        ReduceKernel::Bf16F32,
        ReduceKernel::Bf16,
        ReduceKernel::I32,
        ReduceKernel::I64,
    ];

    /// Position in [`ReduceKernel::ALL`] (declaration order).
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The kernel for `dtype` buffers accumulated in `accum`; `None` for pairs without one.
    pub(crate) fn new(dtype: DType, accum: DType) -> Option<ReduceKernel> {
        use DType::*;
        Some(match (dtype, accum) {
            (F32, F32) => ReduceKernel::F32,
            (F16, F32) => ReduceKernel::F16F32,
            (F16, F16) => ReduceKernel::F16,
            (BF16, F32) => ReduceKernel::Bf16F32,
            (BF16, BF16) => ReduceKernel::Bf16,
            (I32, I32) => ReduceKernel::I32,
            (I64, I64) => ReduceKernel::I64,
            _ => return None,
        })
    }

    /// The entry point's name in `kernels.cu`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ReduceKernel::F32 => "sg_reduce_f32",
            ReduceKernel::F16F32 => "sg_reduce_f16_f32",
            ReduceKernel::F16 => "sg_reduce_f16",
            ReduceKernel::Bf16F32 => "sg_reduce_bf16_f32",
            ReduceKernel::Bf16 => "sg_reduce_bf16",
            ReduceKernel::I32 => "sg_reduce_i32",
            ReduceKernel::I64 => "sg_reduce_i64",
        }
    }

    /// Bytes per buffer element.
    pub(crate) fn elem_size(self) -> u64 {
        match self {
            ReduceKernel::F32 | ReduceKernel::I32 => 4,
            ReduceKernel::F16F32 | ReduceKernel::F16 => 2,
            ReduceKernel::Bf16F32 | ReduceKernel::Bf16 => 2,
            ReduceKernel::I64 => 8,
        }
    }
}

/// The name of the copy kernel in `kernels.cu`.
pub(crate) const COPY_KERNEL: &str = "sg_copy";

/// One kernel launch on a rank's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Launch {
    /// `sg_reduce_*`: `dst[i]` = the fold of `srcs[k][i]` in order of `k`, for `i < n`.
    Reduce {
        /// Which entry point.
        kernel: ReduceKernel,
        /// One address per rank, rank order.
        srcs: Vec<u64>,
        /// Where the result goes (may be one of `srcs`).
        dst: u64,
        /// Elements.
        n: u64,
        /// [`ReduceOp::code`].
        op: u32,
        /// The divisor of an average.
        world: u32,
        /// Every address is 16-byte aligned: 16-byte loads and stores.
        vec: bool,
    },
    /// `sg_copy`: source `k` (0 = skipped) goes to bytes `[k·chunk, min((k+1)·chunk, total))` of
    /// `dst`.
    Copy {
        /// Source addresses (0: nothing to copy for that chunk).
        srcs: Vec<u64>,
        /// Start of the destination.
        dst: u64,
        /// Bytes per source.
        chunk: u64,
        /// Bytes of the destination.
        total: u64,
        /// Bytes per load and store (16, 8, 4, 2 or 1): what every address and `chunk` are
        /// aligned to.
        unit: u32,
    },
}

impl Launch {
    /// The entry point's name.
    pub(crate) fn kernel_name(&self) -> &'static str {
        match self {
            Launch::Reduce { kernel, .. } => kernel.name(),
            Launch::Copy { .. } => COPY_KERNEL,
        }
    }

    /// The grid `(x, y)`: y = sources for a copy.
    pub(crate) fn grid(&self) -> (u32, u32) {
        let blocks = |units: u64| units.div_ceil(u64::from(BLOCK)).clamp(1, MAX_GRID) as u32;
        match self {
            Launch::Reduce {
                kernel, n, vec: v, ..
            } => {
                let per = 16 / kernel.elem_size();
                // Vector groups, or elements; the scalar tail is shorter than one group.
                let units = if *v { (n / per).max(n % per) } else { *n };
                (blocks(units), 1)
            }
            Launch::Copy {
                srcs, chunk, unit, ..
            } => (blocks(chunk / u64::from(*unit)), srcs.len() as u32),
        }
    }
}

/// The largest power of two up to 16 that divides every value.
fn alignment(values: impl IntoIterator<Item = u64>) -> u32 {
    let all = values.into_iter().fold(16u64, |acc, v| acc | v);
    1 << all.trailing_zeros().min(4)
}

/// One rank's buffers as the plan sees them: device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RankBuffers {
    /// The input's address (all-gather, reduce-scatter, all-to-all).
    pub input: Option<u64>,
    /// The output's address (the only buffer of all-reduce and broadcast).
    pub output: u64,
}

/// The launches of `rank` for the collective `desc` (validated on every rank), by phase: one
/// phase, or two for all-reduce (the second after every rank's first). `bufs` holds every
/// rank's buffers, in rank order. A phase may be empty (nothing to move).
///
/// # Errors
/// A message naming the missing input (an internal error: validated descriptors of the ops
/// with inputs always carry one).
pub(crate) fn plan(
    rank: usize,
    desc: &OpDesc,
    bufs: &[RankBuffers],
) -> Result<Vec<Vec<Launch>>, String> {
    let world = bufs.len();
    let sz = desc.in_dtype.size() as u64;
    let input = |p: usize| {
        bufs[p]
            .input
            .ok_or_else(|| format!("rank {p} posted a {} without its input", desc.kind))
    };
    let copy = |srcs: Vec<u64>, dst: u64, chunk: u64, total: u64| -> Vec<Launch> {
        if total == 0 || srcs.iter().all(|&s| s == 0) {
            return Vec::new();
        }
        let unit = alignment(srcs.iter().copied().filter(|&s| s != 0).chain([dst, chunk]));
        vec![Launch::Copy {
            srcs,
            dst,
            chunk,
            total,
            unit,
        }]
    };
    let reduce = |srcs: Vec<u64>, dst: u64, n: u64| -> Result<Vec<Launch>, String> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let (op, accum) = desc.reduction();
        let kernel = ReduceKernel::new(desc.in_dtype, accum).ok_or_else(|| {
            format!(
                "no reduction kernel for {} buffers with {accum} accumulation",
                desc.in_dtype
            )
        })?;
        let vec = alignment(srcs.iter().copied().chain([dst])) == 16;
        Ok(vec![Launch::Reduce {
            kernel,
            srcs,
            dst,
            n,
            op: op.code() as u32,
            world: world as u32,
            vec,
        }])
    };
    let me = bufs[rank];
    Ok(match desc.kind {
        OpKind::Barrier => vec![Vec::new()],
        OpKind::AllGather => {
            let nb = desc.in_len as u64 * sz;
            let in_place = input(rank)? == me.output + rank as u64 * nb;
            let srcs = (0..world)
                .map(|p| {
                    if p == rank && in_place {
                        Ok(0)
                    } else {
                        input(p)
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            vec![copy(srcs, me.output, nb, world as u64 * nb)]
        }
        OpKind::ReduceScatter => {
            let n = desc.out_len as u64;
            let srcs = (0..world)
                .map(|p| Ok(input(p)? + rank as u64 * n * sz))
                .collect::<Result<Vec<_>, String>>()?;
            vec![reduce(srcs, me.output, n)?]
        }
        OpKind::AllReduce => {
            // Chunks of `per` elements, a multiple of 16 bytes (so aligned buffers stay aligned
            // chunk by chunk); the last ones may be short or empty. Any split gives the same
            // bits: the reduction is elementwise.
            let len = desc.in_len as u64;
            let per_vec = 16 / sz.clamp(1, 16);
            let per = len.div_ceil(world as u64).div_ceil(per_vec) * per_vec;
            let start = |p: usize| (p as u64 * per).min(len);
            let end = |p: usize| ((p as u64 + 1) * per).min(len);
            let at = |p: usize, q: usize| bufs[p].output + start(q) * sz;
            let srcs = (0..world).map(|p| at(p, rank)).collect();
            let phase_a = reduce(srcs, at(rank, rank), end(rank) - start(rank))?;
            let srcs = (0..world)
                .map(|p| {
                    if p == rank || start(p) == end(p) {
                        0
                    } else {
                        at(p, p)
                    }
                })
                .collect();
            let phase_b = copy(srcs, me.output, per * sz, len * sz);
            vec![phase_a, phase_b]
        }
        OpKind::Broadcast => {
            let root = desc.root.unwrap_or(0);
            let nb = desc.in_len as u64 * sz;
            if rank == root {
                vec![Vec::new()]
            } else {
                vec![copy(vec![bufs[root].output], me.output, nb, nb)]
            }
        }
        OpKind::AllToAll => {
            let nb = (desc.in_len / world.max(1)) as u64 * sz;
            let srcs = (0..world)
                .map(|p| Ok(input(p)? + rank as u64 * nb))
                .collect::<Result<Vec<_>, String>>()?;
            vec![copy(srcs, me.output, nb, world as u64 * nb)]
        }
    })
}
