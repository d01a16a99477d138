//! [`OpKind`]: which collective an operation is. Its own file so that `error.rs` (which names
//! the op in its messages) and `types.rs` (which returns `error::Result`) do not import each other.

/// Which collective (used in errors and descriptors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`crate::ProcessGroup::all_gather_into`].
    AllGather,
    /// [`crate::ProcessGroup::reduce_scatter`].
    ReduceScatter,
    /// [`crate::ProcessGroup::all_reduce`].
    AllReduce,
    /// [`crate::ProcessGroup::broadcast`].
    Broadcast,
    /// [`crate::ProcessGroup::barrier`].
    Barrier,
    /// [`crate::ProcessGroup::all_to_all_into`].
    AllToAll,
}

impl OpKind {
    /// Lower-case name (`all_gather`, …).
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
            OpKind::AllToAll => "all_to_all",
        }
    }

    /// The even-size rule this op enforces, in words (for error messages).
    pub const fn size_rule(self) -> &'static str {
        match self {
            OpKind::AllGather => "output length = world size × input length",
            OpKind::ReduceScatter => "input length = world size × output length",
            OpKind::AllReduce | OpKind::Broadcast | OpKind::Barrier => {
                "the same length on every rank"
            }
            OpKind::AllToAll => {
                "input length = output length, a multiple of the world size, the same on every rank"
            }
        }
    }

    pub(crate) const fn code(self) -> i64 {
        match self {
            OpKind::AllGather => 1,
            OpKind::ReduceScatter => 2,
            OpKind::AllReduce => 3,
            OpKind::Broadcast => 4,
            OpKind::Barrier => 5,
            OpKind::AllToAll => 6,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) const fn from_code(c: i64) -> Option<OpKind> {
        Some(match c {
            1 => OpKind::AllGather,
            2 => OpKind::ReduceScatter,
            3 => OpKind::AllReduce,
            4 => OpKind::Broadcast,
            5 => OpKind::Barrier,
            6 => OpKind::AllToAll,
            _ => return None,
        })
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
