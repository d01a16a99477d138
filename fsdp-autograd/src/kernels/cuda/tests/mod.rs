//! Tests of the CUDA kernels.
//!
//! - Host-only unit tests (always run with `--features cuda`): the kernel declarations against
//!   the program's CUDA source, the row-major → cuBLAS mapping against the CPU matmul, view
//!   validation, plan well-formedness, the "no CUDA" error; NVRTC compiling the program where
//!   libnvrtc is loadable (else skipped with a message).
//! - `emulated::*` (run when a C++ compiler is present, else skipped with a message): every case
//!   in [`cases`] run through the production launch plans on the host emulator in `emu/`.
//! - `on_gpu::*` and [`gpu_only`] (`#[ignore]`; need `FSDP_GPU_TESTS=1` and a GPU, see
//!   `cargo xtask gpu-test`): the same cases through the public API on a real GPU, plus
//!   argument errors, multi-stream ordering and deferred index checks. Without
//!   `FSDP_GPU_TESTS=1` they print that they were skipped; with it but without a usable GPU they
//!   fail.

mod cases;
mod emu;
mod exec;
mod flash_mma;
mod fused;
mod gpu;
mod gpu_only;

use fsdp_alloc::{Device, DeviceId};

use super::desc::view_desc;
use super::desc::MAX_VIEW_RANK;
use super::kernel::{ArgKind, MAX_GRID};
use super::plan::{grid_for, grid_rows};
use super::plan::{PArg, Plan, Ptr, Step};
use super::{CudaKernelError, CudaKernels};
use crate::kernels::attention::flash::{
    FLASH_BWD_DKDV_BF16_D64, FLASH_BWD_DKDV_F32_LE64, FLASH_BWD_DQ_BF16_D64, FLASH_BWD_DQ_F32_LE64,
    FLASH_BWD_PRE_BF16, FLASH_BWD_PRE_F32,
};
use crate::kernels::cpu;
use crate::kernels::elementwise::binary::gpu::EW_ADD;
use crate::kernels::gemm::gpu::col_major_gemm;
use crate::kernels::gemm::Gemm;
use crate::kernels::layout::gpu::is_injective;
use crate::kernels::norm::layer_norm::gpu::LAYER_NORM_BWD_PARAMS;
use crate::kernels::norm::rms_norm::gpu::RMS_NORM_BWD_DGAMMA;
use crate::kernels::program::{all, source};
use crate::kernels::reduce::col_sums::gpu::COL_SUMS;
use cases::{assert_close, Rng};

macro_rules! on_both {
    ($($case:ident),* $(,)?) => {
        /// The shared cases on the host emulator.
        mod emulated {
            $(
                #[test]
                fn $case() {
                    let Some(bin) = super::emu::harness_or_skip(concat!("emulated::", stringify!($case))) else {
                        return;
                    };
                    let mut e = super::emu::EmuExec::start(bin);
                    super::cases::$case(&mut e);
                }
            )*
        }

        /// The shared cases on a real GPU.
        mod on_gpu {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
                fn $case() {
                    let Some(k) = super::gpu::gpu_or_skip(concat!("on_gpu::", stringify!($case))) else {
                        return;
                    };
                    let mut e = super::gpu::GpuExec::new(k);
                    super::cases::$case(&mut e);
                }
            )*
        }
    };
}

on_both!(
    elementwise,
    row_bias_and_col_sums,
    sum_and_mean,
    gelu,
    gelu_exact,
    softmax,
    layer_norm,
    rms_norm,
    silu_mul,
    rope,
    dropout,
    embedding,
    embedding_bad_ids,
    cross_entropy,
    attention,
    bmm,
    casts,
    strided,
    zero_and_copy,
    deterministic,
    gemm_half,
    gemm_tf32,
    flash_attention_f32,
    flash_attention_half,
    flash_attention_packed,
    flash_attention_grouped,
    flash_attention_mma,
    optimizer_steps,
    sum_squares_and_unscale,
    typed_kernels,
    typed_cross_entropy,
    typed_embedding,
);

