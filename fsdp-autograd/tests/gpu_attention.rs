//! `cargo xtask gpu-test` checks of the fused attention:
//! - `attention_memory_linear_in_t` (issue #25): the peak device memory of causal attention
//!   forward + backward on a CUDA device grows linearly in the sequence length `t` (the fused
//!   kernels save a `[batch, heads, t]` log-sum-exp, never a `t×t` matrix), while the unfused
//!   kernels' grows quadratically. Measured with the caching allocator's peak statistics
//!   (bytes handed out, host-side accounting, so no timing is involved).
//! - `attention_kernel_times`: the fused kernels' forward and backward times at GPT-2's shape
//!   (batch 4, 12 heads, t = 1024, d = 64) in f32 and bf16, with CUDA events around the kernel
//!   launches only, the same kernels on the packed qkv layout (`_packed`, what GPT blocks run),
//!   the generic kernels' at d = 63 as the same run's baseline, and bf16 at d = 128 (6 heads);
//!   each bf16 case with the tensor-core forward (`flash_mma.cu`, on compute capability 8.0+)
//!   and, as `_cuda_cores`, with it switched off (`set_tensor_core_attention(false)`), so one
//!   run shows the gain; each row names its forward kernel (`fwd_kernel`). One JSON line.
//!
//! The test is `#[ignore]`d and also needs
//! `FSDP_GPU_TESTS=1` (set by `cargo xtask gpu-test`); without it the test says so and returns.
//! With it but without a usable GPU it fails with the device's typed error.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use fsdp_alloc::{Buffer, DType, Device};
use fsdp_autograd::kernels::attention::{Attention, AttentionLayout};
use fsdp_autograd::kernels::cuda::{set_fused_attention, set_tensor_core_attention, CudaKernels};
use fsdp_autograd::{causal_attention, Tensor};

fn gpu() -> Option<Device> {
    if std::env::var("FSDP_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set FSDP_GPU_TESTS=1 on a machine with a GPU (cargo xtask gpu-test)");
        return None;
    }
    Some(Device::cuda(0).expect("FSDP_GPU_TESTS=1 but no usable CUDA device 0"))
}

/// GPT-2's attention shape per sequence: 12 heads of 64.
const HEADS: usize = 12;
const D: usize = 64;

