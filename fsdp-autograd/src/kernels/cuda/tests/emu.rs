//! Client of the host emulator in `emu/`: builds `harness.cpp` once per test run with the
//! system C++ compiler, and runs the production launch plans through it.
//!
//! The emulator executes the program's CUDA source itself (compiled for the host) under a software model of
//! blocks, threads, barriers and shared memory, and cuBLAS's `SgemmStridedBatched` /
//! `GemmStridedBatchedEx` by a plain column-major loop with cuBLAS's argument checks (half inputs
//! read exactly, f32 accumulation, TF32 inputs rounded to 10 mantissa bits). It checks the kernels' logic and the plans'
//! orchestration; it says nothing about real GPUs.

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;

use crate::kernels::attention::flash::{plan_flash, plan_flash_backward, FlashType};
use crate::kernels::attention::flash_mma::plan_flash_mma;
use crate::kernels::attention::unfused::{plan_attention, plan_attention_backward};
use crate::kernels::cuda::desc::view_desc;
use crate::kernels::cuda::kernel::ArgKind;
use crate::kernels::cuda::plan::{GemmType, PArg, Plan, Ptr, Step};
use crate::kernels::cuda::typed::{type_code, types_word};
use crate::kernels::cuda::CudaKernelError;
use crate::kernels::dropout::gpu::plan_dropout_t;
use crate::kernels::elementwise::axpy::gpu::{
    plan_add_row_bias_inplace, plan_add_row_bias_inplace_t, plan_axpy, plan_axpy_t,
};
use crate::kernels::elementwise::binary::gpu::{
    plan_add_row_bias, plan_add_row_bias_t, plan_add_t, plan_binary, plan_binary_t,
};
use crate::kernels::elementwise::binary::gpu::{EW_ADD, EW_MUL, EW_MUL_T};
use crate::kernels::elementwise::cast::gpu::plan_cast;
use crate::kernels::elementwise::cast::gpu::{
    CAST_BF16_F32, CAST_F16_F32, CAST_F32_BF16, CAST_F32_F16,
};
use crate::kernels::elementwise::gelu::gpu::{
    plan_gelu, plan_gelu_backward, plan_gelu_backward_t, plan_gelu_t,
};
use crate::kernels::elementwise::scale::gpu::{
    plan_scale, plan_scale_inplace, plan_scale_inplace_t, plan_scale_t,
};
use crate::kernels::elementwise::silu_mul::gpu::{plan_silu_mul, plan_silu_mul_backward};
use crate::kernels::embedding::gpu::{
    plan_embedding, plan_embedding_backward, plan_embedding_backward_t, plan_embedding_t,
};
use crate::kernels::gemm::gpu::{plan_gemm, plan_gemm_typed};
use crate::kernels::gemm::Gemm;
use crate::kernels::layout::gpu::plan_strided;
use crate::kernels::layout::gpu::{
    STRIDED_ADD_F32, STRIDED_COPY_B2, STRIDED_COPY_B4, STRIDED_COPY_B8,
};
use crate::kernels::loss::gpu::{
    plan_cross_entropy, plan_cross_entropy_backward, plan_cross_entropy_backward_t,
    plan_cross_entropy_t, CeCodes,
};
use crate::kernels::norm::layer_norm::gpu::{
    plan_layer_norm, plan_layer_norm_backward, plan_layer_norm_backward_t, plan_layer_norm_t,
};
use crate::kernels::norm::rms_norm::gpu::{plan_rms_norm, plan_rms_norm_backward};
use crate::kernels::norm::softmax::gpu::{plan_softmax, plan_softmax_backward};
use crate::kernels::optim::adamw::gpu::plan_adamw;
use crate::kernels::optim::lamb::gpu::{plan_lamb_apply, plan_lamb_direction};
use crate::kernels::optim::sgd::gpu::plan_sgd;
use crate::kernels::optim::sum_squares::gpu::plan_sum_squares;
use crate::kernels::optim::unscale::gpu::plan_unscale;
use crate::kernels::reduce::col_sums::gpu::{plan_col_sums, plan_col_sums_t};
use crate::kernels::reduce::sum::gpu::{plan_sum, plan_sum_t};
use crate::kernels::rope::gpu::plan_rope;
use crate::kernels::KernelError;

