//! Attention on the packed qkv layout (`causal_attention_qkv`): bit-equal to the head split /
//! attend / merge composition, how many strided copies a GPT block launches (forward and
//! backward, counted through the profiler on the CPU), and a digest of GPT-mini's loss and
//! gradients (printed, to compare the CPU path before and after a change bit for bit).

mod common;

use std::sync::Mutex;

use common::{dev, Rng};
use fsdp_alloc::{DType, Device};
use fsdp_autograd::nn::{named_parameters, Gpt, GptConfig, Module};
use fsdp_autograd::{
    causal_attention, causal_attention_qkv, causal_attention_qkv_grouped, causal_attention_scaled,
    cross_entropy, profile, AutogradError, InitContext, Tensor,
};

/// The profiler is process-wide: tests of this file that use it run one at a time.
static PROFILER: Mutex<()> = Mutex::new(());

fn batch(cfg: &GptConfig, b: usize, seed: u64, d: &Device) -> (Tensor, Tensor) {
    let mut r = Rng::new(seed);
    let n = b * cfg.seq_len;
    let ids: Vec<i64> = (0..n).map(|_| r.below(cfg.vocab) as i64).collect();
    let tg: Vec<i64> = (0..n).map(|_| r.below(cfg.vocab) as i64).collect();
    (
        Tensor::from_vec(ids, &[b, cfg.seq_len], d).unwrap(),
        Tensor::from_vec(tg, &[b, cfg.seq_len], d).unwrap(),
    )
}

fn copies() -> u64 {
    profile::take()
        .iter()
        .filter(|e| e.op == "copy")
        .map(|e| e.count)
        .sum()
}

/// (forward, backward) copy launches of one training step of a GPT with `layers` blocks.
fn step_copies(layers: usize) -> (u64, u64) {
    let d = dev();
    let cfg = GptConfig::new(32, 32, layers, 2, 16);
    let m = Gpt::new(&InitContext::eager(&d, 0), &cfg).unwrap();
    let (ids, tg) = batch(&cfg, 2, 1, &d);
    d.synchronize().unwrap();
    profile::take();
    profile::set_enabled(true);
    let logits = m.forward(&ids).unwrap();
    let loss = cross_entropy(
        &logits.view(&[2 * 16, 32]).unwrap(),
        &tg.view(&[32]).unwrap(),
    )
    .unwrap();
    d.synchronize().unwrap();
    let fwd = copies();
    loss.backward().unwrap();
    d.synchronize().unwrap();
    let bwd = copies();
    profile::set_enabled(false);
    (fwd, bwd)
}

#[test]
fn copy_launches_per_block() {
    let _g = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    let (f1, b1) = step_copies(1);
    let (f2, b2) = step_copies(2);
    let (fb, bb) = (f2 - f1, b2 - b1);
    println!(
        "{{\"copies\": {{\"per_block_fwd\": {fb}, \"per_block_bwd\": {bb}, \"rest_fwd\": {}, \"rest_bwd\": {}}}}}",
        f1 - fb,
        b1 - bb
    );
    // Before `causal_attention_qkv` a block launched 6 forward copies (the head split and merge
    // around attention, plus the four linears' bias broadcasts) and 5 backward ones; what is
    // left are the bias broadcasts.
    assert_eq!(
        (fb, bb),
        (4, 0),
        "copy launches per GPT block (forward, backward)"
    );
}