/// Parses the `extern "C" __global__` functions of the program's source (`common.cu` and every
/// family's `.cu`): name and parameter kinds.
fn source_kernels() -> Vec<(String, Vec<ArgKind>)> {
    let marker = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    let mut rest = source();
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let open = rest.find('(').expect("parameter list");
        let close = rest.find(')').expect("end of parameter list");
        let name = rest[..open].trim().to_string();
        let kinds = rest[open + 1..close]
            .split(',')
            .map(|p| {
                let p = p.trim();
                if p.contains('*') {
                    ArgKind::Ptr
                } else if p.starts_with("u64 ") {
                    ArgKind::U64
                } else if p.starts_with("float ") {
                    ArgKind::F32
                } else if p.starts_with("double ") {
                    ArgKind::F64
                } else if p.starts_with("View ") {
                    ArgKind::View
                } else {
                    panic!("kernel {name}: unrecognized parameter `{p}`")
                }
            })
            .collect();
        out.push((name, kinds));
    }
    out
}

#[test]
fn kernel_table_matches_the_source() {
    let src = source_kernels();
    assert_eq!(src.len(), all().len(), "number of kernels");
    for k in all() {
        let found = src.iter().find(|(n, _)| n == k.name());
        let (_, kinds) = found.unwrap_or_else(|| panic!("{} is not in the CUDA source", k.name()));
        assert_eq!(
            kinds.as_slice(),
            k.signature(),
            "parameters of {}",
            k.name()
        );
    }
    // One declaration per kernel: the loaded functions are looked up by name.
    let mut names: Vec<&str> = all().iter().map(|k| k.name()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), all().len(), "a kernel is declared twice");
    // NVRTC takes the source as a C string.
    assert!(!source().contains('\0'));
}

/// The column reductions' group width is one constant on both sides of the launch.
#[test]
fn column_group_matches_the_source() {
    use super::plan::{grid_col_groups, COL_GROUP};
    assert!(
        source().contains(&format!("#define COL_GROUP {COL_GROUP}\n")),
        "common.cu's COL_GROUP differs from plan::COL_GROUP"
    );
    assert_eq!(grid_col_groups(1), 1);
    assert_eq!(grid_col_groups(768), 96);
    assert_eq!(grid_col_groups(769), 97);
    assert_eq!(grid_col_groups(u64::MAX), MAX_GRID);
}

