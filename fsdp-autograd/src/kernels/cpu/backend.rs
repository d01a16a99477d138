//! [`CpuBackend`]: the seam's CPU implementation — every launch is one closure on the CPU
//! stream that runs the matching `kernels::cpu` function on the operands' memory (half dtypes are
//! computed in `f32` through a temporary, as everywhere on the CPU).

use fsdp_alloc::Stream;

use crate::error::{AutogradError, Result};
use crate::kernels::backend::{
    AttentionLayout, AttentionSaved, AttentionStats, Backend, BinaryOp, Launch, Operand, ReadFn,
    SumTo,
};
use crate::kernels::{cpu, Gelu, KernelError};
use crate::launch::{launch, launch_f32, strided_copy_arg};
use crate::tensor::fill_arg;

/// The CPU attention saves probabilities (its `attention_save` is the default `Probs`); a launch
/// asking for the fused kernels' log-sum-exp is an error.
fn lse_unsupported(op: &'static str) -> AutogradError {
    AutogradError::Unsupported {
        op,
        detail: "the CPU attention saves the probabilities, not the log-sum-exp; launch it with \
                 the statistics `Kernels::attention_save` names"
            .into(),
    }
}

/// The CPU kernels behind the seam (stateless; one value serves every CPU device).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    /// The CPU takes the packed layout (gathered inside the kernel, bit for bit the head-split
    /// result).
    fn attention_packed(&self, _a: &crate::kernels::backend::Attention) -> bool {
        true
    }

    fn launch(&self, s: &Stream, l: &Launch<'_>) -> Result<()> {
        match *l {
            Launch::Gemm { g, a, b, c } => launch_f32(
                s,
                "matmul",
                [a, b],
                [c],
                g.accumulate,
                move |[a, b], [c]| {
                    let (m, k, n, ta, tb, acc) =
                        (g.m, g.k, g.n, g.trans_a, g.trans_b, g.accumulate);
                    if g.batch == 1 {
                        cpu::matmul(a, b, c, m, k, n, ta, tb, acc)
                    } else {
                        cpu::bmm(a, b, c, g.batch, m, k, n, ta, tb, acc)
                    }
                },
            ),
            Launch::Binary {
                op,
                rows,
                a,
                b,
                out,
            } => {
                let name = l.name();
                let run = move |a: &[f32], b: &[f32], o: &mut [f32]| match op {
                    BinaryOp::Add => cpu::add(a, b, o),
                    BinaryOp::Mul => cpu::mul(a, b, o),
                };
                let cols = rows.cols;
                launch_f32(s, name, [a, b], [out], false, move |[f, s], [o]| {
                    if cols == f.len() || s.len() == f.len() {
                        run(f, s, o)
                    } else if op == BinaryOp::Add {
                        cpu::add_row_bias(f, s, o)
                    } else {
                        f.chunks(cols)
                            .zip(o.chunks_mut(cols))
                            .try_for_each(|(fr, or)| run(fr, s, or))
                    }
                })
            }
            Launch::Scale { alpha, x, out, .. } => {
                launch_f32(s, "scale", [x], [out], false, move |[x], [o]| {
                    cpu::scale(x, alpha, o)
                })
            }
            Launch::ScaleInplace { alpha, y, .. } => {
                let ya = y.clone();
                launch(s, "scale", move || {
                    ya.f32_mut("scale_", true, |d| cpu::scale_inplace(d, alpha))
                });
            }
            Launch::AxpyRows { rows, alpha, x, y } => {
                let cols = rows.cols;
                launch_f32(s, "axpy", [x], [y], true, move |[x], [y]| {
                    y.chunks_mut(cols)
                        .try_for_each(|row| cpu::add_scaled(row, alpha, x))
                })
            }
            Launch::Sum { n, mean, x, out } => {
                launch_f32(s, l.name(), [x], [out], false, move |[x], [o]| {
                    let s = cpu::sum(x);
                    o[0] = if mean { s / n as f32 } else { s };
                    Ok(())
                })
            }
            Launch::ColSums { x, out, .. } => {
                launch_f32(s, "col_sums", [x], [out], false, |[x], [o]| {
                    cpu::col_sums(x, o)
                })
            }
            Launch::SumTo { shape, x, out } => {
                let st = shape.clone();
                launch_f32(s, "sum_to", [x], [out], false, move |[x], [o]| {
                    sum_to(&st, x, o);
                    Ok(())
                })
            }
            Launch::Gelu { kind, x, y, .. } => {
                launch_f32(s, "gelu", [x], [y], false, move |[x], [y]| match kind {
                    Gelu::Tanh => cpu::gelu(x, y),
                    Gelu::Exact => cpu::gelu_exact(x, y),
                })
            }
            Launch::GeluBackward {
                kind, x, dy, dx, ..
            } => {
                let op = "gelu_backward";
                launch_f32(s, op, [x, dy], [dx], false, move |[x, g], [d]| match kind {
                    Gelu::Tanh => cpu::gelu_backward(x, g, d),
                    Gelu::Exact => cpu::gelu_exact_backward(x, g, d),
                })
            }
            Launch::Softmax { rows, x, y } => {
                let cols = rows.cols;
                launch_f32(s, "softmax", [x], [y], false, move |[x], [y]| {
                    cpu::softmax_rows(x, y, cols)
                })
            }
            Launch::SoftmaxBackward { rows, y, dy, dx } => {
                let cols = rows.cols;
                launch_f32(
                    s,
                    "softmax_backward",
                    [y, dy],
                    [dx],
                    false,
                    move |[y, g], [d]| cpu::softmax_rows_backward(y, g, d, cols),
                )
            }
            Launch::LayerNorm {
                ln,
                x,
                gamma,
                beta,
                y,
                mean,
                rstd,
            } => {
                let (cols, eps) = (ln.rows.cols, ln.eps);
                let (ins, outs) = ([x, gamma, beta], [y, mean, rstd]);
                launch_f32(
                    s,
                    "layer_norm",
                    ins,
                    outs,
                    false,
                    move |[x, g, b], [y, m, r]| cpu::layer_norm(x, g, b, y, m, r, cols, eps),
                )
            }
            Launch::LayerNormBackward {
                ln,
                x,
                gamma,
                mean,
                rstd,
                dy,
                dx,
                dgamma,
                dbeta,
            } => {
                let cols = ln.rows.cols;
                let (ins, outs) = ([x, gamma, mean, rstd, dy], [dx, dgamma, dbeta]);
                let op = "layer_norm_backward";
                launch_f32(
                    s,
                    op,
                    ins,
                    outs,
                    false,
                    move |[x, g, m, r, dy], [dx, dg, db]| {
                        cpu::layer_norm_backward(x, g, m, r, dy, dx, dg, db, cols)
                    },
                )
            }
            Launch::Embedding { e, ids, table, out } => {
                let (ids, dim, op) = (ids.clone(), e.dim, "embedding");
                launch_f32(s, op, [table], [out], false, move |[t], [o]| {
                    ids.typed::<i64, _>(op, |i| cpu::embedding(i, t, o, dim))
                })
            }
            Launch::EmbeddingBackward { e, ids, dy, dtable } => {
                let (ids, dim, op) = (ids.clone(), e.dim, "embedding_backward");
                launch_f32(s, op, [dy], [dtable], false, move |[g], [d]| {
                    ids.typed::<i64, _>(op, |i| cpu::embedding_backward(i, g, d, dim))
                })
            }
            Launch::Attention {
                a,
                q,
                k,
                v,
                out,
                stats,
            } => {
                let AttentionStats::Probs(probs) = stats else {
                    return Err(lse_unsupported("attention"));
                };
                if a.layout == AttentionLayout::Packed {
                    // q = k = v: the whole qkv tensor (checked by the seam's front).
                    let (ins, outs) = ([q], [out, probs]);
                    launch_f32(s, "attention", ins, outs, false, move |[qkv], [o, p]| {
                        cpu::causal_attention_packed(qkv, o, p, a.batch, a.heads, a.t, a.d)
                    });
                    return Ok(());
                }
                let (ins, outs) = ([q, k, v], [out, probs]);
                launch_f32(
                    s,
                    "attention",
                    ins,
                    outs,
                    false,
                    move |[q, k, v], [o, p]| {
                        cpu::causal_attention(q, k, v, o, p, a.batch, a.heads, a.t, a.d)
                    },
                )
            }
            Launch::AttentionBackward {
                a,
                q,
                k,
                v,
                saved,
                dout,
                dq,
                dk,
                dv,
            } => {
                let AttentionSaved::Probs(probs) = saved else {
                    return Err(lse_unsupported("attention_backward"));
                };
                let op = "attention_backward";
                if a.layout == AttentionLayout::Packed {
                    // q = k = v and dq = dk = dv: whole tensors (checked by the seam's front).
                    let (ins, outs) = ([q, probs, dout], [dq]);
                    launch_f32(s, op, ins, outs, false, move |[qkv, p, g], [dqkv]| {
                        let (b, h, t, d) = (a.batch, a.heads, a.t, a.d);
                        cpu::causal_attention_packed_backward(qkv, p, g, dqkv, b, h, t, d)
                    });
                    return Ok(());
                }
                let (ins, outs) = ([q, k, v, probs, dout], [dq, dk, dv]);
                launch_f32(
                    s,
                    op,
                    ins,
                    outs,
                    false,
                    move |[q, k, v, p, g], [dq, dk, dv]| {
                        let (b, h, t, d) = (a.batch, a.heads, a.t, a.d);
                        cpu::causal_attention_backward(q, k, v, p, g, dq, dk, dv, b, h, t, d)
                    },
                )
            }
            Launch::CrossEntropy {
                rows,
                logits,
                targets,
                loss,
                lse,
            } => {
                let (targets, cols, op) = (targets.clone(), rows.cols, "cross_entropy");
                launch_f32(s, op, [logits], [lse, loss], false, move |[l], [e, o]| {
                    o[0] = targets.typed::<i64, _>(op, |t| cpu::cross_entropy(l, t, cols, e))?;
                    Ok(())
                })
            }
            Launch::CrossEntropyBackward {
                rows,
                logits,
                targets,
                lse,
                dloss,
                dlogits,
            } => {
                let (targets, cols, op) = (targets.clone(), rows.cols, "cross_entropy_backward");
                let ins = [logits, lse, dloss];
                launch_f32(s, op, ins, [dlogits], false, move |[l, e, g], [d]| {
                    let dl = g[0];
                    targets
                        .typed::<i64, _>(op, |t| cpu::cross_entropy_backward(l, t, e, dl, d, cols))
                })
            }
            // Through f32: the half → f32 and f32 → half conversions are `kernels::cpu::cast_*`.
            Launch::Cast { x, out, .. } => launch_f32(s, "cast", [x], [out], false, |[x], [o]| {
                o.copy_from_slice(x);
                Ok(())
            }),
            Launch::Fill { value, out, .. } => {
                let a = out.clone();
                launch(s, "fill", move || fill_arg("fill", &a, value));
            }
            Launch::Arange { out, .. } => {
                let a = out.clone();
                launch(s, "arange", move || {
                    a.typed_mut::<i64, _>("arange", |d| {
                        for (i, x) in d.iter_mut().enumerate() {
                            *x = i as i64;
                        }
                    })
                });
            }
            Launch::Copy {
                src_view,
                src,
                dst_view,
                dst,
            } => {
                let (sa, da, sv, dv) =
                    (src.clone(), dst.clone(), src_view.clone(), dst_view.clone());
                launch(s, "copy", move || {
                    strided_copy_arg(
                        "copy",
                        &sa,
                        sv.offset,
                        &sv.strides,
                        &da,
                        dv.offset,
                        &dv.strides,
                        &sv.shape,
                    )
                });
            }
            Launch::SgdStep { .. }
            | Launch::AdamWStep { .. }
            | Launch::LambDirection { .. }
            | Launch::LambApply { .. }
            | Launch::SumSquares { .. }
            | Launch::Unscale { .. } => launch_optim(s, l),
        }
        Ok(())
    }

    fn write(&self, s: &Stream, bytes: Vec<u8>, dst: &Operand) -> Result<()> {
        let a = dst.clone();
        launch(s, "from_vec", move || {
            a.typed_mut::<u8, _>("from_vec", |d| d.copy_from_slice(&bytes))
        });
        Ok(())
    }

    fn read(&self, s: &Stream, src: &Operand, f: ReadFn) -> Result<()> {
        let a = src.clone();
        launch(s, "to_vec", move || a.typed::<u8, _>("to_vec", f));
        Ok(())
    }
}

