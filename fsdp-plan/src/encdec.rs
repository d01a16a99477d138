//! An encoder–decoder transformer (T5's shape) as the planner sees it, built directly — no
//! module of this shape exists in fsdp-autograd, so nothing here is checked against a wrapped
//! model the way [`ModelDesc::gpt`] is. Good enough for T5-11B's parameter counts, FLOPs and
//! activation sizes; see [`EncDecConfig`] for what it leaves out.

use crate::error::PlanError;
use crate::model::{Leaf, ModelDesc, UnitDesc};

/// The shape of a T5-style encoder–decoder: pre-norm blocks with RMS norm, no biases,
/// attention of `n_heads × d_kv` (which need not equal `d_model`), a ReLU feed-forward of width
/// `d_ff`, the token embedding shared by encoder, decoder and (tied) LM head. One FSDP unit per
/// block; the embedding, final norms and head in the root unit.
///
/// Left out: the relative-position bias tables (`n_heads × 32` per stack, under 0.01% of T5-11B),
/// dropout, and different encoder and decoder lengths (both are `seq_len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncDecConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub d_model: usize,
    /// Feed-forward width.
    pub d_ff: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Width of one head.
    pub d_kv: usize,
    /// Encoder blocks.
    pub encoder_layers: usize,
    /// Decoder blocks.
    pub decoder_layers: usize,
    /// Tokens per sequence (encoder input and decoder target alike).
    pub seq_len: usize,
}

impl EncDecConfig {
    /// T5-11B (Raffel et al. 2020, Table 14 / the released `t5-11b` config): vocab 32,128,
    /// d_model 1,024, d_ff 65,536, 128 heads of 128, 24 + 24 blocks; with `seq_len` tokens.
    pub fn t5_11b(seq_len: usize) -> EncDecConfig {
        EncDecConfig {
            vocab: 32_128,
            d_model: 1024,
            d_ff: 65_536,
            n_heads: 128,
            d_kv: 128,
            encoder_layers: 24,
            decoder_layers: 24,
            seq_len,
        }
    }
}

type Row = (String, usize, f64, f64, f64, usize, f64);