/// Column reductions with fewer blocks than column groups (grids above 65,535 groups are capped;
/// the blocks then loop over the groups): a plan with a small grid still sums every column in
/// row order, bit-identical to the CPU.
#[test]
fn column_reductions_loop_over_groups() {
    use crate::kernels::norm::layer_norm::gpu::plan_layer_norm_backward;
    use crate::kernels::norm::rms_norm::gpu::plan_rms_norm_backward;
    use crate::kernels::norm::rms_norm_backward;
    use crate::kernels::reduce::col_sums::gpu::plan_col_sums;
    use cases::assert_bits;
    use exec::{down_f32, nan_f32, up_f32};
    let Some(bin) = emu::harness_or_skip("column_reductions_loop_over_groups") else {
        return;
    };
    let mut e = emu::EmuExec::start(bin);
    let mut r = Rng::new(40);
    let (rows, cols) = (300usize, 45usize);
    let x: Vec<f32> = r.vec(rows * cols, 2.0).iter().map(|v| v + 3.0).collect();
    let dy = r.vec(rows * cols, 1.0);
    let mean = r.vec(rows, 1.0);
    let rstd: Vec<f32> = r.vec(rows, 0.5).iter().map(|v| v + 1.0).collect();
    let addr = |h: usize| Ptr::Dev(((h as u64) + 1) << 40);
    let with_grid = |mut plan: Plan, grid: u32| {
        for step in &mut plan.steps {
            if let Step::Launch {
                kernel, grid: g, ..
            } = step
            {
                if [COL_SUMS, LAYER_NORM_BWD_PARAMS, RMS_NORM_BWD_DGAMMA].contains(kernel) {
                    *g = grid;
                }
            }
        }
        plan
    };
    let (hx, hdy, hm, hr) = (
        up_f32(&mut e, &x),
        up_f32(&mut e, &dy),
        up_f32(&mut e, &mean),
        up_f32(&mut e, &rstd),
    );
    let mut want = vec![0.0; cols];
    cpu::col_sums(&x, &mut want).unwrap();
    let gamma = vec![1.0f32; cols];
    let (mut wdx, mut wdg, mut wdb) = (vec![0.0; x.len()], vec![0.0; cols], vec![0.0; cols]);
    cpu::layer_norm_backward(
        &x, &gamma, &mean, &rstd, &dy, &mut wdx, &mut wdg, &mut wdb, cols,
    )
    .unwrap();
    let hg = up_f32(&mut e, &gamma);
    for grid in [1u32, 2, 4] {
        let out = nan_f32(&mut e, cols);
        let plan = plan_col_sums(rows as u64, cols as u64, addr(hx), addr(out));
        e.exec(&with_grid(plan, grid));
        assert_bits(
            &format!("col_sums grid {grid}"),
            &down_f32(&mut e, out),
            &want,
        );

        let (dx, dg, db) = (
            nan_f32(&mut e, x.len()),
            nan_f32(&mut e, cols),
            nan_f32(&mut e, cols),
        );
        let plan = plan_layer_norm_backward(
            rows as u64,
            cols as u64,
            [hx, hg, hm, hr, hdy, dx, dg, db].map(addr),
        );
        e.exec(&with_grid(plan, grid));
        assert_bits(&format!("dgamma grid {grid}"), &down_f32(&mut e, dg), &wdg);
        assert_bits(&format!("dbeta grid {grid}"), &down_f32(&mut e, db), &wdb);

        let (dx, dg) = (nan_f32(&mut e, x.len()), nan_f32(&mut e, cols));
        let plan = plan_rms_norm_backward(
            [0; 5],
            rows as u64,
            cols as u64,
            [hx, hg, hr, hdy, dx, dg].map(addr),
        );
        e.exec(&with_grid(plan, grid));
        let (mut rdx, mut rdg) = (vec![0.0; x.len()], vec![0.0; cols]);
        rms_norm_backward(&x, &gamma, &rstd, &dy, &mut rdx, &mut rdg, cols).unwrap();
        assert_bits(
            &format!("rms dgamma grid {grid}"),
            &down_f32(&mut e, dg),
            &rdg,
        );
    }
}

#[test]
fn emulator_knows_every_kernel() {
    let Some(bin) = emu::harness_or_skip("emulator_knows_every_kernel") else {
        return;
    };
    let mut names = emu::EmuExec::start(bin).kernel_names();
    names.sort();
    let mut want: Vec<String> = all().iter().map(|k| k.name().to_string()).collect();
    want.sort();
    assert_eq!(names, want);
}

/// Column-major `C = alpha·op(A)·op(B) + beta·C` per cuBLAS's definition, batched by strides,
/// with cuBLAS's leading-dimension checks.
#[allow(clippy::too_many_arguments)]
fn reference_sgemm(
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    sa: usize,
    b: &[f32],
    ldb: usize,
    sb: usize,
    c: &mut [f32],
    ldc: usize,
    sc: usize,
    batch: usize,
) {
    assert!(lda >= (if ta { k } else { m }).max(1), "lda too small");
    assert!(ldb >= (if tb { n } else { k }).max(1), "ldb too small");
    assert!(ldc >= m.max(1), "ldc too small");
    for p in 0..batch {
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0.0f64;
                for l in 0..k {
                    let av = if ta {
                        a[p * sa + l + i * lda]
                    } else {
                        a[p * sa + i + l * lda]
                    };
                    let bv = if tb {
                        b[p * sb + j + l * ldb]
                    } else {
                        b[p * sb + l + j * ldb]
                    };
                    acc += av as f64 * bv as f64;
                }
                c[p * sc + i + j * ldc] = acc as f32;
            }
        }
    }
}