/// [`SumTo`] on the host: `out` zeroed, then `out[t(i)] += x[i]` with an odometer over `x`'s
/// index space.
fn sum_to(st: &SumTo, x: &[f32], o: &mut [f32]) {
    let (gs, tstrides) = (&st.shape, &st.target_strides);
    o.fill(0.0);
    let nd = gs.len();
    let mut idx = vec![0usize; nd];
    let mut t = 0usize;
    for &v in x {
        o[t] += v;
        let mut d = nd;
        while d > 0 {
            d -= 1;
            idx[d] += 1;
            t += tstrides[d];
            if idx[d] < gs[d] {
                break;
            }
            t -= tstrides[d] * gs[d];
            idx[d] = 0;
        }
    }
}

/// Elements per piece when an elementwise optimizer kernel is split across rayon's pool: 64 Ki
/// f32 (256 KiB per operand) is worth a task, and a GPT-2 unit's shard still makes dozens.
const PIECE: usize = 1 << 16;

/// One piece of [`par_pieces`]: the inputs' and outputs' slices of the same element range.
type Piece<'a, const I: usize, const O: usize> = ([&'a [f32]; I], [&'a mut [f32]; O]);

/// Runs `f` on matching pieces of `ins` and `outs` (operands of one length), on rayon's global
/// pool when there is more than one piece. For the elementwise kernels (SGD, AdamW, the LAMB
/// halves) a piece's update is exactly that piece of the whole update, so the result is the
/// same bit for bit however the work is split (the first error, if any, is returned).
fn par_pieces<const I: usize, const O: usize>(
    ins: [&[f32]; I],
    outs: [&mut [f32]; O],
    f: impl Fn([&[f32]; I], [&mut [f32]; O]) -> std::result::Result<(), KernelError> + Sync,
) -> std::result::Result<(), KernelError> {
    use rayon::prelude::*;
    let n = outs.first().map_or(0, |o| o.len());
    let same = ins.iter().all(|x| x.len() == n) && outs.iter().all(|x| x.len() == n);
    if n <= PIECE || !same {
        // One piece, or operands the kernel itself must reject: run it whole.
        return f(ins, outs);
    }
    let mut out_pieces = outs.map(|o| o.chunks_mut(PIECE));
    let pieces: Vec<Piece<'_, I, O>> = (0..n.div_ceil(PIECE))
        .map(|k| {
            let r = k * PIECE..((k + 1) * PIECE).min(n);
            let o = out_pieces
                .each_mut()
                .map(|it| it.next().expect("every output has n elements"));
            (ins.map(|x| &x[r.clone()]), o)
        })
        .collect();
    pieces.into_par_iter().try_for_each(|(i, o)| f(i, o))
}

/// The optimizer launches: one closure per launch running the `cpu::optim` kernel (operands are
/// f32, checked by the seam's front); the elementwise ones split over the cores
/// ([`par_pieces`]).
fn launch_optim(s: &Stream, l: &Launch<'_>) {
    use cpu::optim;
    let op = l.name();
    match *l {
        Launch::SgdStep {
            rule,
            first,
            p,
            g,
            buf,
            ..
        } => match buf {
            Some(b) => launch_f32(s, op, [g], [p, b], true, move |[g], [p, b]| {
                par_pieces([g], [p, b], |[g], [p, b]| {
                    optim::sgd_step(&rule, p, g, Some(b), first)
                })
            }),
            None => launch_f32(s, op, [g], [p], true, move |[g], [p]| {
                par_pieces([g], [p], |[g], [p]| {
                    optim::sgd_step(&rule, p, g, None, first)
                })
            }),
        },
        Launch::AdamWStep { c, p, g, m, v, .. } => {
            launch_f32(s, op, [g], [p, m, v], true, move |[g], [p, m, v]| {
                par_pieces([g], [p, m, v], |[g], [p, m, v]| {
                    optim::adamw_step(&c, p, g, m, v)
                })
            })
        }
        Launch::LambDirection {
            c, p, g, m, v, u, ..
        } => launch_f32(s, op, [p, g], [m, v, u], true, move |[p, g], [m, v, u]| {
            par_pieces([p, g], [m, v, u], |[p, g], [m, v, u]| {
                optim::lamb_direction(&c, p, g, m, v, u)
            })
        }),
        Launch::LambApply {
            lr,
            w_sq,
            u_sq,
            sums,
            u,
            p,
            ..
        } => launch_f32(s, op, [u, sums], [p], true, move |[u, sums], [p]| {
            let (w, un) = (sums[w_sq] as f64, sums[u_sq] as f64);
            par_pieces([u], [p], |[u], [p]| optim::lamb_apply(p, u, lr, w, un))
        }),
        Launch::SumSquares { xs, pieces, out } => {
            let (xs, pieces, out) = (xs.to_vec(), pieces.to_vec(), out.clone());
            launch(s, op, move || {
                use rayon::prelude::*;
                let reads: Vec<_> = xs.iter().map(|x| x.read_f32(op)).collect();
                let slices: Vec<&[f32]> = reads.iter().map(|r| &r[..]).collect();
                // Each piece's sum on its own core (a GPT-2 shard's ~150 pieces took ~100 ms
                // on one thread under CPU offload); each is still one sequential f64 sum and
                // the pieces are added in order, so the bits are those of the serial loop.
                let sums: Vec<f64> = pieces
                    .par_iter()
                    .map(|pc| optim::sum_sq(&slices[pc.input][pc.start..pc.start + pc.len]))
                    .collect();
                let mut acc = vec![0f64; out.numel()];
                for (pc, s) in pieces.iter().zip(sums) {
                    acc[pc.out] += s;
                }
                drop(slices);
                drop(reads);
                out.f32_mut(op, false, |o| {
                    for (o, a) in o.iter_mut().zip(&acc) {
                        *o = *a as f32;
                    }
                });
            });
        }
        Launch::Unscale {
            inv, g, found_inf, ..
        } => launch_f32(s, op, [], [g, found_inf], true, move |[], [g, flag]| {
            if optim::unscale(g, inv) {
                flag[0] = 1.0;
            }
            Ok(())
        }),
        _ => unreachable!("launch_optim is called for the optimizer launches only"),
    }
}

#[cfg(test)]
mod par_tests {
    use super::*;
    use crate::kernels::cpu::optim::{self, AdamCoeffs, SgdRule};

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Split over the pool or run whole, the elementwise optimizer kernels give the same bits.
    #[test]
    fn pieces_on_the_pool_equal_the_whole_update() {
        let n = 3 * PIECE + 17;
        let val = |k: usize, i: usize| ((i * 7 + k * 13) % 101) as f32 * 0.013 - 0.6;
        let g: Vec<f32> = (0..n).map(|i| val(1, i)).collect();
        let (p0, m0, v0): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..n).map(|i| val(2, i)).collect(),
            (0..n).map(|i| val(3, i) * 0.1).collect(),
            (0..n).map(|i| val(4, i).abs() * 0.01).collect(),
        );
        let c = AdamCoeffs::new(1e-3, (0.9, 0.95), 1e-8, 0.1, 3);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        optim::adamw_step(&c, &mut p, &g, &mut m, &mut v).unwrap();
        let (mut pp, mut pm, mut pv) = (p0.clone(), m0.clone(), v0.clone());
        par_pieces([&g], [&mut pp, &mut pm, &mut pv], |[g], [p, m, v]| {
            optim::adamw_step(&c, p, g, m, v)
        })
        .unwrap();
        assert_eq!(
            (bits(&pp), bits(&pm), bits(&pv)),
            (bits(&p), bits(&m), bits(&v))
        );

        let rule = SgdRule::new(0.1).with_momentum(0.9).with_nesterov(true);
        let (mut p, mut b) = (p0.clone(), m0.clone());
        optim::sgd_step(&rule, &mut p, &g, Some(&mut b), false).unwrap();
        let (mut pp, mut pb) = (p0.clone(), m0.clone());
        par_pieces([&g], [&mut pp, &mut pb], |[g], [p, b]| {
            optim::sgd_step(&rule, p, g, Some(b), false)
        })
        .unwrap();
        assert_eq!((bits(&pp), bits(&pb)), (bits(&p), bits(&b)));

        // Operands of different lengths reach the kernel whole, which rejects them.
        let mut short = vec![0f32; n - 1];
        let e = par_pieces([&g], [&mut short], |[g], [p]| {
            optim::sgd_step(&rule, p, g, None, false)
        });
        assert!(
            matches!(e, Err(KernelError::LengthMismatch { .. })),
            "{e:?}"
        );
    }
}

