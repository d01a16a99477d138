//! The description of a Llama ([`fsdp_autograd::nn::Llama`], transformers' `LlamaForCausalLM`):
//! [`ModelDesc::llama`], its module tree ([`llama_modules`]) and forward leaves, so `--plan`
//! sizes Llama runs (an 8B shape on 8 GPUs, a 1B on one) without building the model.

use fsdp_autograd::nn::LlamaConfig;
use fsdp_core::wrap::{ModuleInfo, WrapPolicy};

use crate::error::PlanError;
use crate::model::{module, ModelDesc};

impl ModelDesc {
    /// The description of an [`fsdp_autograd::nn::Llama`] with `cfg`, wrapped by `policy` (one
    /// unit per `LlamaDecoderLayer` is the usual policy): the module tree `Llama::new` builds
    /// (same paths, type names, parameter sizes, the tied head included), planned as
    /// `Fsdp::wrap` plans it, with per-token FLOPs and activation bytes of fsdp-autograd's
    /// kernels (f32; what each op saves for backward).
    ///
    /// # Errors
    /// [`PlanError::Model`] for a configuration `Llama::new` refuses, or a policy naming no
    /// module.
    pub fn llama(cfg: &LlamaConfig, policy: &WrapPolicy) -> Result<ModelDesc, PlanError> {
        cfg.validate()
            .map_err(|e| PlanError::Model(e.to_string()))?;
        let name = format!(
            "llama v{} d{} L{} h{}/{} ffn{} t{}{}",
            cfg.vocab,
            cfg.d_model,
            cfg.n_layers,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.ffn_dim,
            cfg.seq_len,
            if cfg.tied { " tied" } else { "" }
        );
        ModelDesc::from_tree(
            name,
            &llama_modules(cfg),
            llama_leaves(cfg),
            policy,
            cfg.vocab,
            cfg.seq_len,
        )
    }
}

/// The module tree of `Llama::new(cfg)` in pre-order, as `Fsdp::wrap` describes it (parameter
/// identities numbered in visit order; the tied head reuses the embedding's).
pub fn llama_modules(cfg: &LlamaConfig) -> Vec<ModuleInfo> {
    let (v, d, f) = (cfg.vocab, cfg.d_model, cfg.ffn_dim);
    let kv = cfg.n_kv_heads * cfg.head_dim();
    let mut id = 0usize;
    let mut next = || {
        id += 1;
        id - 1
    };
    let mut out = vec![module("", "Llama", &[])];
    let emb = next();
    out.push(module(
        "embed_tokens",
        "Embedding",
        &[("weight", emb, v * d)],
    ));
    out.push(module("layers", "LlamaLayers", &[]));
    for i in 0..cfg.n_layers {
        let l = format!("layers.{i}");
        let lin = |name: &str, n: usize, next: &mut dyn FnMut() -> usize| {
            module(&format!("{l}.{name}"), "Linear", &[("weight", next(), n)])
        };
        out.push(module(&l, "LlamaDecoderLayer", &[]));
        out.push(module(
            &format!("{l}.input_layernorm"),
            "RmsNorm",
            &[("weight", next(), d)],
        ));
        out.push(module(&format!("{l}.self_attn"), "LlamaAttention", &[]));
        out.push(lin("self_attn.q_proj", d * d, &mut next));
        out.push(lin("self_attn.k_proj", kv * d, &mut next));
        out.push(lin("self_attn.v_proj", kv * d, &mut next));
        out.push(lin("self_attn.o_proj", d * d, &mut next));
        out.push(module(
            &format!("{l}.post_attention_layernorm"),
            "RmsNorm",
            &[("weight", next(), d)],
        ));
        out.push(module(&format!("{l}.mlp"), "LlamaMlp", &[]));
        out.push(lin("mlp.gate_proj", f * d, &mut next));
        out.push(lin("mlp.up_proj", f * d, &mut next));
        out.push(lin("mlp.down_proj", d * f, &mut next));
    }
    out.push(module("norm", "RmsNorm", &[("weight", next(), d)]));
    let head = if cfg.tied { emb } else { next() };
    out.push(module("lm_head", "Linear", &[("weight", head, v * d)]));
    out
}

