//! The x86-64 instruction-set level the CPU kernels run at: the widest the CPU has, chosen at run
//! time, capped by the `FSDP_CPU_ISA` environment variable.
//!
//! Two kinds of kernel follow the level:
//! - the matrix products ([`matmul`](super::matmul), [`bmm`](super::bmm), attention's blocked
//!   products): `gemm`'s microkernels for the level (AVX-512: 16 f32 lanes; AVX2 + FMA: 8;
//!   baseline: `gemm`'s portable scalar kernel). Each level has its own kernel shapes, blocking
//!   and fused multiply-adds, so **products differ in the last bits between levels**;
//! - this crate's element-wise, row and reduction kernels (GELU, layer norm, softmax, attention's
//!   row loops, column sums, the optimizers' updates, …): compiled once per level through `pulp`
//!   and picked at run time; only the lane width changes (no fused multiply-adds are formed, the
//!   reductions keep fixed lanes), so they give **the same bits on every level** (tested).
//!
//! At one level every result is deterministic: the same bits on every call, thread count, rank
//! and process (so FSDP on W ranks equals one rank with W-way gradient accumulation, bit for bit,
//! on each level; `cargo xtask ci` runs the parity tests under each forced level). Between levels,
//! training results differ in the last bits of the products and so in the loss after a few steps.
//!
//! The level is read once per process (the first kernel call). `FSDP_CPU_ISA=baseline|avx2|avx512`
//! caps it: a cap above what the CPU has changes nothing; an unknown value is reported once on
//! stderr and ignored (a program can refuse it up front with [`cpu_isa_cap`]). Off x86-64 the
//! level is always [`CpuIsa::Baseline`] and `gemm` and `pulp` pick their own kernels for the
//! target (e.g. NEON), unaffected by the variable.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

/// The environment variable that caps the CPU kernels' instruction-set level.
pub const CPU_ISA_ENV: &str = "FSDP_CPU_ISA";

/// An x86-64 instruction-set level of the CPU kernels, from narrowest to widest (the order is
/// the derived `Ord`).
///
/// ```
/// use fsdp_autograd::kernels::cpu::CpuIsa;
/// assert_eq!("avx2".parse::<CpuIsa>().unwrap(), CpuIsa::Avx2);
/// assert!(CpuIsa::Baseline < CpuIsa::Avx512);
/// assert_eq!(CpuIsa::Avx512.to_string(), "avx512");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuIsa {
    /// Baseline x86-64 (SSE2, 4 f32 lanes); `gemm`'s portable scalar kernels. Off x86-64: the
    /// target's own kernels.
    Baseline,
    /// x86-64-v3: AVX2 and FMA (8 f32 lanes).
    Avx2,
    /// x86-64-v4: AVX-512 F, BW, CD, DQ and VL (16 f32 lanes).
    Avx512,
}

impl CpuIsa {
    /// Every level, narrowest first.
    pub const ALL: [CpuIsa; 3] = [CpuIsa::Baseline, CpuIsa::Avx2, CpuIsa::Avx512];

    /// The name `FSDP_CPU_ISA` takes and reports print: `baseline`, `avx2` or `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            CpuIsa::Baseline => "baseline",
            CpuIsa::Avx2 => "avx2",
            CpuIsa::Avx512 => "avx512",
        }
    }
}

impl fmt::Display for CpuIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A value of `FSDP_CPU_ISA` (or a string given to [`CpuIsa::from_str`]) that names no level.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{CPU_ISA_ENV}={value:?} is not a CPU level: use baseline, avx2 or avx512 (or unset it for \
     the widest level this CPU has)"
)]
pub struct CpuIsaError {
    /// The value that was given.
    pub value: String,
}

impl FromStr for CpuIsa {
    type Err = CpuIsaError;

    /// `baseline`, `avx2` or `avx512`, in any case, surrounding blanks ignored.
    fn from_str(s: &str) -> Result<CpuIsa, CpuIsaError> {
        let t = s.trim().to_ascii_lowercase();
        CpuIsa::ALL
            .into_iter()
            .find(|l| l.name() == t)
            .ok_or_else(|| CpuIsaError {
                value: s.to_string(),
            })
    }
}

/// The widest level this CPU (and OS) supports, detected once.
///
/// `Avx512` needs what both `pulp`'s x86-64-v4 level and `gemm`'s AVX-512 kernels require,
/// `Avx2` what their x86-64-v3 levels require (AVX2, FMA, F16C, …).
pub fn detected_cpu_isa() -> CpuIsa {
    static DETECTED: OnceLock<CpuIsa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuIsa {
    if pulp::x86::V4::try_new().is_some() && gemm_common::simd::V4::try_new().is_some() {
        CpuIsa::Avx512
    } else if pulp::x86::V3::try_new().is_some() && gemm_common::simd::V3::try_new().is_some() {
        CpuIsa::Avx2
    } else {
        CpuIsa::Baseline
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuIsa {
    CpuIsa::Baseline
}

/// The cap `FSDP_CPU_ISA` sets, read from the environment now: `Ok(None)` when it is unset or
/// empty.
///
/// # Errors
/// [`CpuIsaError`] when it is set to something other than `baseline`, `avx2` or `avx512`
/// (a program can refuse to start on it; the kernels themselves ignore such a value, see
/// [`cpu_isa`]).
pub fn cpu_isa_cap() -> Result<Option<CpuIsa>, CpuIsaError> {
    match std::env::var(CPU_ISA_ENV) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v.parse().map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(CpuIsaError {
            value: v.to_string_lossy().into_owned(),
        }),
    }
}

/// The level the CPU kernels run at in this process: [`detected_cpu_isa`], capped by
/// `FSDP_CPU_ISA`. Read once, at the first call (later changes of the variable have no effect),
/// so every kernel of a run uses one level. An invalid `FSDP_CPU_ISA` is reported once on stderr
/// and ignored.
///
/// ```
/// use fsdp_autograd::kernels::cpu::{cpu_isa, detected_cpu_isa};
/// assert!(cpu_isa() <= detected_cpu_isa());
/// ```
pub fn cpu_isa() -> CpuIsa {
    static ACTIVE: OnceLock<CpuIsa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let detected = detected_cpu_isa();
        match cpu_isa_cap() {
            Ok(Some(cap)) => cap.min(detected),
            Ok(None) => detected,
            Err(e) => {
                eprintln!("fsdp-autograd: {e}; ignored, the CPU kernels run at {detected}");
                detected
            }
        }
    })
}

