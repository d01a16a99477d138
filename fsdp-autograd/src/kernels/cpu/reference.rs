//! A reference f32 GEMM from an independent, well-tuned BLAS (OpenBLAS through its CBLAS
//! interface), loaded at run time: the honest limit the benches and `train_gpt`'s probe compare
//! this crate's products with. Nothing in training calls it, and nothing links against it: a
//! machine without the library runs everything else as before ([`ReferenceGemm::load`] returns a
//! [`ReferenceGemmError`] saying what to install).
//!
//! Which library: `FSDP_REFERENCE_BLAS` (a path or a file name for the dynamic loader) if set,
//! else Debian's OpenBLAS (`libopenblas.so.0`, package `libopenblas0`; `libopenblas.so` from
//! `libopenblas-dev`). It must export `cblas_sgemm`; its thread count is set through
//! `openblas_set_num_threads` (or MKL's `MKL_Set_Num_Threads`) when it has one.
//!
//! Which kernels: OpenBLAS picks its kernels by CPU model when it is loaded (or takes the core
//! named by `OPENBLAS_CORETYPE`), and either can understate the machine's limit: a release older
//! than the CPU (Debian 12's 0.3.21 on AMD Zen 5) falls back to its AVX2 ("Haswell") kernels on
//! an AVX-512 machine, and environments export `OPENBLAS_CORETYPE=Haswell` for their own
//! reasons (the development machine does). So the loader sets `OPENBLAS_CORETYPE`, for the
//! duration of the load only (the previous value is restored after it), to the core matching
//! the CPU kernels' level ([`cpu_isa`](super::cpu_isa)): `SkylakeX` (AVX-512) for `avx512`,
//! `Haswell` (AVX2 + FMA) for `avx2`, `Prescott` (SSE3) for `baseline` — so a run capped with
//! `FSDP_CPU_ISA` compares like with like — or to `FSDP_REFERENCE_CORETYPE` when that is set.
//! [`ReferenceGemm::name`] reports the core in use. Setting a variable races with C code reading
//! the environment on other threads: call [`ReferenceGemm::load`] first thing, or where no other
//! thread reads the environment.

use std::ffi::{c_char, c_float, c_int, CStr};
use std::sync::OnceLock;

use libloading::Library;

use super::isa::{cpu_isa, CpuIsa};
use crate::kernels::check;
use crate::kernels::KernelError;

/// The environment variable naming the reference BLAS library (a path, or a file name the
/// dynamic loader searches for); unset: Debian's OpenBLAS.
pub const REFERENCE_BLAS_ENV: &str = "FSDP_REFERENCE_BLAS";

/// The environment variable naming the OpenBLAS core whose kernels the reference runs (an
/// `OPENBLAS_CORETYPE` value such as `SkylakeX`); unset: the core matching the CPU kernels'
/// level (see the module docs).
pub const REFERENCE_CORETYPE_ENV: &str = "FSDP_REFERENCE_CORETYPE";

/// OpenBLAS's own variable, read when the library loads.
const CORETYPE: &str = "OPENBLAS_CORETYPE";

/// The libraries tried, in order, when `FSDP_REFERENCE_BLAS` is unset.
const DEFAULT_LIBRARIES: [&str; 2] = ["libopenblas.so.0", "libopenblas.so"];

/// CBLAS's `CBLAS_ORDER` / `CBLAS_TRANSPOSE` values.
const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

type SgemmFn = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_float,
    *const c_float,
    c_int,
    *const c_float,
    c_int,
    c_float,
    *mut c_float,
    c_int,
);
type SetThreadsFn = unsafe extern "C" fn(c_int);
type NameFn = unsafe extern "C" fn() -> *const c_char;

/// Why there is no reference GEMM in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceGemmError {
    /// No candidate library could be loaded.
    #[error(
        "no reference BLAS: {tried}; install OpenBLAS (Debian: apt-get install libopenblas0) \
         or set {REFERENCE_BLAS_ENV} to a CBLAS library"
    )]
    NotFound {
        /// Each library tried, with the loader's reason.
        tried: String,
    },
    /// The library loaded but lacks `cblas_sgemm`.
    #[error(
        "reference BLAS {library} has no cblas_sgemm ({reason}); point {REFERENCE_BLAS_ENV} at \
         a library with the CBLAS interface (OpenBLAS: libopenblas.so.0)"
    )]
    NoCblas {
        /// The library that was loaded.
        library: String,
        /// The loader's message.
        reason: String,
    },
}

/// A loaded reference BLAS (see the module docs). Obtained from [`ReferenceGemm::load`]; lives
/// for the rest of the process.
pub struct ReferenceGemm {
    /// Keeps the symbols below valid.
    _lib: Library,
    sgemm: SgemmFn,
    set_threads: Option<SetThreadsFn>,
    name: String,
}