#[cfg(test)]
mod copy_host_tests {
    use fsdp_alloc::Device;

    use crate::kernels::backend::Kernels;
    use crate::AutogradError;

    /// The seam's host copy: in stream order, bit for bit, and refused for a stream of another
    /// device, a buffer on a third device, or lengths that differ.
    #[test]
    fn copy_host_checks_its_arguments_and_copies_in_stream_order() {
        let (dev, host, other) = (Device::cpu(0), Device::cpu(1), Device::cpu(2));
        let s = dev.new_stream("copy");
        let k = Kernels::for_device(&dev).unwrap();
        let src = host.alloc(64, &s).unwrap();
        let dst = dev.alloc(64, &s).unwrap();
        src.data()
            .write::<f32>()
            .unwrap()
            .copy_from_slice(&[-0.0f32; 16]);
        // A held-up stream: the copy must not run before the work launched ahead of it.
        s.launch(|| std::thread::sleep(std::time::Duration::from_millis(30)));
        k.copy_host(&s, src.data(), dst.data()).unwrap();
        s.synchronize().unwrap();
        let bits: Vec<u32> = dst
            .data()
            .read::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(bits, vec![(-0.0f32).to_bits(); 16]);

        let elsewhere = other.new_stream("x");
        assert!(matches!(
            k.copy_host(&elsewhere, src.data(), dst.data()),
            Err(AutogradError::Device { .. })
        ));
        let third = other.alloc(64, &elsewhere).unwrap();
        assert!(matches!(
            k.copy_host(&s, src.data(), third.data()),
            Err(AutogradError::Device { .. })
        ));
        let short = dev.alloc(32, &s).unwrap();
        assert!(k.copy_host(&s, src.data(), short.data()).is_err());
    }
}