/// The level of the element-wise and row kernels called on this thread: [`cpu_isa`], or in this
/// crate's tests the level a test forced on its thread (`forced`).
#[inline]
pub(crate) fn simd_level() -> CpuIsa {
    #[cfg(test)]
    if let Some(l) = forced::SIMD.with(std::cell::Cell::get) {
        return l;
    }
    cpu_isa()
}

/// The level of the matrix products called on this thread: [`cpu_isa`], or in this crate's tests
/// the level a test forced on its thread (`forced::with`).
#[inline]
pub(crate) fn gemm_level() -> CpuIsa {
    #[cfg(test)]
    if let Some(l) = forced::GEMM.with(std::cell::Cell::get) {
        return l;
    }
    cpu_isa()
}

/// Test switches: run the kernels called on this thread at a given level (capped at the
/// detected one). Thread-local, so tests running concurrently are unaffected.
#[cfg(test)]
pub(crate) mod forced {
    use super::{detected_cpu_isa, CpuIsa};
    use std::cell::Cell;
    use std::thread::LocalKey;

    thread_local! {
        pub(super) static SIMD: Cell<Option<CpuIsa>> = const { Cell::new(None) };
        pub(super) static GEMM: Cell<Option<CpuIsa>> = const { Cell::new(None) };
    }

    fn scoped<R>(
        keys: &[&'static LocalKey<Cell<Option<CpuIsa>>>],
        level: CpuIsa,
        f: impl FnOnce() -> R,
    ) -> R {
        let l = Some(level.min(detected_cpu_isa()));
        let before: Vec<_> = keys.iter().map(|k| k.with(|c| c.replace(l))).collect();
        let r = f();
        for (k, b) in keys.iter().zip(before) {
            k.with(|c| c.set(b));
        }
        r
    }

    /// Runs `f` with every kernel on this thread (products included) at `level`.
    pub(crate) fn with<R>(level: CpuIsa, f: impl FnOnce() -> R) -> R {
        scoped(&[&SIMD, &GEMM], level, f)
    }

    /// Runs `f` with the element-wise and row kernels on this thread at `level`; the matrix
    /// products stay at the process's level (so a kernel mixing both can be checked for the
    /// claim that its element-wise part gives the same bits on every level).
    pub(crate) fn with_simd<R>(level: CpuIsa, f: impl FnOnce() -> R) -> R {
        scoped(&[&SIMD], level, f)
    }

    /// The levels this CPU can run, narrowest first.
    pub(crate) fn available() -> Vec<CpuIsa> {
        CpuIsa::ALL
            .into_iter()
            .filter(|&l| l <= detected_cpu_isa())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_values_say_what_to_use() {
        for l in CpuIsa::ALL {
            assert_eq!(l.name().parse::<CpuIsa>().unwrap(), l);
            assert_eq!(l.to_string().to_uppercase().parse::<CpuIsa>().unwrap(), l);
        }
        assert_eq!(" avx512 ".parse::<CpuIsa>().unwrap(), CpuIsa::Avx512);
        let err = "avx-2".parse::<CpuIsa>().unwrap_err();
        assert_eq!(err.value, "avx-2");
        let msg = err.to_string();
        assert!(
            msg.contains("FSDP_CPU_ISA") && msg.contains("baseline, avx2 or avx512"),
            "{msg}"
        );
    }

    #[test]
    fn the_active_level_is_the_detected_one_capped_by_the_environment() {
        // Under CI's forced-level runs this is the check that the level asked for is in effect.
        let cap = cpu_isa_cap().expect("FSDP_CPU_ISA names a level in the test runs");
        let want = cap.map_or(detected_cpu_isa(), |c| c.min(detected_cpu_isa()));
        assert_eq!(cpu_isa(), want);
        assert!(CpuIsa::Baseline < CpuIsa::Avx2 && CpuIsa::Avx2 < CpuIsa::Avx512);
    }

    #[test]
    fn forcing_is_per_thread_and_restored() {
        let outer = (simd_level(), gemm_level());
        forced::with(CpuIsa::Baseline, || {
            assert_eq!(
                (simd_level(), gemm_level()),
                (CpuIsa::Baseline, CpuIsa::Baseline)
            );
            std::thread::scope(|s| {
                s.spawn(|| assert_eq!(simd_level(), cpu_isa()));
            });
            forced::with_simd(CpuIsa::Avx512, || {
                assert_eq!(simd_level(), detected_cpu_isa());
                assert_eq!(gemm_level(), CpuIsa::Baseline);
            });
        });
        assert_eq!((simd_level(), gemm_level()), outer);
        assert_eq!(forced::available()[0], CpuIsa::Baseline);
    }
}
