//! `cargo xtask gpu-test` check of the fused attention's memory (issue #25): the peak device
//! memory of causal attention forward + backward on a CUDA device grows linearly in the sequence
//! length `t` (the fused kernels save a `[batch, heads, t]` log-sum-exp, never a `t×t` matrix),
//! while the unfused kernels' grows quadratically. Measured with the caching allocator's peak
//! statistics (bytes handed out, host-side accounting, so no timing is involved).
//!
//! **Never run on a GPU**: written where no GPU exists. The test is `#[ignore]`d and also needs
//! `FSDP_GPU_TESTS=1` (set by `cargo xtask gpu-test`); without it the test says so and returns.
//! With it but without a usable GPU it fails with the device's typed error.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use fsdp_alloc::{DType, Device};
use fsdp_autograd::kernels::cuda::set_fused_attention;
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