/// The forward leaves of a Llama, in order (the tuple of [`ModelDesc::from_tree`]). As for the
/// GPT, a saved tensor is charged to the op that saves it: an RMSNorm saves its input and the
/// per-row rstd; a linear its input (charged once when several projections read one tensor:
/// q/k/v, gate/up); RoPE nothing (its tables are constants); attention its contiguous q, k and v
/// (k and v with the key/value heads only: grouped-query attention repeats nothing) and the
/// `[b, h, t, t]` probabilities; SiLU·mul the gate and up projections; the down projection the product.
fn llama_leaves(cfg: &LlamaConfig) -> Vec<(String, f64, f64, f64, usize, f64)> {
    let (v, d, h, t, ff) = (
        cfg.vocab as f64,
        cfg.d_model as f64,
        cfg.n_heads as f64,
        cfg.seq_len as f64,
        cfg.ffn_dim as f64,
    );
    let kv = (cfg.n_kv_heads * cfg.head_dim()) as f64;
    let f = 4.0; // f32
    let bytes = |n: f64| n as usize * 4;
    let norm = |path: String| {
        (
            path,
            4.0 * d,
            f * d + 4.0,
            4.0 * f * d,
            bytes(d),
            f * 2.0 * d,
        )
    };
    let mut out = vec![(
        "embed_tokens".to_string(),
        d,
        0.0,
        f * d,
        bytes(v * d),
        f * 2.0 * d,
    )];
    for i in 0..cfg.n_layers {
        let l = format!("layers.{i}");
        out.push(norm(format!("{l}.input_layernorm")));
        // q saves the norm's output; k and v read the same tensor.
        out.push((
            format!("{l}.self_attn.q_proj"),
            2.0 * d * d,
            f * d,
            f * 3.0 * d,
            bytes(d * d),
            f * 2.0 * d,
        ));
        for p in ["k_proj", "v_proj"] {
            out.push((
                format!("{l}.self_attn.{p}"),
                2.0 * d * kv,
                0.0,
                f * (kv + 2.0 * d),
                bytes(kv * d),
                f * (d + kv),
            ));
        }
        // RoPE of q and k (the head split in the same pass).
        out.push((
            format!("{l}.self_attn.rope"),
            3.0 * (d + kv),
            0.0,
            f * 2.0 * (d + kv),
            0,
            f * 2.0 * (d + kv),
        ));
        // Attention saves q, k and v (the key/value heads only) and the probabilities; backward
        // holds dq, dk, dv and the probabilities' gradient.
        out.push((
            format!("{l}.self_attn"),
            2.0 * t * d + 5.0 * h * t,
            f * (d + 2.0 * kv) + f * h * t,
            (f * (3.0 * d + 2.0 * kv) + f * h * t).max(f * (5.0 * d + 2.0 * kv)),
            0,
            f * (5.0 * d + 2.0 * kv + 4.0 * h * t),
        ));
        out.push((
            format!("{l}.self_attn.o_proj"),
            2.0 * d * d,
            f * d,
            f * 2.0 * d,
            bytes(d * d),
            f * 5.0 * d,
        ));
        out.push(norm(format!("{l}.post_attention_layernorm")));
        out.push((
            format!("{l}.mlp.gate_proj"),
            2.0 * d * ff,
            f * d,
            f * (ff + 2.0 * d),
            bytes(ff * d),
            f * (d + ff),
        ));
        out.push((
            format!("{l}.mlp.up_proj"),
            2.0 * d * ff,
            0.0,
            f * (ff + 2.0 * d),
            bytes(ff * d),
            f * (d + ff),
        ));
        out.push((
            format!("{l}.mlp.silu_mul"),
            8.0 * ff,
            f * 2.0 * ff,
            f * 3.0 * ff,
            0,
            f * 3.0 * ff,
        ));
        out.push((
            format!("{l}.mlp.down_proj"),
            2.0 * ff * d,
            f * ff,
            f * (d + ff),
            bytes(d * ff),
            f * (ff + 2.0 * d),
        ));
    }
    let (p, fl, sv, tr, wg, hbm) = norm("norm".to_string());
    out.push((p, fl, sv, tr - f * d, wg, hbm));
    out.push((
        "lm_head".to_string(),
        2.0 * d * v,
        f * d,
        f * v + f * d,
        bytes(v * d),
        f * (d + v),
    ));
    out.push(("loss".to_string(), 5.0 * v, 4.0, f * v, 0, f * 2.0 * v));
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use fsdp_alloc::Device;
    use fsdp_autograd::nn::Llama;
    use fsdp_autograd::InitContext;
    use fsdp_collectives::{ProcessGroup, ThreadGroup};
    use fsdp_core::{Fsdp, FsdpConfig};

    use super::*;

    fn layers() -> WrapPolicy {
        WrapPolicy::ModuleTypes(vec!["LlamaDecoderLayer".into()])
    }

    /// The planner's units are the ones `Fsdp::wrap` builds for an `nn::Llama`: same paths,
    /// same parameter counts (grouped and tied configurations, other policies).
    #[test]
    fn llama_units_match_the_wrapper() {
        let c = LlamaConfig::new(32, 16, 3, 4, 2, 24, 8);
        for (cfg, policy) in [
            (c, layers()),
            (c.with_tied(true), layers()),
            (c, WrapPolicy::RootOnly),
            (c.with_tied(true), WrapPolicy::MinParams(900)),
        ] {
            let desc = ModelDesc::llama(&cfg, &policy).unwrap();
            assert_eq!(desc.numel() as u64, cfg.num_params());
            let pg: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).pop().unwrap());
            let dev = Device::cpu(33_000);
            let model = Llama::new(&InitContext::eager(&dev, 0), &cfg).unwrap();
            let config = FsdpConfig {
                wrap_policy: policy.clone(),
                ..FsdpConfig::default()
            };
            let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
            let real: Vec<(String, usize)> = fsdp
                .units()
                .into_iter()
                .map(|u| (u.path, u.total_numel))
                .collect();
            let ours: Vec<(String, usize)> = desc
                .units
                .iter()
                .map(|u| (u.path.clone(), u.numel))
                .collect();
            assert_eq!(ours, real, "{policy:?} tied={}", cfg.tied);
        }
    }

    /// An 8B shape (Llama 3.1 8B): 8.03 B parameters, one unit per layer plus the root, each
    /// layer's leaves in its unit, forward FLOPs close to twice the parameters per token.
    #[test]
    fn llama3_8b_description() {
        let cfg = LlamaConfig::new(128_256, 4096, 32, 32, 8, 14_336, 8192);
        let d = ModelDesc::llama(&cfg, &layers()).unwrap();
        assert_eq!(d.units.len(), 33);
        assert_eq!(d.numel(), 8_030_261_248);
        let f = d.fwd_flops_per_token();
        let matmul = 2.0 * (d.numel() - 128_256 * 4096) as f64;
        assert!(f > matmul && f < 1.4 * matmul, "{f} vs {matmul}");
        for l in &d.leaves {
            let unit = &d.units[l.unit].path;
            if l.path.starts_with("layers.") {
                assert!(
                    l.path.starts_with(&format!("{unit}.")),
                    "{} in {unit}",
                    l.path
                );
            } else {
                assert_eq!(unit, "", "{}", l.path);
            }
        }
        assert!(ModelDesc::llama(&LlamaConfig::new(32, 16, 1, 4, 3, 8, 8), &layers()).is_err());
    }

    /// The memory model against the caching allocator on a real FullShard step of an
    /// `nn::Llama` on 2 thread ranks (grouped-query, untied): the predicted per-rank peak within
    /// 5% of `peak_allocated_bytes`.
    #[test]
    fn predicted_peak_matches_the_allocator() {
        use crate::{Batch, Cluster, Link, PlanConfig, Planner};
        use fsdp_autograd::{cross_entropy, Tensor};
        use fsdp_core::config::{BackwardPrefetch, ShardingStrategy};
        let cfg = LlamaConfig::new(64, 64, 3, 4, 2, 160, 32);
        let (batch, w) = (2usize, 2usize);
        let link = Link {
            latency_s: 1e-6,
            bytes_per_s: 1e10,
        };
        let cluster = Cluster {
            nodes: 1,
            ranks_per_node: w,
            device_memory_bytes: 80 << 30,
            flops_per_s: 100e12,
            intra: link,
            inter: link,
        };
        let model = ModelDesc::llama(&cfg, &layers()).unwrap();
        let batch_desc = Batch {
            seqs_per_rank: batch,
            seq_len: cfg.seq_len,
        };
        let p = Planner::new(model, cluster, batch_desc).unwrap();
        let plan = PlanConfig::new(
            ShardingStrategy::FullShard,
            w,
            BackwardPrefetch::BackwardPre,
            false,
            true,
        );
        let predicted = p.estimate(&plan).unwrap().estimate.peak_bytes as f64;
        let peaks: Vec<usize> = std::thread::scope(|s| {
            let hs: Vec<_> = ThreadGroup::new(w)
                .into_iter()
                .enumerate()
                .map(|(r, pg)| {
                    s.spawn(move || {
                        let dev = Device::cpu(34_000 + r);
                        let model = Llama::new(&InitContext::eager(&dev, 1), &cfg).unwrap();
                        let pg: Arc<dyn ProcessGroup> = Arc::new(pg);
                        let config = plan.apply(FsdpConfig {
                            wrap_policy: layers(),
                            ..FsdpConfig::default()
                        });
                        let fsdp = Fsdp::wrap(model, &dev, pg, config).unwrap();
                        let mut peak = 0;
                        for step in 0..2 {
                            dev.reset_peak_stats();
                            let n = batch * cfg.seq_len;
                            let ids: Vec<i64> = (0..n)
                                .map(|i| ((i * 7 + r + step) % cfg.vocab) as i64)
                                .collect();
                            let tg: Vec<i64> =
                                (0..n).map(|i| ((i * 5 + r) % cfg.vocab) as i64).collect();
                            let x = Tensor::from_vec(ids, &[batch, cfg.seq_len], &dev).unwrap();
                            let y = Tensor::from_vec(tg, &[n], &dev).unwrap();
                            let logits =
                                fsdp.forward(&x).unwrap().reshape(&[n, cfg.vocab]).unwrap();
                            cross_entropy(&logits, &y).unwrap().backward().unwrap();
                            fsdp.sgd_step(0.01).unwrap();
                            fsdp.zero_grad();
                            fsdp.synchronize().unwrap();
                            peak = dev.memory_stats().peak_allocated_bytes;
                        }
                        peak
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, &m) in peaks.iter().enumerate() {
            let err = (predicted - m as f64) / m as f64;
            eprintln!(
                "llama rank {r}: measured {m} predicted {predicted} ({:+.1}%)",
                err * 100.0
            );
            assert!(
                err.abs() <= 0.05,
                "rank {r}: measured {m} B, predicted {predicted} B"
            );
        }
    }
}