impl std::fmt::Debug for ReferenceGemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceGemm")
            .field("name", &self.name)
            .field("threads_settable", &self.set_threads.is_some())
            .finish()
    }
}

/// The OpenBLAS core whose kernels match `level` (see the module docs).
fn openblas_core(level: CpuIsa) -> &'static str {
    match level {
        CpuIsa::Avx512 => "SkylakeX",
        CpuIsa::Avx2 => "Haswell",
        CpuIsa::Baseline => "Prescott",
    }
}

/// A C string returned by the library, if any.
///
/// # Safety
/// `f` returns null or a NUL-terminated string that stays valid (OpenBLAS's static strings).
unsafe fn c_string(f: Option<NameFn>) -> Option<String> {
    let p = f.map(|f| f())?;
    (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().trim().to_string())
}

impl ReferenceGemm {
    /// Loads the reference BLAS once per process (later calls return the same library, or the
    /// same error).
    ///
    /// # Errors
    /// [`ReferenceGemmError`] when no library loads or it lacks `cblas_sgemm`.
    pub fn load() -> Result<&'static ReferenceGemm, ReferenceGemmError> {
        static LOADED: OnceLock<Result<ReferenceGemm, ReferenceGemmError>> = OnceLock::new();
        LOADED
            .get_or_init(Self::open)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open() -> Result<ReferenceGemm, ReferenceGemmError> {
        let candidates: Vec<String> = match std::env::var(REFERENCE_BLAS_ENV) {
            Ok(v) if !v.trim().is_empty() => vec![v.trim().to_string()],
            _ => DEFAULT_LIBRARIES.iter().map(|s| s.to_string()).collect(),
        };
        // OpenBLAS reads OPENBLAS_CORETYPE in its constructor, i.e. during the load below.
        let inherited = std::env::var_os(CORETYPE);
        let core = match std::env::var(REFERENCE_CORETYPE_ENV) {
            Ok(v) if !v.trim().is_empty() => v.trim().to_string(),
            _ => openblas_core(cpu_isa()).to_string(),
        };
        std::env::set_var(CORETYPE, &core);
        let mut tried = Vec::new();
        let mut loaded = None;
        for name in &candidates {
            // SAFETY: loading a shared library runs its initializers; a BLAS library's do not
            // depend on anything of ours (OpenBLAS's read the environment and start its
            // threads).
            match unsafe { Library::new(name) } {
                Ok(lib) => {
                    loaded = Some((name.clone(), lib));
                    break;
                }
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        match inherited {
            Some(v) => std::env::set_var(CORETYPE, v),
            None => std::env::remove_var(CORETYPE),
        }
        let (file, lib) = loaded.ok_or_else(|| ReferenceGemmError::NotFound {
            tried: tried.join("; "),
        })?;
        // SAFETY: the symbols are CBLAS's and OpenBLAS's/MKL's documented C functions with the
        // signatures of the types they are read as; they stay valid while `lib` lives (it is
        // kept in the returned value, which lives in a static).
        unsafe {
            let sgemm =
                *lib.get::<SgemmFn>(b"cblas_sgemm\0")
                    .map_err(|e| ReferenceGemmError::NoCblas {
                        library: file.clone(),
                        reason: e.to_string(),
                    })?;
            let set_threads = lib
                .get::<SetThreadsFn>(b"openblas_set_num_threads\0")
                .or_else(|_| lib.get::<SetThreadsFn>(b"MKL_Set_Num_Threads\0"))
                .ok()
                .map(|s| *s);
            let config = c_string(lib.get::<NameFn>(b"openblas_get_config\0").ok().map(|s| *s));
            let core = c_string(
                lib.get::<NameFn>(b"openblas_get_corename\0")
                    .ok()
                    .map(|s| *s),
            );
            let name = match (config, core) {
                (Some(cfg), Some(core)) => {
                    // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH …": the first two words.
                    let version: Vec<&str> = cfg.split_whitespace().take(2).collect();
                    format!("{} ({core} kernels, {file})", version.join(" "))
                }
                _ => file.clone(),
            };
            Ok(ReferenceGemm {
                _lib: lib,
                sgemm,
                set_threads,
                name,
            })
        }
    }

    /// The library and, for OpenBLAS, its version and the core whose kernels run, e.g.
    /// `OpenBLAS 0.3.21 (SkylakeX kernels, libopenblas.so.0)`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets the library's thread count (process-wide); `false` if it offers no way to (then it
    /// uses its own default).
    pub fn set_threads(&self, threads: usize) -> bool {
        match self.set_threads {
            Some(f) => {
                // SAFETY: a documented C function taking an int; any positive count is valid.
                unsafe { f(threads.clamp(1, c_int::MAX as usize) as c_int) };
                true
            }
            None => false,
        }
    }

    /// `C (m×n) = op(A) · op(B)` (plus the old `C` if `accumulate`), the same contract and
    /// storage as [`matmul`](super::matmul): row-major, `A` stored `m×k` or `k×m` (`trans_a`),
    /// `B` stored `k×n` or `n×k` (`trans_b`).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] as `matmul`; [`KernelError::InvalidShape`] when a size
    /// exceeds CBLAS's `int`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        m: usize,
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
    ) -> Result<(), KernelError> {
        const OP: &str = "reference_matmul";
        let shape = || format!("m={m}, k={k}, n={n}, trans_a={trans_a}, trans_b={trans_b}");
        check::len(OP, "a", a.len(), check::mul(OP, m, k)?, shape)?;
        check::len(OP, "b", b.len(), check::mul(OP, k, n)?, shape)?;
        check::len(OP, "c", c.len(), check::mul(OP, m, n)?, shape)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                c.fill(0.0);
            }
            return Ok(());
        }
        let int = |v: usize| {
            c_int::try_from(v).map_err(|_| KernelError::InvalidShape {
                op: OP,
                reason: format!("{} exceeds the CBLAS interface's int", shape()),
            })
        };
        let (mi, ki, ni) = (int(m)?, int(k)?, int(n)?);
        let lda = if trans_a { mi } else { ki };
        let ldb = if trans_b { ki } else { ni };
        let t = |x: bool| if x { CBLAS_TRANS } else { CBLAS_NO_TRANS };
        // SAFETY: the slices hold exactly m·k, k·n and m·n elements (checked above), which is
        // what row-major operands with these leading dimensions span; `c` is a unique borrow,
        // so it overlaps neither input; all sizes are positive and fit CBLAS's int.
        unsafe {
            (self.sgemm)(
                CBLAS_ROW_MAJOR,
                t(trans_a),
                t(trans_b),
                mi,
                ni,
                ki,
                1.0,
                a.as_ptr(),
                lda,
                b.as_ptr(),
                ldb,
                if accumulate { 1.0 } else { 0.0 },
                c.as_mut_ptr(),
                ni,
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::testutil::{reference, Rng};

    /// Where the reference BLAS is installed (`.ci/run` installs it; CI sets
    /// `FSDP_REFERENCE_REQUIRED=1`): every transpose and `accumulate` within the f32 bound of the
    /// f64 product, NaNs in an overwritten output ignored, `k = 0` and length errors as `matmul`.
    /// Elsewhere the test checks that the error says what to install.
    #[test]
    fn reference_matches_f64_products_or_says_what_to_install() {
        let r = match ReferenceGemm::load() {
            Ok(r) => r,
            Err(e) => {
                let required = std::env::var("FSDP_REFERENCE_REQUIRED").is_ok_and(|v| v == "1");
                assert!(!required, "FSDP_REFERENCE_REQUIRED=1 but {e}");
                assert!(
                    e.to_string().contains("apt-get install libopenblas0"),
                    "{e}"
                );
                eprintln!("reference BLAS not installed, skipped: {e}");
                return;
            }
        };
        assert!(!r.name().is_empty());
        r.set_threads(1);
        let mut rng = Rng::new(90);
        for &(m, k, n) in &[(1, 1, 1), (3, 2, 5), (17, 33, 9), (70, 65, 66)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    for acc in [false, true] {
                        let (a, b, c0) = (rng.vec(m * k), rng.vec(k * n), rng.vec(m * n));
                        let mut c = if acc {
                            c0.clone()
                        } else {
                            vec![f32::NAN; m * n]
                        };
                        r.matmul(&a, &b, &mut c, m, k, n, ta, tb, acc).unwrap();
                        let (want, mag) = reference(&a, &b, &c0, (m, k, n), ta, tb, acc);
                        let u = f32::EPSILON as f64 / 2.0;
                        let g = (k + 2) as f64 * u / (1.0 - (k + 2) as f64 * u);
                        for (i, ((&got, &w), &s)) in c.iter().zip(&want).zip(&mag).enumerate() {
                            let err = (got as f64 - w).abs();
                            assert!(
                                err <= 2.0 * g * s + 1e-30,
                                "{m}×{k}×{n} [{i}]: {got} vs {w}"
                            );
                        }
                    }
                }
            }
        }
        let mut z = vec![f32::NAN; 6];
        r.matmul(&[], &[], &mut z, 2, 0, 3, false, false, false)
            .unwrap();
        assert_eq!(z, vec![0.0; 6]);
        let err = r
            .matmul(
                &[0.0; 5],
                &[0.0; 12],
                &mut [0.0; 8],
                2,
                3,
                4,
                false,
                false,
                false,
            )
            .unwrap_err();
        assert!(matches!(err, KernelError::LengthMismatch { arg: "a", .. }));
    }
}
