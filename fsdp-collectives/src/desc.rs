//! Descriptors: what one rank passed to one collective, and the validation every backend runs on
//! the descriptors of *all* ranks, so that every rank reports the same error for the same bad call.

use fsdp_alloc::DType;

use crate::error::{CollectiveError, Result};
use crate::types::{DeviceSlice, OpKind, ReduceOp};

/// What one rank passed to one collective (no pointers: it can be exchanged between processes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub kind: OpKind,
    pub in_dtype: DType,
    pub out_dtype: DType,
    pub in_len: usize,
    pub out_len: usize,
    pub op: Option<ReduceOp>,
    pub accum: Option<DType>,
    pub root: Option<usize>,
    /// A problem with this rank's buffers that the other ranks cannot recompute.
    pub bad_buffer: Option<BufferProblem>,
}

/// Buffer problems a rank reports through its descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BufferProblem {
    /// Input and output overlap in a way the op does not allow.
    Alias,
    /// The memory is not where the backend can use it (e.g. device memory on a host stream).
    Placement,
}

/// True if `inner` starts exactly `offset` bytes into `outer` (same segment).
fn located_at(inner: &DeviceSlice, outer: &DeviceSlice, offset: usize) -> bool {
    let (si, oi) = inner.data().location();
    let (so, oo) = outer.data().location();
    si == so && oi == oo + offset
}

impl OpDesc {
    /// The reduction and its accumulation dtype (sum in the buffer dtype when unset).
    pub(crate) fn reduction(&self) -> (ReduceOp, DType) {
        (
            self.op.unwrap_or(ReduceOp::Sum),
            self.accum.unwrap_or(self.in_dtype),
        )
    }

    fn base(kind: OpKind, dtype: DType, len: usize) -> OpDesc {
        OpDesc {
            kind,
            in_dtype: dtype,
            out_dtype: dtype,
            in_len: len,
            out_len: len,
            op: None,
            accum: None,
            root: None,
            bad_buffer: None,
        }
    }

    pub fn all_gather(input: &DeviceSlice, output: &DeviceSlice, rank: usize) -> OpDesc {
        // In place is allowed: the input is exactly this rank's chunk of the output.
        let bad_alias = input.data().overlaps(output.data())
            && !located_at(input, output, rank * input.nbytes());
        OpDesc {
            out_dtype: output.dtype(),
            out_len: output.len(),
            bad_buffer: bad_alias.then_some(BufferProblem::Alias),
            ..OpDesc::base(OpKind::AllGather, input.dtype(), input.len())
        }
    }

    pub fn reduce_scatter(
        input: &DeviceSlice,
        output: &DeviceSlice,
        op: ReduceOp,
        accum: DType,
        rank: usize,
    ) -> OpDesc {
        // In place is allowed: the output is exactly this rank's chunk of the input.
        let bad_alias = input.data().overlaps(output.data())
            && !located_at(output, input, rank * output.nbytes());
        OpDesc {
            out_dtype: output.dtype(),
            out_len: output.len(),
            op: Some(op),
            accum: Some(accum),
            bad_buffer: bad_alias.then_some(BufferProblem::Alias),
            ..OpDesc::base(OpKind::ReduceScatter, input.dtype(), input.len())
        }
    }

    pub fn all_reduce(buf: &DeviceSlice, op: ReduceOp, accum: DType) -> OpDesc {
        OpDesc {
            op: Some(op),
            accum: Some(accum),
            ..OpDesc::base(OpKind::AllReduce, buf.dtype(), buf.len())
        }
    }

    pub fn broadcast(buf: &DeviceSlice, root: usize) -> OpDesc {
        OpDesc {
            root: Some(root),
            ..OpDesc::base(OpKind::Broadcast, buf.dtype(), buf.len())
        }
    }

    pub fn all_to_all(input: &DeviceSlice, output: &DeviceSlice) -> OpDesc {
        // No in-place form: every rank writes every chunk of its output while peers still read
        // its input.
        let bad_alias = input.data().overlaps(output.data());
        OpDesc {
            out_dtype: output.dtype(),
            out_len: output.len(),
            bad_buffer: bad_alias.then_some(BufferProblem::Alias),
            ..OpDesc::base(OpKind::AllToAll, input.dtype(), input.len())
        }
    }

    pub fn barrier() -> OpDesc {
        OpDesc::base(OpKind::Barrier, DType::U8, 0)
    }