#[test]
fn copy_launches_of_attention() {
    use fsdp_autograd::nn::CausalSelfAttention;
    let _g = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    let d = dev();
    let m = CausalSelfAttention::new(&InitContext::eager(&d, 0), 32, 2, 1.0).unwrap();
    let mut r = Rng::new(3);
    let x = Tensor::from_vec(r.vec(2 * 16 * 32), &[2, 16, 32], &d).unwrap();
    let x = x.requires_grad_(true).unwrap();
    d.synchronize().unwrap();
    profile::take();
    profile::set_enabled(true);
    let y = m.forward(&x).unwrap();
    d.synchronize().unwrap();
    let fwd = copies();
    y.sum().unwrap().backward().unwrap();
    d.synchronize().unwrap();
    let bwd = copies();
    // The same loss gradient through `sum` alone: its broadcast is the backward's only copy.
    let z = Tensor::from_vec(r.vec(2 * 16 * 32), &[2, 16, 32], &d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    z.sum().unwrap().backward().unwrap();
    d.synchronize().unwrap();
    let sum_bwd = copies();
    profile::set_enabled(false);
    println!(
        "{{\"attention_copies\": {{\"fwd\": {fwd}, \"bwd\": {bwd}, \"sum_bwd\": {sum_bwd}}}}}"
    );
    // Forward: the qkv and proj linears' bias broadcasts only; backward: none of its own.
    assert_eq!(fwd, 2);
    assert_eq!(bwd, sum_bwd);
}

/// The split / attend / merge composition GPT blocks used before `causal_attention_qkv`.
fn split_attend_merge(qkv: &Tensor, heads: usize) -> Tensor {
    let (b, t, d) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let dh = d / heads;
    let qkv = qkv
        .view(&[b, t, 3, heads, dh])
        .unwrap()
        .permute(&[2, 0, 3, 1, 4])
        .unwrap()
        .contiguous()
        .unwrap();
    let parts = qkv.split(&[1, 1, 1]).unwrap();
    let [q, k, v] = [0, 1, 2].map(|i| parts[i].view(&[b, heads, t, dh]).unwrap());
    causal_attention(&q, &k, &v)
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap()
        .contiguous()
        .unwrap()
        .view(&[b, t, d])
        .unwrap()
}

/// Output and qkv gradient of `f(qkv)` against a fixed random cotangent, as f32 bits.
fn run(
    f: impl Fn(&Tensor) -> Tensor,
    qkv: &[f32],
    shape: [usize; 3],
    dtype: DType,
    cot: &[f32],
) -> (Vec<u32>, Vec<u32>) {
    let d = dev();
    let x = Tensor::from_vec(qkv.to_vec(), &shape, &d)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = f(&x);
    let w = Tensor::from_vec(cot.to_vec(), y.shape(), &d)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    (y.mul(&w).unwrap().sum().unwrap()).backward().unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        let t = t.to_dtype(DType::F32).unwrap();
        t.to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    (bits(&y), bits(&x.grad().unwrap()))
}

/// `causal_attention_qkv` (packed kernels on the CPU, no copies) equals the head split /
/// attend / merge composition bit for bit, forward and gradient, in f32 and bf16.
#[test]
fn qkv_attention_equals_split_attend_merge() {
    let _g = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    for (dtype, (b, t, heads, dh)) in [
        (DType::F32, (2, 37, 3, 5)),
        (DType::F32, (1, 1, 1, 64)),
        (DType::F32, (1, 70, 2, 64)),
        (DType::BF16, (2, 33, 2, 8)),
    ] {
        let d3 = 3 * heads * dh;
        let mut r = Rng::new(7 + t as u64);
        let qkv = r.vec(b * t * d3);
        let cot = r.vec(b * t * heads * dh);
        let shape = [b, t, d3];
        let packed = run(
            |x| causal_attention_qkv(x, heads).unwrap(),
            &qkv,
            shape,
            dtype,
            &cot,
        );
        let split = run(|x| split_attend_merge(x, heads), &qkv, shape, dtype, &cot);
        assert_eq!(
            packed.0, split.0,
            "{dtype:?} b={b} t={t} heads={heads} dh={dh}: output"
        );
        assert_eq!(
            packed.1, split.1,
            "{dtype:?} b={b} t={t} heads={heads} dh={dh}: dqkv"
        );
    }
    // Bad shapes are typed errors.
    let x = Tensor::zeros(&[2, 3, 10], DType::F32, &dev()).unwrap();
    assert!(causal_attention_qkv(&x, 2).is_err());
    assert!(causal_attention_qkv(&x.view(&[6, 10]).unwrap(), 1).is_err());
}

/// Grouped heads split out of a `[b, t, (heads + 2·kv_heads)·dh]` qkv by copies (queries,
/// then keys, then values per position: one `[b, heads + 2·kv_heads, t, dh]` copy split along
/// the heads), attended with `causal_attention_scaled`, merged back.
fn split_attend_merge_grouped(qkv: &Tensor, heads: usize, kv: usize, scale: f32) -> Tensor {
    let (b, t, w) = (qkv.shape()[0], qkv.shape()[1], heads + 2 * kv);
    let dh = qkv.shape()[2] / w;
    let x = qkv
        .view(&[b, t, w, dh])
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap()
        .contiguous()
        .unwrap();
    let parts = x.split_dim(&[heads, kv, kv], 1).unwrap();
    causal_attention_scaled(&parts[0], &parts[1], &parts[2], scale)
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap()
        .contiguous()
        .unwrap()
        .view(&[b, t, heads * dh])
        .unwrap()
}

/// `causal_attention_qkv_grouped` (packed kernels on the CPU: `[b, t, heads + 2·kv_heads,
/// dh]`, no copies) equals the head split / attend / merge composition bit for bit, forward and
/// gradient, in f32 and bf16; with `kv_heads == heads` and the default scale it is
/// `causal_attention_qkv`, bit for bit.
#[test]
fn grouped_qkv_attention_equals_split_attend_merge() {
    let _g = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    for (dtype, (b, t, heads, kv, dh, scale)) in [
        (DType::F32, (2, 37, 4, 2, 5, 0.3f32)),
        (DType::F32, (1, 1, 3, 1, 64, 0.125)),
        (DType::F32, (1, 70, 6, 3, 8, 1.0)),
        (DType::BF16, (2, 33, 4, 1, 8, 0.35)),
    ] {
        let w = (heads + 2 * kv) * dh;
        let mut r = Rng::new(11 + t as u64);
        let qkv = r.vec(b * t * w);
        let cot = r.vec(b * t * heads * dh);
        let shape = [b, t, w];
        let f = |x: &Tensor| causal_attention_qkv_grouped(x, heads, kv, scale).unwrap();
        let packed = run(f, &qkv, shape, dtype, &cot);
        let g = |x: &Tensor| split_attend_merge_grouped(x, heads, kv, scale);
        let split = run(g, &qkv, shape, dtype, &cot);
        let what = format!("{dtype:?} b={b} t={t} heads={heads} kv_heads={kv} dh={dh}");
        assert_eq!(packed.0, split.0, "{what}: output");
        assert_eq!(packed.1, split.1, "{what}: dqkv");
    }
    // kv_heads == heads with the default scale is the GPT call.
    let (b, t, heads, dh) = (2, 19, 3, 4);
    let mut r = Rng::new(3);
    let (qkv, cot) = (r.vec(b * t * 3 * heads * dh), r.vec(b * t * heads * dh));
    let shape = [b, t, 3 * heads * dh];
    let scale = (1.0 / (dh as f64).sqrt()) as f32;
    let grouped = |x: &Tensor| causal_attention_qkv_grouped(x, heads, heads, scale).unwrap();
    let gpt = |x: &Tensor| causal_attention_qkv(x, heads).unwrap();
    assert_eq!(
        run(grouped, &qkv, shape, DType::F32, &cot),
        run(gpt, &qkv, shape, DType::F32, &cot)
    );
    // Bad shapes and scales are typed errors.
    let x = Tensor::zeros(&[2, 3, 16], DType::F32, &dev()).unwrap();
    assert!(causal_attention_qkv_grouped(&x, 4, 2, 0.5).is_ok());
    for (h, kv, s) in [
        (4, 3, 0.5),
        (4, 0, 0.5),
        (0, 2, 0.5),
        (5, 1, 0.5),
        (4, 2, 0.0),
        (4, 2, f32::NAN),
    ] {
        let e = causal_attention_qkv_grouped(&x, h, kv, s).unwrap_err();
        assert!(
            matches!(e, AutogradError::Shape { .. }),
            "{h} {kv} {s}: {e}"
        );
    }
}

/// GPT-mini (batch 2) on the CPU: the loss and a digest of every gradient, as bits. Printed so
/// that runs before and after a change to the attention path can be compared; the test itself
/// checks that two runs agree (determinism).
#[test]
fn gpt_mini_loss_and_grad_digest() {
    let _g = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
    let digest = || {
        let d = dev();
        let cfg = GptConfig::mini();
        let m = Gpt::new(&InitContext::eager(&d, 0), &cfg).unwrap();
        let (ids, tg) = batch(&cfg, 2, 5, &d);
        let logits = m.forward(&ids).unwrap();
        let n = 2 * cfg.seq_len;
        let loss = cross_entropy(
            &logits.view(&[n, cfg.vocab]).unwrap(),
            &tg.view(&[n]).unwrap(),
        )
        .unwrap();
        loss.backward().unwrap();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (_, p) in named_parameters(&m) {
            for v in p.grad().unwrap().to_vec::<f32>().unwrap() {
                h = (h ^ v.to_bits() as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        (loss.to_vec::<f32>().unwrap()[0].to_bits(), h)
    };
    let (loss, h) = digest();
    println!(
        "{{\"gpt_mini\": {{\"loss_bits\": \"{loss:#010x}\", \"grad_fnv1a\": \"{h:#018x}\"}}}}"
    );
    assert_eq!(digest(), (loss, h));
}