/// Bytes allocated at the peak of one attention forward + backward (of `Σ out`) at length `t`,
/// in bf16, above what the inputs already hold.
fn peak_bytes(dev: &Device, t: usize) -> usize {
    let mut r = Rng::new(t as u64);
    let shape = [1, HEADS, t, D];
    let leaf = |r: &mut Rng| {
        Tensor::from_vec(r.vec(HEADS * t * D), &shape, dev)
            .and_then(|x| x.to_dtype(DType::BF16))
            .and_then(|x| x.requires_grad_(true))
            .unwrap()
    };
    let (q, k, v) = (leaf(&mut r), leaf(&mut r), leaf(&mut r));
    // Everything queued so far is accounted; measure from here.
    let _ = q.to_vec_f32().unwrap();
    let base = dev.memory_stats().allocated_bytes;
    dev.reset_peak_stats();
    let out = causal_attention(&q, &k, &v).unwrap();
    out.sum().unwrap().backward().unwrap();
    let _ = q.grad().expect("dq").to_vec_f32().unwrap();
    let peak = dev.memory_stats().peak_allocated_bytes;
    drop((out, q, k, v));
    peak.saturating_sub(base)
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn attention_memory_linear_in_t() {
    let Some(dev) = gpu() else { return };
    let ts = [1024usize, 2048, 4096];
    set_fused_attention(true);
    let fused: Vec<usize> = ts.iter().map(|&t| peak_bytes(&dev, t)).collect();
    // The unfused kernels for contrast (their t×t probabilities and dS scratch), at the two
    // smaller lengths.
    set_fused_attention(false);
    let unfused: Vec<usize> = ts[..2].iter().map(|&t| peak_bytes(&dev, t)).collect();
    set_fused_attention(true);
    println!(
        "{{\"attention_peak_bytes\": {{\"fused\": {{\"1024\": {}, \"2048\": {}, \"4096\": {}}}, \
         \"unfused\": {{\"1024\": {}, \"2048\": {}}}}}}}",
        fused[0], fused[1], fused[2], unfused[0], unfused[1]
    );
    for w in fused.windows(2) {
        let ratio = w[1] as f64 / w[0] as f64;
        assert!(
            ratio <= 2.5,
            "fused attention peak grows {ratio:.2}× when t doubles (linear: about 2×, \
             quadratic: about 4×): {fused:?} bytes at t = {ts:?}"
        );
    }
    // No t×t matrix: at t = 4096 one f32 [heads, t, t] buffer alone would be 805 MB.
    let square = HEADS * 4096 * 4096 * 4;
    assert!(
        fused[2] < square / 8,
        "fused attention peak {} bytes at t = 4096 is not far below one t×t f32 buffer ({square})",
        fused[2]
    );
    // The measurement sees quadratic growth where there is some.
    let ratio = unfused[1] as f64 / unfused[0] as f64;
    assert!(
        ratio > 3.0,
        "the unfused attention's peak should grow about 4× when t doubles, got {ratio:.2}× \
         ({unfused:?}): the peak measurement is not seeing the t×t buffers"
    );
}

/// One timed configuration of [`attention_kernel_times`]: milliseconds per forward, per
/// backward, and model TFLOP/s of forward + backward.
struct Timing {
    fwd_ms: f64,
    bwd_ms: f64,
    tflops: f64,
    /// Model TFLOP/s of the forward alone.
    fwd_tflops: f64,
}

/// Times `iters` fused forwards, then `iters` fused backwards, of causal attention at
/// `[batch, heads, t, d]` in `dtype` on the default stream of `k`'s device, with CUDA events
/// recorded on that stream around the launches (after two untimed warm-up rounds), with the
/// tensor-core forward allowed when `tensor_cores` (then restored to the default, on). FLOPs are
/// the usual model count: forward `4·bh·d·t(t+1)/2` (two causal products), backward 2.5× that
/// (five products; the kernels recompute two more, which are not counted).
fn time_attention(
    k: &CudaKernels,
    dtype: DType,
    (batch, heads, t, d): (usize, usize, usize, usize),
    packed: bool,
    tensor_cores: bool,
    iters: usize,
) -> Timing {
    set_tensor_core_attention(tensor_cores);
    let dev = k.device().clone();
    let stream = dev.default_stream().clone();
    let cs = stream
        .cuda_stream()
        .expect("a CUDA device's default stream is a CUDA stream")
        .clone();
    let (n, nl) = (batch * heads * t * d, batch * heads * t);
    let mut r = Rng::new(0xa77e);
    let bytes = |v: Vec<f32>| -> Vec<u8> {
        match dtype {
            DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            _ => v
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
        }
    };
    let es = if dtype == DType::F32 { 4 } else { 2 };
    let alloc = |len: usize| -> Buffer { dev.alloc(len, &stream).expect("device memory") };
    let inputs: Vec<Buffer> = (0..4)
        .map(|_| {
            let host = bytes(r.vec(n));
            let b = alloc(host.len());
            k.upload(&stream, &host, b.data()).expect("upload");
            b
        })
        .collect();
    let [q, kk, v, dout] = [0, 1, 2, 3].map(|i| inputs[i].data());
    let (out, lse) = (alloc(n * es), alloc(nl * 4));
    let (dq, dk, dv) = (alloc(n * es), alloc(n * es), alloc(n * es));
    // The packed layout ([batch, t, 3, heads, d] qkv, one dqkv gradient).
    let (qkv, dqkv) = (alloc(3 * n * es), alloc(3 * n * es));
    if packed {
        let host = bytes(r.vec(3 * n));
        k.upload(&stream, &host, qkv.data()).expect("upload");
    }
    let at = Attention::new(batch, heads, t, d);
    let pat = Attention {
        layout: AttentionLayout::Packed,
        ..at
    };
    let fwd = || {
        if packed {
            let (o, l) = (out.data(), lse.data());
            return k
                .flash_attention_packed(&stream, dtype, qkv.data(), o, l, &pat)
                .expect("flash_attention_packed");
        }
        k.flash_attention(&stream, dtype, q, kk, v, out.data(), lse.data(), &at)
            .expect("flash_attention")
    };
    let bwd = || {
        if packed {
            let (o, l, g) = (out.data(), lse.data(), dqkv.data());
            return k
                .flash_attention_packed_backward(&stream, dtype, qkv.data(), o, l, dout, g, &pat)
                .expect("flash_attention_packed_backward");
        }
        k.flash_attention_backward(
            &stream,
            dtype,
            q,
            kk,
            v,
            out.data(),
            lse.data(),
            dout,
            dq.data(),
            dk.data(),
            dv.data(),
            &at,
        )
        .expect("flash_attention_backward")
    };
    for _ in 0..2 {
        fwd();
        bwd();
    }
    let event = || {
        cs.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("cuEventRecord")
    };
    let e0 = event();
    for _ in 0..iters {
        fwd();
    }
    let e1 = event();
    for _ in 0..iters {
        bwd();
    }
    let e2 = event();
    let fwd_ms = e0.elapsed_ms(&e1).expect("cuEventElapsedTime") as f64 / iters as f64;
    let bwd_ms = e1.elapsed_ms(&e2).expect("cuEventElapsedTime") as f64 / iters as f64;
    // The results are finite (the timed kernels did the work).
    let mut host = vec![0u8; nl * 4];
    k.download(&stream, lse.data(), &mut host)
        .expect("download");
    assert!(
        host.chunks_exact(4)
            .all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
        "non-finite log-sum-exp after the timed runs ({dtype})"
    );
    set_tensor_core_attention(true);
    let fwd_flops = 4.0 * (batch * heads * d) as f64 * (t * (t + 1) / 2) as f64;
    let tflops = 3.5 * fwd_flops / ((fwd_ms + bwd_ms) * 1e-3) / 1e12;
    Timing {
        fwd_ms,
        bwd_ms,
        tflops,
        fwd_tflops: fwd_flops / (fwd_ms * 1e-3) / 1e12,
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run `cargo xtask gpu-test` (FSDP_GPU_TESTS=1)"]
fn attention_kernel_times() {
    let Some(dev) = gpu() else { return };
    let k = CudaKernels::new(&dev).expect("CUDA kernels");
    let mut parts = Vec::new();
    // d = 63 takes the generic kernels (head dim read at run time, same tiles as d = 64): the
    // same run's baseline for the register-tiled d = 64 kernels. `_packed`: the same kernels on
    // the packed layout of a GPT's qkv projection (what GPT blocks run, no head split copies).
    // bf16 rows without `_cuda_cores` allow the tensor-core forward (flash_mma.cu; taken on
    // compute capability 8.0+ at d 64 and 128); the backward is the same kernels in both.
    for (name, dtype, heads, d, packed, tc) in [
        ("f32", DType::F32, HEADS, D, false, true),
        ("bf16", DType::BF16, HEADS, D, false, true),
        ("bf16_cuda_cores", DType::BF16, HEADS, D, false, false),
        ("f32_packed", DType::F32, HEADS, D, true, true),
        ("bf16_packed", DType::BF16, HEADS, D, true, true),
        ("bf16_packed_cuda_cores", DType::BF16, HEADS, D, true, false),
        ("f32_generic_d63", DType::F32, HEADS, 63, false, true),
        ("bf16_generic_d63", DType::BF16, HEADS, 63, false, true),
        ("bf16_d128", DType::BF16, HEADS / 2, 128, false, true),
        (
            "bf16_d128_cuda_cores",
            DType::BF16,
            HEADS / 2,
            128,
            false,
            false,
        ),
    ] {
        let tm = time_attention(&k, dtype, (4, heads, 1024, d), packed, tc, 10);
        assert!(
            tm.fwd_ms > 0.0 && tm.bwd_ms > 0.0,
            "{name}: no time measured"
        );
        let mma = tc && k.tensor_cores() && dtype != DType::F32 && (d == 64 || d == 128);
        parts.push(format!(
            "\"{name}\": {{\"heads\": {heads}, \"d\": {d}, \"fwd_kernel\": \"{}\", \
             \"fwd_ms\": {:.3}, \"bwd_ms\": {:.3}, \"tflops\": {:.2}, \"fwd_tflops\": {:.2}}}",
            if mma { "tensor_cores" } else { "cuda_cores" },
            tm.fwd_ms,
            tm.bwd_ms,
            tm.tflops,
            tm.fwd_tflops
        ));
    }
    println!(
        "{{\"attention_kernel_times\": {{\"batch\": 4, \"heads\": {HEADS}, \"t\": 1024, \
         \"d\": {D}, {}}}}}",
        parts.join(", ")
    );
}