impl ModelDesc {
    /// The description of an encoder–decoder of shape `cfg` (f32 figures, like
    /// [`ModelDesc::gpt`]; use [`ModelDesc::with_compute_bytes`] and
    /// [`ModelDesc::with_activation_bytes`] for bf16).
    pub fn encoder_decoder(cfg: &EncDecConfig) -> Result<ModelDesc, PlanError> {
        let c = cfg;
        if [
            c.vocab,
            c.d_model,
            c.d_ff,
            c.n_heads,
            c.d_kv,
            c.encoder_layers,
            c.seq_len,
        ]
        .contains(&0)
        {
            return Err(PlanError::Model(format!("{cfg:?}: sizes must be positive")));
        }
        let (v, d, ff, h, t) = (
            c.vocab as f64,
            c.d_model as f64,
            c.d_ff as f64,
            c.n_heads as f64,
            c.seq_len as f64,
        );
        let inner = (c.n_heads * c.d_kv) as f64;
        let f = 4.0;
        let w = |n: f64| n as usize * 4;
        let mut units = vec![UnitDesc {
            path: String::new(),
            numel: c.vocab * c.d_model + 2 * c.d_model,
        }];
        // (path, unit, fwd FLOPs, saved, transient, weight-grad bytes, traffic) per token.
        let mut rows: Vec<Row> = vec![("shared".into(), 0, d, 0.0, f * d, w(v * d), f * 2.0 * d)];
        let attention = |rows: &mut Vec<Row>, p: &str, u: usize, kv_from_input: bool| {
            // Projections: q (and k, v from the block's own stream unless cross-attention).
            let proj_out = if kv_from_input { 3.0 } else { 1.0 };
            rows.push((
                format!("{p}.q"),
                u,
                2.0 * d * inner * proj_out,
                f * d,
                f * (proj_out * inner + 2.0 * d),
                w(proj_out * d * inner),
                f * (d + proj_out * inner),
            ));
            if !kv_from_input {
                // Cross-attention's k and v from the encoder output (one per encoder token).
                rows.push((
                    format!("{p}.kv"),
                    u,
                    2.0 * d * 2.0 * inner,
                    f * d,
                    f * (2.0 * inner + d),
                    w(2.0 * d * inner),
                    f * (d + 2.0 * inner),
                ));
            }
            rows.push((
                format!("{p}.attn"),
                u,
                4.0 * t * inner + 5.0 * h * t,
                f * 3.0 * inner + f * h * t,
                f * 5.0 * inner + f * h * t,
                0,
                f * (7.0 * inner + 4.0 * h * t),
            ));
            rows.push((
                format!("{p}.o"),
                u,
                2.0 * inner * d,
                f * inner,
                f * (inner + d),
                w(inner * d),
                f * (inner + 3.0 * d),
            ));
        };
        let norm = |rows: &mut Vec<Row>, p: String, u: usize| {
            rows.push((p, u, 4.0 * d, f * d + 4.0, 3.0 * f * d, w(d), f * 2.0 * d));
        };
        let feed_forward = |rows: &mut Vec<Row>, p: &str, u: usize| {
            rows.push((
                format!("{p}.wi"),
                u,
                2.0 * d * ff,
                f * d,
                f * (ff + 2.0 * d),
                w(d * ff),
                f * (d + ff),
            ));
            rows.push((
                format!("{p}.relu"),
                u,
                ff,
                f * ff,
                f * 2.0 * ff,
                0,
                f * 2.0 * ff,
            ));
            rows.push((
                format!("{p}.wo"),
                u,
                2.0 * ff * d,
                f * ff,
                f * (ff + d),
                w(ff * d),
                f * (ff + 3.0 * d),
            ));
        };
        let stack = |rows: &mut Vec<Row>, units: &mut Vec<UnitDesc>, name: &str, n: usize| {
            let decoder = name == "decoder";
            for i in 0..n {
                let p = format!("{name}.block.{i}");
                let u = units.len();
                let attn = 4 * c.d_model * c.n_heads * c.d_kv;
                units.push(UnitDesc {
                    path: p.clone(),
                    numel: attn * if decoder { 2 } else { 1 }
                        + 2 * c.d_model * c.d_ff
                        + c.d_model * if decoder { 3 } else { 2 },
                });
                norm(rows, format!("{p}.ln_attn"), u);
                attention(rows, &format!("{p}.self_attn"), u, true);
                if decoder {
                    norm(rows, format!("{p}.ln_cross"), u);
                    attention(rows, &format!("{p}.cross_attn"), u, false);
                }
                norm(rows, format!("{p}.ln_ff"), u);
                feed_forward(rows, &format!("{p}.ff"), u);
            }
        };
        stack(&mut rows, &mut units, "encoder", c.encoder_layers);
        norm(&mut rows, "encoder.final_ln".into(), 0);
        rows.push((
            "decoder.embed".into(),
            0,
            d,
            0.0,
            f * d,
            w(v * d),
            f * 2.0 * d,
        ));
        stack(&mut rows, &mut units, "decoder", c.decoder_layers);
        norm(&mut rows, "decoder.final_ln".into(), 0);
        rows.push((
            "lm_head".into(),
            0,
            2.0 * d * v,
            f * d,
            f * (v + d),
            w(v * d),
            f * (d + v),
        ));
        rows.push(("loss".into(), 0, 5.0 * v, 4.0, f * v, 0, f * 2.0 * v));
        let leaves: Vec<Leaf> = rows
            .into_iter()
            .map(|(path, unit, fl, saved, tr, wg, hbm)| Leaf {
                path,
                unit,
                fwd_flops_per_token: fl,
                saved_bytes_per_token: saved,
                bwd_transient_bytes_per_token: tr,
                weight_grad_bytes: wg,
                hbm_bytes_per_token: hbm,
            })
            .collect();
        let spans = (0..units.len())
            .map(|u| {
                if u == 0 {
                    return (0, leaves.len() - 2);
                }
                let first = leaves.iter().position(|l| l.unit == u).unwrap_or(0);
                let last = leaves.iter().rposition(|l| l.unit == u).unwrap_or(first);
                (first, last)
            })
            .collect();
        let m = ModelDesc {
            name: format!(
                "enc-dec v{} d{} ff{} h{}x{} L{}+{} t{}",
                c.vocab,
                c.d_model,
                c.d_ff,
                c.n_heads,
                c.d_kv,
                c.encoder_layers,
                c.decoder_layers,
                c.seq_len
            ),
            units,
            leaves,
            spans,
            param_bytes: 4,
            compute_bytes: 4,
            // Encoder ids, decoder ids and targets (i64).
            input_bytes_per_token: 24.0,
            output_bytes_per_token: f * v,
            seq_len: c.seq_len,
        };
        m.validate()?;
        Ok(m)
    }
}
