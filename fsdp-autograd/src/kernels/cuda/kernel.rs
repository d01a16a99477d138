//! What a CUDA kernel is to the launch code: its name and parameter kinds ([`Kernel`]),
//! declared once per kernel next to the op that launches it ([`declare_kernels!`]), grouped per
//! op family with the family's CUDA source ([`Family`]), and the loaded functions of a context
//! ([`LoadedModule`]). A leaf of the CUDA code: the op files and the launch machinery import it;
//! `kernels/program.rs` joins the families into the one NVRTC program.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};

/// Threads per block of every launch (`BLOCK` in `common.cu`; the block reductions need a power
/// of two).
pub(crate) const BLOCK: u32 = 256;

/// Largest grid the launch code uses; kernels loop over the grid, so this only bounds
/// parallelism.
pub(crate) const MAX_GRID: u32 = 65_535;

/// The kind of one kernel parameter, as pushed by the launch code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArgKind {
    /// `u64` (sizes, counts).
    U64,
    /// `float` scalar.
    F32,
    /// `double` scalar.
    F64,
    /// A device address (any pointer type in the CUDA source).
    Ptr,
    /// The `View` struct (by value).
    View,
}

/// One `extern "C" __global__` function of the program: its name in the CUDA source and the
/// kinds of its parameters, in order (checked against the source by a unit test, and against
/// every launch's arguments before it is issued).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kernel {
    name: &'static str,
    params: &'static [ArgKind],
}

impl Kernel {
    /// The kernel `name` taking `params`.
    pub(crate) const fn new(name: &'static str, params: &'static [ArgKind]) -> Kernel {
        Kernel { name, params }
    }

    /// The function's name in the CUDA source.
    pub(crate) fn name(self) -> &'static str {
        self.name
    }

    /// The kinds of its parameters, in order.
    pub(crate) fn signature(self) -> &'static [ArgKind] {
        self.params
    }
}

/// Declares a module's CUDA kernels — the one place each kernel's name and parameter list are
/// written in Rust: `CONST = "cuda_name" [U64, Ptr, …];` makes `pub(crate) const CONST: Kernel`
/// for the launch plans, and `KERNELS`, the module's table, which its family's [`Family`] lists
/// (the NVRTC program's table and the emulator's are built from those).
macro_rules! declare_kernels {
    ($($(#[$m:meta])* $id:ident = $name:literal [$($kind:ident),* $(,)?];)*) => {
        $(
            $(#[$m])*
            pub(crate) const $id: $crate::kernels::cuda::kernel::Kernel =
                $crate::kernels::cuda::kernel::Kernel::new(
                    $name,
                    &[$($crate::kernels::cuda::kernel::ArgKind::$kind),*],
                );
        )*
        /// This module's kernels, in declaration order (listed by its family's `FAMILY`).
        pub(crate) const KERNELS: &[$crate::kernels::cuda::kernel::Kernel] = &[$($id),*];
    };
}
pub(crate) use declare_kernels;

/// An op family's part of the NVRTC program: its CUDA source files and its modules' kernel
/// tables (`kernels/program.rs` joins every family's).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Family {
    /// The family's `.cu` files, in program order (they may use `common.cu` only).
    pub(crate) sources: &'static [&'static str],
    /// The `KERNELS` tables of the family's modules.
    pub(crate) kernels: &'static [&'static [Kernel]],
}

/// The program loaded into one CUDA context: one function per kernel of the table.
pub(crate) struct LoadedModule {
    functions: HashMap<&'static str, CudaFunction>,
    /// Compiled for compute_80 on a device of compute capability 8.0+: the tensor-core
    /// (`mma.sync`) kernels are live (see `kernels/program.rs`).
    tensor_cores: bool,
    // Keeps the module (and through it the context) loaded for the cached functions.
    _module: Arc<CudaModule>,
}

impl LoadedModule {
    /// The loaded `functions` of `module`, compiled for compute_80+ when `tensor_cores`.
    pub(crate) fn new(
        module: Arc<CudaModule>,
        functions: HashMap<&'static str, CudaFunction>,
        tensor_cores: bool,
    ) -> LoadedModule {
        LoadedModule {
            functions,
            tensor_cores,
            _module: module,
        }
    }

    /// Whether the program was compiled for compute_80 on a compute-capability-8.0+ device, so
    /// its `mma.sync` kernels run on the tensor cores.
    pub(crate) fn tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    /// The loaded function of `kernel` (`None` for a kernel outside the program's table).
    pub(crate) fn function(&self, kernel: Kernel) -> Option<&CudaFunction> {
        self.functions.get(kernel.name())
    }
}