    /// The checks that depend on this rank's arguments alone.
    pub fn local_check(&self, rank: usize, world: usize) -> Result<()> {
        let op = self.kind;
        if self.in_dtype != self.out_dtype {
            return Err(CollectiveError::DtypeMismatch {
                op,
                rank,
                input: self.in_dtype,
                output: self.out_dtype,
            });
        }
        let size_ok = match op {
            OpKind::AllGather => self.in_len.checked_mul(world) == Some(self.out_len),
            OpKind::ReduceScatter => self.out_len.checked_mul(world) == Some(self.in_len),
            OpKind::AllToAll => self.in_len == self.out_len && self.in_len % world.max(1) == 0,
            _ => true,
        };
        if !size_ok {
            return Err(CollectiveError::SizeMismatch {
                op,
                rank,
                world_size: world,
                input_len: self.in_len,
                output_len: self.out_len,
            });
        }
        if let (Some(_), Some(accum)) = (self.op, self.accum) {
            check_reduce(op, rank, self.in_dtype, accum)?;
        }
        if let Some(root) = self.root {
            if root >= world {
                return Err(CollectiveError::InvalidRoot {
                    op,
                    rank,
                    root,
                    world_size: world,
                });
            }
        }
        match self.bad_buffer {
            None => {}
            Some(BufferProblem::Alias) => {
                if op == OpKind::AllToAll {
                    return Err(CollectiveError::InvalidBuffer {
                        op,
                        rank,
                        detail: "input and output overlap, but all_to_all has no in-place form; \
                                 use separate buffers"
                            .into(),
                    });
                }
                return Err(CollectiveError::InvalidBuffer {
                    op,
                    rank,
                    detail: format!(
                        "input and output overlap, but the only aliasing {op} allows is the \
                         in-place form where the {} is exactly this rank's chunk of the {}; use \
                         separate buffers",
                        if op == OpKind::AllGather {
                            "input"
                        } else {
                            "output"
                        },
                        if op == OpKind::AllGather {
                            "output"
                        } else {
                            "input"
                        },
                    ),
                });
            }
            Some(BufferProblem::Placement) => {
                return Err(CollectiveError::InvalidBuffer {
                    op,
                    rank,
                    detail: "the buffers are not where the backend can use them: host memory \
                             needs a CPU stream, device memory a CUDA stream of the group's \
                             device"
                        .into(),
                })
            }
        }
        Ok(())
    }

    /// Encodes the descriptor as integers (for exchanging it through a collective).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn to_words(self) -> [i64; WORDS] {
        [
            self.kind.code(),
            dtype_code(self.in_dtype),
            dtype_code(self.out_dtype),
            self.in_len as i64,
            self.out_len as i64,
            self.op.map_or(0, |o| o.code()),
            self.accum.map_or(0, dtype_code),
            self.root.map_or(-1, |r| r as i64),
            match self.bad_buffer {
                None => 0,
                Some(BufferProblem::Alias) => 1,
                Some(BufferProblem::Placement) => 2,
            },
        ]
    }

    /// Decodes [`OpDesc::to_words`]; `None` for garbage.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn from_words(w: &[i64]) -> Option<OpDesc> {
        if w.len() != WORDS || w[3] < 0 || w[4] < 0 {
            return None;
        }
        Some(OpDesc {
            kind: OpKind::from_code(w[0])?,
            in_dtype: dtype_from_code(w[1])?,
            out_dtype: dtype_from_code(w[2])?,
            in_len: w[3] as usize,
            out_len: w[4] as usize,
            op: if w[5] == 0 {
                None
            } else {
                Some(ReduceOp::from_code(w[5])?)
            },
            accum: if w[6] == 0 {
                None
            } else {
                Some(dtype_from_code(w[6])?)
            },
            root: if w[7] < 0 { None } else { Some(w[7] as usize) },
            bad_buffer: match w[8] {
                0 => None,
                1 => Some(BufferProblem::Alias),
                2 => Some(BufferProblem::Placement),
                _ => return None,
            },
        })
    }
}

/// Number of integers in an encoded descriptor.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const WORDS: usize = 9;

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::U8 => 6,
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn dtype_from_code(c: i64) -> Option<DType> {
    Some(match c {
        1 => DType::F32,
        2 => DType::F16,
        3 => DType::BF16,
        4 => DType::I32,
        5 => DType::I64,
        6 => DType::U8,
        _ => return None,
    })
}

/// The (buffer dtype, accumulation dtype) pairs reductions support.
pub(crate) fn check_reduce(op: OpKind, rank: usize, dtype: DType, accum: DType) -> Result<()> {
    use DType::*;
    match (dtype, accum) {
        (F32, F32)
        | (F16, F32)
        | (F16, F16)
        | (BF16, F32)
        | (BF16, BF16)
        | (I32, I32)
        | (I64, I64) => Ok(()),
        _ => Err(CollectiveError::UnsupportedDtype {
            op,
            rank,
            dtype,
            accum,
            reason: "supported are f32 with f32, f16 and bf16 with f32 or their own dtype, i32 \
                     with i32 and i64 with i64; u8 buffers can be gathered and broadcast but not \
                     reduced"
                .into(),
        }),
    }
}