#[test]
fn row_major_gemm_mapping_matches_the_cpu_matmul() {
    use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
    let mut r = Rng::new(20);
    for (batch, m, k, n) in [
        (1, 1, 1, 1),
        (1, 3, 4, 2),
        (3, 5, 7, 6),
        (2, 1, 9, 4),
        (2, 6, 1, 1),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                let (a, b) = (r.vec(batch * m * k, 1.0), r.vec(batch * k * n, 1.0));
                let mut want = vec![0.0; batch * m * n];
                cpu::bmm(&a, &b, &mut want, batch, m, k, n, ta, tb, false).unwrap();
                let g =
                    col_major_gemm("test", &Gemm::new(batch, m, k, n).transposed(ta, tb)).unwrap();
                let mut got = vec![f32::NAN; batch * m * n];
                // cuBLAS's first operand is B's buffer, its second A's (see ColMajorGemm).
                reference_sgemm(
                    g.op_first == CUBLAS_OP_T,
                    g.op_second == CUBLAS_OP_T,
                    g.m as usize,
                    g.n as usize,
                    g.k as usize,
                    &b,
                    g.ld_first as usize,
                    g.stride_first as usize,
                    &a,
                    g.ld_second as usize,
                    g.stride_second as usize,
                    &mut got,
                    g.ldc as usize,
                    g.stride_c as usize,
                    g.batch as usize,
                );
                assert_close(
                    &format!("mapping batch={batch} m={m} k={k} n={n} ta={ta} tb={tb}"),
                    &got,
                    &want,
                    1e-5,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn gemm_sizes_beyond_cublas_limits_are_errors() {
    let err = col_major_gemm("matmul", &Gemm::new(1, 1 << 31, 1, 1)).unwrap_err();
    assert!(
        matches!(err, CudaKernelError::TooLarge { what: "m", .. }),
        "{err}"
    );
    let err = col_major_gemm("bmm", &Gemm::new(1 << 31, 1, 1, 1)).unwrap_err();
    assert!(
        matches!(err, CudaKernelError::TooLarge { what: "batch", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("split the work"), "{err}");
}

#[test]
fn views_are_validated_like_the_cpu_and_overlap_is_detected() {
    // Inside and outside the storage (the CPU kernel's rule).
    assert_eq!(view_desc("v", 24, 0, &[6, 4], &[1, 6]).unwrap().1, 24);
    assert_eq!(view_desc("v", 24, 5, &[], &[]).unwrap().1, 1);
    assert_eq!(view_desc("v", 0, 0, &[0, 3], &[3, 1]).unwrap().1, 0);
    assert!(view_desc("v", 23, 0, &[6, 4], &[1, 6]).is_err());
    assert!(view_desc("v", 24, 0, &[6], &[1, 6]).is_err());
    let nine = vec![1; MAX_VIEW_RANK + 1];
    let err = view_desc("v", 24, 0, &nine, &nine).unwrap_err();
    assert!(err.to_string().contains("at most 8 dims"), "{err}");
    // Injectivity (needed by the scatter-add).
    assert!(is_injective(&[4, 6], &[6, 1]));
    assert!(is_injective(&[6, 4], &[1, 6]));
    assert!(is_injective(&[2, 2, 3], &[12, 1, 4]));
    assert!(is_injective(&[1, 5], &[0, 1])); // a unit dim may carry any stride
    assert!(is_injective(&[], &[]));
    assert!(!is_injective(&[3, 4], &[0, 1])); // broadcast
    assert!(!is_injective(&[3, 3], &[1, 1])); // sliding window
    assert!(!is_injective(&[2, 3], &[2, 1])); // rows overlap by one element
}

#[test]
fn launch_grids_are_bounded() {
    assert_eq!(grid_for(0), 1);
    assert_eq!(grid_for(256), 1);
    assert_eq!(grid_for(257), 2);
    assert_eq!(grid_for(u64::MAX), MAX_GRID);
    assert_eq!(grid_rows(0), 1);
    assert_eq!(grid_rows(7), 7);
    assert_eq!(grid_rows(1 << 40), MAX_GRID);
}

/// Every plan an op can build: launch arguments match the kernel's signature, grids are within
/// limits, scratch slots exist, and nothing is enqueued for empty work.
#[test]
fn plans_are_well_formed() {
    use crate::kernels::attention::flash::{plan_flash, plan_flash_backward, FlashType};
    use crate::kernels::attention::unfused::{plan_attention, plan_attention_backward};
    use crate::kernels::attention::{Attention, AttentionLayout};
    use crate::kernels::elementwise::binary::gpu::plan_binary;
    use crate::kernels::elementwise::gelu::gpu::plan_gelu_backward;
    use crate::kernels::embedding::gpu::{plan_embedding, plan_embedding_backward};
    use crate::kernels::loss::gpu::{plan_cross_entropy, plan_cross_entropy_backward};
    use crate::kernels::norm::layer_norm::gpu::{plan_layer_norm, plan_layer_norm_backward};
    use crate::kernels::norm::rms_norm::gpu::{plan_rms_norm, plan_rms_norm_backward};
    use crate::kernels::norm::softmax::gpu::plan_softmax;
    use crate::kernels::reduce::col_sums::gpu::plan_col_sums;
    use crate::kernels::reduce::sum::gpu::plan_sum;

    let p = |i: u64| Ptr::Dev(i << 20);
    // `bh` heads of one batch entry (multi-head, default scale).
    let at = |bh: usize, t: usize, d: usize| Attention::new(1, bh, t, d);
    let gqa = Attention {
        kv_heads: 2,
        scale: 0.3,
        layout: AttentionLayout::Packed,
        ..Attention::new(3, 8, 40, 64)
    };
    let plans: Vec<Plan> = vec![
        plan_binary(EW_ADD, 1000, p(1), p(2), p(3)),
        plan_col_sums(7, 3, p(1), p(2)),
        plan_sum(100_000, p(1), p(2), 1.0),
        plan_gelu_backward(crate::kernels::Gelu::Tanh, 5, p(1), p(2), p(3)),
        plan_softmax(100_000, 3, p(1), p(2)),
        plan_layer_norm(4, 4, 1e-5, [1, 2, 3, 4, 5, 6].map(p)),
        plan_layer_norm_backward(4, 4, [1, 2, 3, 4, 5, 6, 7, 8].map(p)),
        plan_rms_norm([1, 2, 0], 4, 4, 1e-5, [1, 2, 3, 4].map(p)),
        plan_rms_norm_backward([0; 5], 4, 4, [1, 2, 3, 4, 5, 6].map(p)),
        plan_rms_norm_backward([0; 5], 0, 4, [1, 2, 3, 4, 5, 6].map(p)),
        plan_embedding(9, 4, 5, p(1), p(2), p(3)).0,
        plan_embedding_backward(9, 4, 5, p(1), p(2), p(3)).0,
        plan_embedding_backward(0, 4, 5, p(1), p(2), p(3)).0,
        plan_cross_entropy(3, 4, p(1), p(2), p(3), p(4)).0,
        plan_cross_entropy_backward(3, 4, p(1), p(2), p(3), p(4), p(5)).0,
        plan_attention(6, 5, 4, 0.5, [1, 2, 3, 4, 5].map(p)).unwrap(),
        plan_attention(6, 5, 0, 1.0, [1, 2, 3, 4, 5].map(p)).unwrap(),
        plan_attention_backward(6, 5, 4, 0.5, [1, 2, 3, 4, 5, 6, 7, 8].map(p)).unwrap(),
        plan_flash(FlashType::Bf16, &at(6, 5, 4), [1, 2, 3, 4, 5].map(p)).unwrap(),
        plan_flash(
            FlashType::F32,
            &at(100_000, 4096, 128),
            [1, 2, 3, 4, 5].map(p),
        )
        .unwrap(),
        plan_flash_backward(
            FlashType::F16,
            &at(6, 70, 100),
            [1, 2, 3, 4, 5, 6, 7, 8, 9].map(p),
        )
        .unwrap(),
        // Grouped-query attention, packed, register-tiled.
        plan_flash(FlashType::F32, &gqa, [1, 2, 3, 4, 5].map(p)).unwrap(),
        plan_flash_backward(FlashType::Bf16, &gqa, [1, 2, 3, 4, 5, 6, 7, 8, 9].map(p)).unwrap(),
    ];
    for plan in &plans {
        assert!(!plan.steps.is_empty());
        for step in &plan.steps {
            if let Step::Launch { kernel, grid, args } = step {
                let kinds: Vec<ArgKind> = args.iter().map(PArg::kind).collect();
                assert_eq!(kinds.as_slice(), kernel.signature(), "{}", kernel.name());
                assert!(
                    (1..=MAX_GRID).contains(grid),
                    "{}: grid {grid}",
                    kernel.name()
                );
                for a in args {
                    if let PArg::Ptr(Ptr::Scratch { slot, .. }) = a {
                        assert!(
                            *slot < plan.scratch.len(),
                            "{}: scratch slot",
                            kernel.name()
                        );
                    }
                }
            }
        }
    }
    // Empty work enqueues nothing.
    assert!(plan_binary(EW_ADD, 0, p(1), p(2), p(3)).steps.is_empty());
    assert!(plan_softmax(0, 3, p(1), p(2)).steps.is_empty());
    assert!(plan_attention(0, 5, 4, 0.5, [1, 2, 3, 4, 5].map(p))
        .unwrap()
        .steps
        .is_empty());
    assert!(plan_embedding(0, 4, 5, p(1), p(2), p(3)).1.is_none());
    let five = [1, 2, 3, 4, 5].map(p);
    assert!(plan_flash(FlashType::F32, &at(0, 5, 4), five)
        .unwrap()
        .steps
        .is_empty());
    // Head dimensions outside the fused kernels' tiles are shape errors, not launches.
    for d in [0, 129] {
        let err = plan_flash(FlashType::F32, &at(1, 5, d), five).unwrap_err();
        assert!(err.to_string().contains("1..=128"), "{err}");
        let nine = [1, 2, 3, 4, 5, 6, 7, 8, 9].map(p);
        assert!(plan_flash_backward(FlashType::F32, &at(1, 5, d), nine).is_err());
    }
    // The fused backward: delta, then the dk/dv and dq passes, with one bh·t f32 scratch slot.
    let nine = [1, 2, 3, 4, 5, 6, 7, 8, 9].map(p);
    let b = plan_flash_backward(FlashType::Bf16, &at(2, 40, 64), nine).unwrap();
    assert_eq!(b.scratch, vec![(80, super::context::Elem::F32)]);
    let kernels: Vec<super::kernel::Kernel> = b
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Launch { kernel, .. } => Some(*kernel),
            _ => None,
        })
        .collect();
    assert_eq!(
        kernels,
        [
            FLASH_BWD_PRE_BF16,
            FLASH_BWD_DKDV_BF16_D64,
            FLASH_BWD_DQ_BF16_D64
        ]
    );
    // Head dims other than 64 and 128 take the generic kernels (head dim read at run time).
    let b = plan_flash_backward(FlashType::F32, &at(2, 40, 63), nine).unwrap();
    let kernels: Vec<super::kernel::Kernel> = b
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Launch { kernel, .. } => Some(*kernel),
            _ => None,
        })
        .collect();
    assert_eq!(
        kernels,
        [
            FLASH_BWD_PRE_F32,
            FLASH_BWD_DKDV_F32_LE64,
            FLASH_BWD_DQ_F32_LE64
        ]
    );
    // Grouped-query attention: the dk/dv pass has a block per key/value head and key tile (the
    // kernels loop over the group's query heads); dq keeps one per query head and query tile;
    // every fused kernel gets heads and kv_heads, and the scale as given.
    let b = plan_flash_backward(FlashType::F32, &gqa, nine).unwrap();
    let launches: Vec<(u32, Vec<PArg>)> = b
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Launch { grid, args, .. } => Some((*grid, args.clone())),
            _ => None,
        })
        .collect();
    let (tiles, kv_blocks) = (40usize.div_ceil(32) as u32, 3 * 2);
    assert_eq!(launches[1].0, tiles * kv_blocks);
    assert_eq!(launches[2].0, tiles * 3 * 8);
    for (_, args) in &launches[1..] {
        assert!(
            matches!(args[..7], [PArg::U64(24), PArg::U64(40), PArg::U64(64), PArg::U64(8), PArg::U64(2), PArg::U64(1), PArg::F32(s)] if s == 0.3)
        );
    }
    // Shapes Attention::check rejects are errors before any launch.
    for bad in [
        Attention { kv_heads: 3, ..gqa },
        Attention { kv_heads: 0, ..gqa },
        Attention { scale: -1.0, ..gqa },
    ] {
        assert!(plan_flash(FlashType::F32, &bad, five).is_err());
        assert!(plan_flash_backward(FlashType::F32, &bad, nine).is_err());
    }
}