use super::exec::{CastKind, Exec, Op, TypedOp, H, TH};

/// The emulator binary, built on first use; `Err` says why it is unavailable.
pub(super) fn harness() -> Result<&'static Path, String> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(build).as_deref().map_err(Clone::clone)
}

fn build() -> Result<PathBuf, String> {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let dir = std::env::temp_dir().join(format!("fsdp-cuda-emu-{}", std::process::id()));
    // The emulator's sources are compiled into this test binary and written out next to the
    // build, so that the binary works on a machine that has no copy of this repository (the GPU
    // bundle of `cargo xtask gpu-bundle`). `harness.cpp` includes "cuda_emu.h", "../kernels.cu"
    // (the whole program, `program::source`) and "kernel_table.inc" (its kernel table, generated
    // from the Rust declarations by `kernel_table`): the layout below keeps those paths.
    let emu = dir.join("emu");
    std::fs::create_dir_all(&emu).map_err(|e| format!("creating {}: {e}", emu.display()))?;
    let src = emu.join("harness.cpp");
    for (path, text) in [
        (src.clone(), include_str!("../emu/harness.cpp")),
        (emu.join("cuda_emu.h"), include_str!("../emu/cuda_emu.h")),
        (dir.join("kernels.cu"), crate::kernels::program::source()),
        (emu.join("kernel_table.inc"), &kernel_table()),
    ] {
        std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let bin = dir.join("harness");
    let mut cmd = Command::new(&compiler);
    cmd.args(["-std=c++20", "-O1", "-g", "-pthread", "-ffp-contract=off"]);
    // FSDP_EMU_SANITIZE=address|thread builds the emulator with a sanitizer (out-of-bounds
    // accesses, or data races between the threads of a block).
    if let Ok(s) = std::env::var("FSDP_EMU_SANITIZE") {
        cmd.arg(format!("-fsanitize={s}"));
    }
    let out = cmd
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .output()
        .map_err(|e| format!("running the C++ compiler `{compiler}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{compiler}` failed to build the emulator:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(bin)
}

/// The emulator binary for a test: panics if the compiler exists but the build failed; `None`
/// (after printing why) if there is no C++ compiler.
pub(super) fn harness_or_skip(test: &str) -> Option<&'static Path> {
    match harness() {
        Ok(p) => Some(p),
        Err(e) if e.starts_with("running the C++ compiler") => {
            // CI sets FSDP_EMU_REQUIRED=1 so that a missing compiler fails instead of skipping.
            if std::env::var("FSDP_EMU_REQUIRED").as_deref() == Ok("1") {
                panic!("{test}: FSDP_EMU_REQUIRED=1 but the emulator cannot be built: {e}");
            }
            eprintln!("SKIPPED {test}: no C++ compiler to build the CUDA emulator ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The emulator's kernel table, generated from the program's (`program::all`, the Rust
/// declarations of every kernel): one `K(name),` per kernel, which `harness.cpp` includes into
/// its name → function map (each entry's parameters are converted by the C++ function's types).
fn kernel_table() -> String {
    crate::kernels::program::all()
        .iter()
        .map(|k| format!("K({}),\n", k.name()))
        .collect()
}

/// A running emulator process and the byte lengths of its buffers.
pub(super) struct EmuExec {
    child: Child,
    stdin: BufWriter<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    lens: Vec<usize>,
}

fn hex(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "-".into();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("emulator hex"))
        .collect()
}

impl EmuExec {
    /// Starts an emulator process.
    pub(super) fn start(bin: &Path) -> EmuExec {
        let mut cmd = Command::new(bin);
        // Under a sanitizer, the first report kills the emulator, so the test fails.
        for var in ["TSAN_OPTIONS", "ASAN_OPTIONS"] {
            if std::env::var_os(var).is_none() {
                cmd.env(var, "halt_on_error=1");
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the emulator");
        let stdin = BufWriter::new(child.stdin.take().expect("stdin"));
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        EmuExec {
            child,
            stdin,
            stdout,
            lens: Vec::new(),
        }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("writing to the emulator");
    }

    fn recv(&mut self) -> String {
        self.stdin.flush().expect("flushing to the emulator");
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .expect("reading from the emulator");
        if n == 0 {
            let status = self.child.wait().map(|s| s.to_string());
            panic!("the emulator died ({status:?}); see its error above");
        }
        line.trim_end().to_string()
    }

    /// The kernel names the emulator knows.
    pub(super) fn kernel_names(&mut self) -> Vec<String> {
        self.send("list");
        self.recv().split_whitespace().map(String::from).collect()
    }

    fn addr(h: H) -> u64 {
        ((h as u64) + 1) << 40
    }

    fn read_at(&mut self, addr: u64, bytes: usize) -> Vec<u8> {
        self.send(&format!("read {addr} {bytes}"));
        unhex(&self.recv())
    }

    fn f32s(&self, h: H) -> usize {
        self.lens[h] / 4
    }

    fn dev(h: H) -> Ptr {
        Ptr::Dev(Self::addr(h))
    }

    /// Executes a plan: scratch slots become fresh (0xff-filled) buffers; returns their handles.
    pub(super) fn exec(&mut self, plan: &Plan) -> Vec<H> {
        let slots: Vec<H> = plan
            .scratch
            .iter()
            .map(|&(count, elem)| self.alloc(count * elem.size()))
            .collect();
        let resolve = |p: Ptr| match p {
            Ptr::Dev(a) => a,
            Ptr::Scratch { slot, offset } => Self::addr(slots[slot]) + offset,
        };
        for step in &plan.steps {
            let line = match step {
                Step::Memset { dst, byte, bytes } => {
                    format!("memset {} {byte} {bytes}", resolve(*dst))
                }
                Step::Copy { dst, src, bytes } => {
                    format!("copy {} {} {bytes}", resolve(*dst), resolve(*src))
                }
                Step::Launch { kernel, grid, args } => {
                    let kinds: Vec<ArgKind> = args.iter().map(PArg::kind).collect();
                    assert_eq!(
                        kinds,
                        kernel.signature(),
                        "plan arguments of {}",
                        kernel.name()
                    );
                    let args: Vec<String> = args
                        .iter()
                        .map(|a| match a {
                            PArg::U64(v) => format!("u:{v}"),
                            PArg::F32(v) => format!("f:{:x}", v.to_bits()),
                            PArg::F64(v) => format!("d:{:x}", v.to_bits()),
                            PArg::Ptr(p) => format!("p:{}", resolve(*p)),
                            PArg::View(v) => {
                                let vals: Vec<String> =
                                    v.words().iter().map(u64::to_string).collect();
                                format!("v:{}", vals.join(","))
                            }
                        })
                        .collect();
                    format!(
                        "launch {} {} {} {}",
                        kernel.name(),
                        grid,
                        args.len(),
                        args.join(" ")
                    )
                }
                Step::Gemm {
                    g,
                    a,
                    b,
                    c,
                    alpha,
                    beta,
                    types,
                } => {
                    let ty = |t: GemmType| match t {
                        GemmType::F32 => 0,
                        GemmType::F16 => 1,
                        GemmType::Bf16 => 2,
                    };
                    let t = |op: cudarc::cublas::sys::cublasOperation_t| {
                        u8::from(op == cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T)
                    };
                    format!(
                        "gemm {} {} {} {} {} {:x} {} {} {} {} {} {} {:x} {} {} {} {} {} {} {}",
                        t(g.op_first),
                        t(g.op_second),
                        g.m,
                        g.n,
                        g.k,
                        alpha.to_bits(),
                        resolve(*b),
                        g.ld_first,
                        g.stride_first,
                        resolve(*a),
                        g.ld_second,
                        g.stride_second,
                        beta.to_bits(),
                        resolve(*c),
                        g.ldc,
                        g.stride_c,
                        g.batch,
                        ty(types.ab),
                        ty(types.c),
                        u8::from(types.tf32)
                    )
                }
            };
            self.send(&line);
        }
        slots
    }

    /// Executes a plan with an index check and reports it like `IndexCheck::wait`.
    fn exec_checked(
        &mut self,
        op: &'static str,
        what: &'static str,
        plan: &Plan,
        status: Option<usize>,
        ids: H,
        bound: usize,
    ) -> Result<(), CudaKernelError> {
        let slots = self.exec(plan);
        let Some(slot) = status else {
            return Ok(());
        };
        let word = self.read_at(Self::addr(slots[slot]), 8);
        let position = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        if position == u64::MAX {
            return Ok(());
        }
        let v = self.read_at(Self::addr(ids) + 8 * position, 8);
        Err(KernelError::IndexOutOfRange {
            op,
            what,
            value: i64::from_le_bytes(v.try_into().expect("8 bytes")),
            position: position as usize,
            bound,
        }
        .into())
    }

    /// Runs a plan builder's result.
    fn plan(&mut self, plan: Result<Plan, CudaKernelError>) -> Result<(), CudaKernelError> {
        self.exec(&plan?);
        Ok(())
    }
}

impl EmuExec {
    /// The plan of a typed-kernel call (sizes from the buffers' byte lengths and dtypes).
    fn typed_plan(&self, t: &TypedOp) -> Plan {
        let d = Self::dev;
        let n = |&(h, dt): &TH| (self.lens[h] / dt.size()) as u64;
        let c = |&(_, dt): &TH| type_code(dt).expect("a float dtype");
        match t {
            TypedOp::Add { a, b, out } => plan_add_t(
                types_word(&[c(a), c(b), c(out)]),
                n(a),
                d(a.0),
                d(b.0),
                d(out.0),
            ),
            TypedOp::Mul { a, b, out } => plan_binary_t(
                EW_MUL_T,
                types_word(&[c(a), c(b), c(out)]),
                n(a),
                d(a.0),
                d(b.0),
                d(out.0),
            ),
            TypedOp::Scale { x, alpha, out } => {
                plan_scale_t(types_word(&[c(x), c(out)]), n(x), d(x.0), *alpha, d(out.0))
            }
            TypedOp::ScaleInplace { y, alpha } => {
                plan_scale_inplace_t(types_word(&[c(y)]), n(y), d(y.0), *alpha)
            }
            TypedOp::Sum { x, out, mean } => {
                let divisor = if *mean { n(x) as f64 } else { 1.0 };
                plan_sum_t([c(x), c(out)], n(x), d(x.0), d(out.0), divisor)
            }
            TypedOp::AddScaled { y, alpha, x } => {
                plan_axpy_t(types_word(&[c(y), c(x)]), n(y), d(y.0), *alpha, d(x.0))
            }
            TypedOp::AddRowBias { x, bias, out } => plan_add_row_bias_t(
                types_word(&[c(x), c(bias), c(out)]),
                n(x),
                n(bias),
                d(x.0),
                d(bias.0),
                d(out.0),
            ),
            TypedOp::AddRowBiasInplace { y, bias } => plan_add_row_bias_inplace_t(
                types_word(&[c(y), c(bias)]),
                n(y),
                n(bias),
                d(y.0),
                d(bias.0),
            ),
            TypedOp::ColSums { x, out } => plan_col_sums_t(
                types_word(&[c(x), c(out)]),
                n(x) / n(out),
                n(out),
                d(x.0),
                d(out.0),
            ),
            TypedOp::Gelu { kind, x, y } => {
                plan_gelu_t(*kind, types_word(&[c(x), c(y)]), n(x), d(x.0), d(y.0))
            }
            TypedOp::GeluBackward { kind, x, dy, dx } => plan_gelu_backward_t(
                *kind,
                types_word(&[c(x), c(dy), c(dx)]),
                n(x),
                d(x.0),
                d(dy.0),
                d(dx.0),
            ),
            TypedOp::LayerNorm {
                x,
                gamma,
                beta,
                y,
                mean,
                rstd,
                cols,
                eps,
            } => plan_layer_norm_t(
                [c(x), c(gamma), c(beta), c(y)],
                n(x) / *cols as u64,
                *cols as u64,
                *eps,
                [x.0, gamma.0, beta.0, y.0, *mean, *rstd].map(d),
            ),
            TypedOp::RmsNorm {
                x,
                gamma,
                y,
                rstd,
                cols,
                eps,
            } => plan_rms_norm(
                [c(x), c(gamma), c(y)],
                n(x) / *cols as u64,
                *cols as u64,
                *eps,
                [x.0, gamma.0, y.0, *rstd].map(d),
            ),
            TypedOp::Dropout { x, y, cols, mask } => plan_dropout_t(
                types_word(&[c(x), c(y)]),
                n(x) / *cols as u64,
                *cols as u64,
                mask,
                d(x.0),
                d(y.0),
            ),
            TypedOp::RmsNormBackward {
                x,
                gamma,
                rstd,
                dy,
                dx,
                dgamma,
                cols,
            } => plan_rms_norm_backward(
                [c(x), c(gamma), c(dy), c(dx), c(dgamma)],
                n(x) / *cols as u64,
                *cols as u64,
                [x.0, gamma.0, *rstd, dy.0, dx.0, dgamma.0].map(d),
            ),
            TypedOp::SiluMul { gate, up, y } => {
                plan_silu_mul([c(gate), c(up), c(y)], n(gate), [gate.0, up.0, y.0].map(d))
            }
            TypedOp::SiluMulBackward {
                gate,
                up,
                dy,
                dgate,
                dup,
            } => plan_silu_mul_backward(
                [c(gate), c(up), c(dy), c(dgate), c(dup)],
                n(gate),
                [gate.0, up.0, dy.0, dgate.0, dup.0].map(d),
            ),
            TypedOp::Rope {
                backward,
                input,
                cos,
                sin,
                output,
                s,
            } => plan_rope(
                *backward,
                [c(input), c(output)],
                s,
                [input.0, *cos, *sin, output.0].map(d),
            ),
            TypedOp::CrossEntropy { .. }
            | TypedOp::CrossEntropyBackward { .. }
            | TypedOp::Embedding { .. }
            | TypedOp::EmbeddingBackward { .. } => {
                unreachable!("plans with an index check are run in `run`")
            }
            TypedOp::LayerNormBackward {
                x,
                gamma,
                mean,
                rstd,
                dy,
                dx,
                dgamma,
                dbeta,
                cols,
            } => plan_layer_norm_backward_t(
                [c(x), c(gamma), c(dy), c(dx), c(dgamma), c(dbeta)],
                n(x) / *cols as u64,
                *cols as u64,
                [x.0, gamma.0, *mean, *rstd, dy.0, dx.0, dgamma.0, dbeta.0].map(d),
            ),
        }
    }
}

impl Drop for EmuExec {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

impl Exec for EmuExec {
    fn alloc(&mut self, bytes: usize) -> H {
        self.send(&format!("alloc {bytes}"));
        self.lens.push(bytes);
        self.lens.len() - 1
    }

    fn upload(&mut self, bytes: &[u8]) -> H {
        let h = self.alloc(bytes.len());
        self.send(&format!("write {h} {}", hex(bytes)));
        h
    }

    fn download(&mut self, h: H) -> Vec<u8> {
        let n = self.lens[h];
        self.read_at(Self::addr(h), n)
    }

    fn run(&mut self, op: &Op) -> Result<(), CudaKernelError> {
        let d = Self::dev;
        let p = match op {
            Op::Add { a, b, out } => Ok(plan_binary(
                EW_ADD,
                self.f32s(*a) as u64,
                d(*a),
                d(*b),
                d(*out),
            )),
            Op::Mul { a, b, out } => Ok(plan_binary(
                EW_MUL,
                self.f32s(*a) as u64,
                d(*a),
                d(*b),
                d(*out),
            )),
            Op::Scale { x, alpha, out } => {
                Ok(plan_scale(self.f32s(*x) as u64, d(*x), *alpha, d(*out)))
            }
            Op::ScaleInplace { y, alpha } => {
                Ok(plan_scale_inplace(self.f32s(*y) as u64, d(*y), *alpha))
            }
            Op::AddScaled { y, alpha, x } => {
                Ok(plan_axpy(self.f32s(*y) as u64, d(*y), *alpha, d(*x)))
            }
            Op::AddRowBias { x, bias, out } => Ok(plan_add_row_bias(
                self.f32s(*x) as u64,
                self.f32s(*bias) as u64,
                d(*x),
                d(*bias),
                d(*out),
            )),
            Op::AddRowBiasInplace { y, bias } => Ok(plan_add_row_bias_inplace(
                self.f32s(*y) as u64,
                self.f32s(*bias) as u64,
                d(*y),
                d(*bias),
            )),
            Op::ColSums { x, out } => {
                let cols = self.f32s(*out);
                Ok(plan_col_sums(
                    (self.f32s(*x) / cols) as u64,
                    cols as u64,
                    d(*x),
                    d(*out),
                ))
            }
            Op::Sum { x, out } => Ok(plan_sum(self.f32s(*x) as u64, d(*x), d(*out), 1.0)),
            Op::Mean { x, out } => {
                let n = self.f32s(*x);
                Ok(plan_sum(n as u64, d(*x), d(*out), n as f64))
            }
            Op::Gelu { kind, x, y } => Ok(plan_gelu(*kind, self.f32s(*x) as u64, d(*x), d(*y))),
            Op::GeluBackward { kind, x, dy, dx } => Ok(plan_gelu_backward(
                *kind,
                self.f32s(*x) as u64,
                d(*x),
                d(*dy),
                d(*dx),
            )),
            Op::Softmax { x, y, cols } => Ok(plan_softmax(
                (self.f32s(*x) / cols) as u64,
                *cols as u64,
                d(*x),
                d(*y),
            )),
            Op::SoftmaxBackward { y, dy, dx, cols } => Ok(plan_softmax_backward(
                (self.f32s(*y) / cols) as u64,
                *cols as u64,
                d(*y),
                d(*dy),
                d(*dx),
            )),
            Op::LayerNorm {
                x,
                gamma,
                beta,
                y,
                mean,
                rstd,
                cols,
                eps,
            } => Ok(plan_layer_norm(
                (self.f32s(*x) / cols) as u64,
                *cols as u64,
                *eps,
                [*x, *gamma, *beta, *y, *mean, *rstd].map(d),
            )),
            Op::LayerNormBackward {
                x,
                gamma,
                mean,
                rstd,
                dy,
                dx,
                dgamma,
                dbeta,
                cols,
            } => Ok(plan_layer_norm_backward(
                (self.f32s(*x) / cols) as u64,
                *cols as u64,
                [*x, *gamma, *mean, *rstd, *dy, *dx, *dgamma, *dbeta].map(d),
            )),
            Op::Embedding {
                ids,
                table,
                out,
                dim,
            } => {
                let (n, rows) = (self.lens[*ids] / 8, self.f32s(*table) / dim);
                let (plan, status) = plan_embedding(
                    n as u64,
                    *dim as u64,
                    rows as u64,
                    d(*ids),
                    d(*table),
                    d(*out),
                );
                return self.exec_checked("embedding", "id", &plan, status, *ids, rows);
            }
            Op::EmbeddingBackward {
                ids,
                dy,
                dtable,
                dim,
            } => {
                let (n, rows) = (self.lens[*ids] / 8, self.f32s(*dtable) / dim);
                let (plan, status) = plan_embedding_backward(
                    n as u64,
                    *dim as u64,
                    rows as u64,
                    d(*ids),
                    d(*dy),
                    d(*dtable),
                );
                return self.exec_checked("embedding_backward", "id", &plan, status, *ids, rows);
            }
            Op::CrossEntropy {
                logits,
                targets,
                cols,
                lse,
                loss,
            } => {
                let rows = self.f32s(*logits) / cols;
                let (plan, status) = plan_cross_entropy(
                    rows as u64,
                    *cols as u64,
                    d(*logits),
                    d(*targets),
                    d(*lse),
                    d(*loss),
                );
                return self.exec_checked(
                    "cross_entropy",
                    "target",
                    &plan,
                    status,
                    *targets,
                    *cols,
                );
            }
            Op::CrossEntropyBackward {
                logits,
                targets,
                lse,
                dloss,
                dlogits,
                cols,
            } => {
                let rows = self.f32s(*logits) / cols;
                let (plan, status) = plan_cross_entropy_backward(
                    rows as u64,
                    *cols as u64,
                    d(*logits),
                    d(*targets),
                    d(*lse),
                    d(*dloss),
                    d(*dlogits),
                );
                return self.exec_checked(
                    "cross_entropy_backward",
                    "target",
                    &plan,
                    status,
                    *targets,
                    *cols,
                );
            }
            Op::Attention {
                q,
                k,
                v,
                out,
                probs,
                a,
            } => plan_attention(
                a.batch * a.heads,
                a.t,
                a.d,
                a.scale,
                [*q, *k, *v, *out, *probs].map(d),
            ),
            Op::AttentionBackward {
                q,
                k,
                v,
                probs,
                dout,
                dq,
                dk,
                dv,
                a,
            } => plan_attention_backward(
                a.batch * a.heads,
                a.t,
                a.d,
                a.scale,
                [*q, *k, *v, *probs, *dout, *dq, *dk, *dv].map(d),
            ),
            Op::Bmm {
                a,
                b,
                c,
                batch,
                m,
                k,
                n,
                ta,
                tb,
                acc,
            } => {
                let mut plan = Plan::new();
                let g = Gemm::new(*batch, *m, *k, *n)
                    .transposed(*ta, *tb)
                    .accumulating(*acc);
                plan_gemm(&mut plan, "bmm", (d(*a), d(*b), d(*c)), &g, 1.0).map(|()| plan)
            }
            Op::GemmEx { a, b, c, g, p } => {
                let mut plan = Plan::new();
                let op = if g.batch == 1 { "matmul" } else { "bmm" };
                p.types(op)
                    .and_then(|ty| {
                        plan_gemm_typed(&mut plan, op, (d(*a), d(*b), d(*c)), g, 1.0, ty)
                    })
                    .map(|()| plan)
            }
            Op::Flash {
                dtype,
                q,
                k,
                v,
                out,
                lse,
                a,
            } => FlashType::of("flash_attention", *dtype)
                .and_then(|ty| plan_flash(ty, a, [*q, *k, *v, *out, *lse].map(d))),
            Op::FlashMma {
                dtype,
                q,
                k,
                v,
                out,
                lse,
                a,
            } => plan_flash_mma(*dtype, a, [*q, *k, *v, *out, *lse].map(d)),
            Op::FlashBackward {
                dtype,
                q,
                k,
                v,
                out,
                lse,
                dout,
                dq,
                dk,
                dv,
                a,
            } => FlashType::of("flash_attention_backward", *dtype).and_then(|ty| {
                let ptrs = [*q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv].map(d);
                plan_flash_backward(ty, a, ptrs)
            }),
            Op::Cast { kind, src, dst } => {
                let (kernel, n) = match kind {
                    CastKind::F32ToF16 => (CAST_F32_F16, self.lens[*src] / 4),
                    CastKind::F16ToF32 => (CAST_F16_F32, self.lens[*src] / 2),
                    CastKind::F32ToBf16 => (CAST_F32_BF16, self.lens[*src] / 4),
                    CastKind::Bf16ToF32 => (CAST_BF16_F32, self.lens[*src] / 2),
                };
                Ok(plan_cast(kernel, n as u64, d(*src), d(*dst)))
            }
            Op::StridedCopy {
                src,
                offset,
                shape,
                strides,
                dst,
                dtype,
            } => {
                let size = dtype.size();
                let kernel = match size {
                    2 => STRIDED_COPY_B2,
                    4 => STRIDED_COPY_B4,
                    _ => STRIDED_COPY_B8,
                };
                view_desc(
                    "strided_copy",
                    self.lens[*src] / size,
                    *offset,
                    shape,
                    strides,
                )
                .map(|(v, n)| plan_strided(kernel, n as u64, v, d(*src), d(*dst)))
            }
            Op::StridedAdd {
                dst,
                offset,
                shape,
                strides,
                src,
            } => view_desc(
                "strided_add_assign",
                self.f32s(*dst),
                *offset,
                shape,
                strides,
            )
            .map(|(v, n)| plan_strided(STRIDED_ADD_F32, n as u64, v, d(*dst), d(*src))),
            Op::Zero { buf } => {
                let mut plan = Plan::new();
                plan.memset(d(*buf), 0, self.lens[*buf]);
                Ok(plan)
            }
            Op::Copy { src, dst } => {
                let mut plan = Plan::new();
                plan.copy(d(*dst), d(*src), self.lens[*src]);
                Ok(plan)
            }
            Op::SgdStep {
                rule,
                first,
                p,
                g,
                buf,
            } => Ok(plan_sgd(
                self.f32s(*p) as u64,
                rule,
                *first,
                d(*p),
                d(*g),
                buf.map(d),
            )),
            Op::AdamWStep { c, p, g, m, v } => Ok(plan_adamw(
                self.f32s(*p) as u64,
                c,
                d(*p),
                d(*g),
                d(*m),
                d(*v),
            )),
            Op::LambDirection { c, p, g, m, v, u } => Ok(plan_lamb_direction(
                self.f32s(*p) as u64,
                c,
                d(*p),
                d(*g),
                d(*m),
                d(*v),
                d(*u),
            )),
            Op::LambApply {
                lr,
                w_sq,
                u_sq,
                sums,
                u,
                p,
            } => Ok(plan_lamb_apply(
                self.f32s(*p) as u64,
                *lr,
                *w_sq as u64,
                *u_sq as u64,
                d(*sums),
                d(*u),
                d(*p),
            )),
            Op::SumSquares { xs, pieces, out } => {
                let pcs: Vec<(u64, u64, usize)> = pieces
                    .iter()
                    .map(|pc| {
                        let a = Self::addr(xs[pc.input]) + pc.start as u64 * 4;
                        (a, pc.len as u64, pc.out)
                    })
                    .collect();
                Ok(plan_sum_squares(&pcs, self.f32s(*out) as u64, d(*out)))
            }
            Op::Typed(TypedOp::Embedding {
                ids,
                table,
                out,
                dim,
            }) => {
                let (n, rows) = (
                    self.lens[*ids] / 8,
                    self.lens[table.0] / table.1.size() / dim,
                );
                let code = |t: &TH| type_code(t.1).expect("a float dtype");
                let (plan, status) = plan_embedding_t(
                    [code(table), code(out)],
                    n as u64,
                    *dim as u64,
                    rows as u64,
                    d(*ids),
                    d(table.0),
                    d(out.0),
                );
                return self.exec_checked("embedding", "id", &plan, status, *ids, rows);
            }
            Op::Typed(TypedOp::EmbeddingBackward {
                ids,
                dy,
                dtable,
                dim,
            }) => {
                let (n, rows) = (
                    self.lens[*ids] / 8,
                    self.lens[dtable.0] / dtable.1.size() / dim,
                );
                let code = |t: &TH| type_code(t.1).expect("a float dtype");
                let (plan, status) = plan_embedding_backward_t(
                    [code(dy), code(dtable)],
                    n as u64,
                    *dim as u64,
                    rows as u64,
                    d(*ids),
                    d(dy.0),
                    d(dtable.0),
                );
                return self.exec_checked("embedding_backward", "id", &plan, status, *ids, rows);
            }
            Op::Typed(TypedOp::CrossEntropy {
                logits,
                targets,
                cols,
                lse,
                loss,
            }) => {
                let rows = self.lens[logits.0] / logits.1.size() / cols;
                let codes = CeCodes {
                    logits: type_code(logits.1).expect("a float dtype"),
                    scalar: type_code(loss.1).expect("a float dtype"),
                    dlogits: 0,
                };
                let (plan, status) = plan_cross_entropy_t(
                    codes,
                    rows as u64,
                    *cols as u64,
                    d(logits.0),
                    d(*targets),
                    d(*lse),
                    d(loss.0),
                );
                return self.exec_checked(
                    "cross_entropy",
                    "target",
                    &plan,
                    status,
                    *targets,
                    *cols,
                );
            }
            Op::Typed(TypedOp::CrossEntropyBackward {
                logits,
                targets,
                lse,
                dloss,
                dlogits,
                cols,
            }) => {
                let rows = self.lens[logits.0] / logits.1.size() / cols;
                let code = |t: &TH| type_code(t.1).expect("a float dtype");
                let codes = CeCodes {
                    logits: code(logits),
                    scalar: code(dloss),
                    dlogits: code(dlogits),
                };
                let (plan, status) = plan_cross_entropy_backward_t(
                    codes,
                    rows as u64,
                    *cols as u64,
                    [logits.0, *targets, *lse, dloss.0, dlogits.0].map(d),
                );
                return self.exec_checked(
                    "cross_entropy_backward",
                    "target",
                    &plan,
                    status,
                    *targets,
                    *cols,
                );
            }
            Op::Typed(t) => Ok(self.typed_plan(t)),
            Op::Unscale { inv, g, flag } => {
                Ok(plan_unscale(self.f32s(*g) as u64, *inv, d(*g), d(*flag)))
            }
        };
        self.plan(p)
    }
}