fn differ<T: PartialEq + std::fmt::Debug>(
    descs: &[OpDesc],
    what: &'static str,
    get: impl Fn(&OpDesc) -> T,
    group: &str,
    seq: u64,
) -> Result<()> {
    let first = get(&descs[0]);
    if let Some((r, d)) = descs.iter().enumerate().find(|(_, d)| get(d) != first) {
        let show = |v: T| {
            format!("{v:?}")
                .trim_start_matches("Some(")
                .trim_end_matches(')')
                .to_string()
        };
        return Err(CollectiveError::InconsistentArgs {
            op: descs[0].kind,
            group: group.to_string(),
            seq,
            what,
            rank_a: 0,
            value_a: show(first),
            rank_b: r,
            value_b: show(get(d)),
        });
    }
    Ok(())
}

/// Checks the descriptors of all ranks (index = rank) of collective `seq`. Deterministic: every
/// rank computes the same result from the same descriptors.
pub(crate) fn validate(group: &str, seq: u64, descs: &[OpDesc]) -> Result<()> {
    let world = descs.len();
    if world == 0 {
        return Ok(());
    }
    if let Some((r, d)) = descs
        .iter()
        .enumerate()
        .find(|(_, d)| d.kind != descs[0].kind)
    {
        return Err(CollectiveError::OpMismatch {
            group: group.to_string(),
            seq,
            rank_a: 0,
            op_a: descs[0].kind,
            rank_b: r,
            op_b: d.kind,
        });
    }
    for (r, d) in descs.iter().enumerate() {
        d.local_check(r, world)?;
    }
    differ(descs, "dtype", |d| d.in_dtype, group, seq)?;
    differ(descs, "input length", |d| d.in_len, group, seq)?;
    differ(descs, "output length", |d| d.out_len, group, seq)?;
    differ(descs, "reduce op", |d| d.op, group, seq)?;
    differ(descs, "accumulation dtype", |d| d.accum, group, seq)?;
    differ(descs, "root", |d| d.root, group, seq)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ag(in_len: usize, out_len: usize) -> OpDesc {
        OpDesc {
            out_len,
            ..OpDesc::base(OpKind::AllGather, DType::F32, in_len)
        }
    }

    #[test]
    fn first_bad_rank_wins_and_names_both_lengths() {
        let descs = [ag(4, 12), ag(4, 12), ag(4, 11)];
        let e = validate("g", 7, &descs).unwrap_err();
        assert_eq!(
            e,
            CollectiveError::SizeMismatch {
                op: OpKind::AllGather,
                rank: 2,
                world_size: 3,
                input_len: 4,
                output_len: 11
            }
        );
        let msg = e.to_string();
        assert!(
            msg.contains("input has 4 elements and output has 11"),
            "{msg}"
        );
        assert!(
            msg.contains("output length = world size × input length"),
            "{msg}"
        );
    }

    #[test]
    fn cross_rank_disagreement_is_reported() {
        let descs = [ag(4, 8), ag(5, 10)];
        let e = validate("g", 0, &descs).unwrap_err();
        assert!(
            matches!(
                &e,
                CollectiveError::InconsistentArgs { what: "input length", rank_b: 1, value_a, value_b, .. }
                    if value_a == "4" && value_b == "5"
            ),
            "{e}"
        );
        let mixed = [ag(4, 8), OpDesc::barrier()];
        assert!(matches!(
            validate("g", 0, &mixed),
            Err(CollectiveError::OpMismatch { rank_b: 1, .. })
        ));
    }

    #[test]
    fn words_round_trip() {
        let d = OpDesc {
            op: Some(ReduceOp::Avg),
            accum: Some(DType::F32),
            root: Some(3),
            bad_buffer: Some(BufferProblem::Placement),
            ..OpDesc::base(OpKind::ReduceScatter, DType::BF16, 1 << 40)
        };
        assert_eq!(OpDesc::from_words(&d.to_words()), Some(d));
        assert_eq!(OpDesc::from_words(&[0; WORDS]), None);
    }

    #[test]
    fn reduce_dtype_support() {
        assert!(check_reduce(OpKind::AllReduce, 0, DType::BF16, DType::F32).is_ok());
        assert!(check_reduce(OpKind::AllReduce, 0, DType::U8, DType::U8).is_err());
        assert!(check_reduce(OpKind::AllReduce, 0, DType::F32, DType::F16).is_err());
        assert!(check_reduce(OpKind::AllReduce, 0, DType::I32, DType::F32).is_err());
    }
}