#[test]
fn a_cpu_device_has_no_cuda_kernels() {
    let err = CudaKernels::new(&Device::cpu(3)).unwrap_err();
    assert!(
        matches!(
            err,
            CudaKernelError::Unavailable {
                device: DeviceId::Cpu(3),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("not a CUDA device"), "{err}");
}

/// Without a CUDA driver, opening a device fails with a typed error rather than a panic
/// (regression guard: cudarc panics if the driver library is used without being present).
#[test]
fn no_driver_is_a_typed_error() {
    if let Err(e) = Device::cuda(0) {
        assert!(e.to_string().contains("CUDA unavailable"), "{e}");
    }
}

/// NVRTC — a compiler library that needs no GPU — compiles the program with the production
/// options, and the PTX defines every kernel of the table. Skipped (with a message) where
/// libnvrtc cannot be loaded.
#[test]
fn nvrtc_compiles_the_kernels() {
    // SAFETY: `is_culib_present` only tries to load the library; no precondition.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        // `cargo xtask nvrtc` sets FSDP_NVRTC_REQUIRED=1: there a missing library is a failure.
        if std::env::var("FSDP_NVRTC_REQUIRED").as_deref() == Ok("1") {
            panic!("FSDP_NVRTC_REQUIRED=1 but libnvrtc could not be loaded (LD_LIBRARY_PATH?)");
        }
        eprintln!(
            "SKIPPED nvrtc_compiles_the_kernels: libnvrtc not found (e.g. `pip install \
             nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH)"
        );
        return;
    }
    // Both targets: NVRTC's default (every GPU; the tensor-core kernels' reference path) and
    // compute_80 (the mma.sync code of attention/flash_mma.cu).
    for tensor_cores in [false, true] {
        let ptx = crate::kernels::program::ptx_for(tensor_cores).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for k in all() {
            assert!(
                text.contains(&format!(".entry {}(", k.name())),
                "the PTX (tensor_cores: {tensor_cores}) has no entry point {}",
                k.name()
            );
        }
        if tensor_cores {
            assert!(
                text.contains("mma.sync.aligned.m16n8k16"),
                "no mma.sync in the compute_80 PTX"
            );
        }
    }
}
