//! [`CpuBackend`]: the seam's CPU implementation — every method launches one closure on the CPU
//! stream that runs the matching `kernels::cpu` function on the operands' memory (half dtypes are
//! computed in `f32` through a temporary, as everywhere on the CPU).

use fsdp_alloc::Stream;

use crate::error::Result;
use crate::kernels::backend::{
    Attention, Backend, BinaryOp, EmbeddingShape, LayerNormShape, Operand, ReadFn, Rows, SumTo,
    View,
};
use crate::kernels::{cpu, Gelu};
use crate::launch::{fail, launch, strided_copy_arg};
use crate::tensor::fill_arg;

/// The CPU kernels behind the seam (stateless; one value serves every CPU device).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn gemm(
        &self,
        s: &Stream,
        g: &crate::kernels::backend::Gemm,
        a: &Operand,
        b: &Operand,
        c: &Operand,
    ) -> Result<()> {
        let (a, b, c, g) = (a.clone(), b.clone(), c.clone(), *g);
        launch(s, "matmul", move || {
            a.f32("matmul", |a| {
                b.f32("matmul", |b| {
                    c.f32_mut("matmul", g.accumulate, |c| {
                        let r = if g.batch == 1 {
                            cpu::matmul(a, b, c, g.m, g.k, g.n, g.trans_a, g.trans_b, g.accumulate)
                        } else {
                            cpu::bmm(
                                a,
                                b,
                                c,
                                g.batch,
                                g.m,
                                g.k,
                                g.n,
                                g.trans_a,
                                g.trans_b,
                                g.accumulate,
                            )
                        };
                        r.unwrap_or_else(|e| fail("matmul", e))
                    })
                })
            })
        });
        Ok(())
    }

    fn binary(
        &self,
        s: &Stream,
        op: BinaryOp,
        rows: Rows,
        a: &Operand,
        b: &Operand,
        out: &Operand,
    ) -> Result<()> {
        let (fa, sa, oa) = (a.clone(), b.clone(), out.clone());
        let name = match op {
            BinaryOp::Add => "add",
            BinaryOp::Mul => "mul",
        };
        let run = move |a: &[f32], b: &[f32], o: &mut [f32]| match op {
            BinaryOp::Add => cpu::add(a, b, o),
            BinaryOp::Mul => cpu::mul(a, b, o),
        };
        let cols = rows.cols;
        launch(s, name, move || {
            fa.f32(name, |f| {
                sa.f32(name, |s| {
                    oa.f32_mut(name, false, |o| {
                        let r = if cols == f.len() || s.len() == f.len() {
                            run(f, s, o)
                        } else if op == BinaryOp::Add {
                            cpu::add_row_bias(f, s, o)
                        } else {
                            f.chunks(cols)
                                .zip(o.chunks_mut(cols))
                                .try_for_each(|(fr, or)| run(fr, s, or))
                        };
                        r.unwrap_or_else(|e| fail(name, e))
                    })
                })
            })
        });
        Ok(())
    }

    fn scale(&self, s: &Stream, _n: usize, alpha: f32, x: &Operand, out: &Operand) -> Result<()> {
        let (xa, oa) = (x.clone(), out.clone());
        launch(s, "scale", move || {
            xa.f32("scale", |x| {
                oa.f32_mut("scale", false, |o| {
                    cpu::scale(x, alpha, o).unwrap_or_else(|e| fail("scale", e))
                })
            })
        });
        Ok(())
    }

    fn scale_inplace(&self, s: &Stream, _n: usize, alpha: f32, y: &Operand) -> Result<()> {
        let ya = y.clone();
        launch(s, "scale", move || {
            ya.f32_mut("scale_", true, |d| cpu::scale_inplace(d, alpha))
        });
        Ok(())
    }

    fn axpy_rows(
        &self,
        s: &Stream,
        rows: Rows,
        alpha: f32,
        x: &Operand,
        y: &Operand,
    ) -> Result<()> {
        let (sa, da) = (x.clone(), y.clone());
        let cols = rows.cols;
        launch(s, "axpy", move || {
            sa.f32("axpy", |s| {
                da.f32_mut("axpy", true, |d| {
                    d.chunks_mut(cols)
                        .try_for_each(|row| cpu::add_scaled(row, alpha, s))
                        .unwrap_or_else(|e| fail("axpy", e))
                })
            })
        });
        Ok(())
    }

    fn sum(&self, s: &Stream, n: usize, mean: bool, x: &Operand, out: &Operand) -> Result<()> {
        let (xa, oa) = (x.clone(), out.clone());
        let op = if mean { "mean" } else { "sum" };
        launch(s, op, move || {
            let s = xa.f32(op, cpu::sum);
            let v = if mean { s / n as f32 } else { s };
            oa.f32_mut(op, false, |o| o[0] = v)
        });
        Ok(())
    }

    fn col_sums(&self, s: &Stream, _rows: Rows, x: &Operand, out: &Operand) -> Result<()> {
        let (xa, oa) = (x.clone(), out.clone());
        launch(s, "col_sums", move || {
            xa.f32("sum_to", |x| {
                oa.f32_mut("sum_to", false, |o| {
                    cpu::col_sums(x, o).unwrap_or_else(|e| fail("sum_to", e))
                })
            })
        });
        Ok(())
    }

    fn sum_to(&self, s: &Stream, st: &SumTo, x: &Operand, out: &Operand) -> Result<()> {
        let (xa, oa) = (x.clone(), out.clone());
        let (gs, tstrides) = (st.shape.clone(), st.target_strides.clone());
        launch(s, "sum_to", move || {
            xa.f32("sum_to", |x| {
                oa.f32_mut("sum_to", false, |o| {
                    o.fill(0.0);
                    let nd = gs.len();
                    let mut idx = vec![0usize; nd];
                    let mut t = 0usize;
                    for &v in x {
                        o[t] += v;
                        // odometer over x's index space
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
                })
            })
        });
        Ok(())
    }

    fn gelu(&self, s: &Stream, kind: Gelu, _n: usize, x: &Operand, y: &Operand) -> Result<()> {
        let (xa, oa) = (x.clone(), y.clone());
        launch(s, "gelu", move || {
            xa.f32("gelu", |x| {
                oa.f32_mut("gelu", false, |o| {
                    match kind {
                        Gelu::Tanh => cpu::gelu(x, o),
                        Gelu::Exact => cpu::gelu_exact(x, o),
                    }
                    .unwrap_or_else(|e| fail("gelu", e))
                })
            })
        });
        Ok(())
    }

    fn gelu_backward(
        &self,
        s: &Stream,
        kind: Gelu,
        _n: usize,
        x: &Operand,
        dy: &Operand,
        dx: &Operand,
    ) -> Result<()> {
        let (xa, ga, da) = (x.clone(), dy.clone(), dx.clone());
        let op = "gelu_backward";
        launch(s, op, move || {
            xa.f32(op, |x| {
                ga.f32(op, |g| {
                    da.f32_mut(op, false, |d| {
                        match kind {
                            Gelu::Tanh => cpu::gelu_backward(x, g, d),
                            Gelu::Exact => cpu::gelu_exact_backward(x, g, d),
                        }
                        .unwrap_or_else(|e| fail(op, e))
                    })
                })
            })
        });
        Ok(())
    }

    fn softmax(&self, s: &Stream, rows: Rows, x: &Operand, y: &Operand) -> Result<()> {
        let (xa, ya) = (x.clone(), y.clone());
        let cols = rows.cols;
        launch(s, "softmax", move || {
            xa.f32("softmax", |x| {
                ya.f32_mut("softmax", false, |y| {
                    cpu::softmax_rows(x, y, cols).unwrap_or_else(|e| fail("softmax", e))
                })
            })
        });
        Ok(())
    }

    fn softmax_backward(
        &self,
        s: &Stream,
        rows: Rows,
        y: &Operand,
        dy: &Operand,
        dx: &Operand,
    ) -> Result<()> {
        let (ya, ga, da) = (y.clone(), dy.clone(), dx.clone());
        let cols = rows.cols;
        let op = "softmax_backward";
        launch(s, op, move || {
            ya.f32(op, |y| {
                ga.f32(op, |g| {
                    da.f32_mut(op, false, |d| {
                        cpu::softmax_rows_backward(y, g, d, cols).unwrap_or_else(|e| fail(op, e))
                    })
                })
            })
        });
        Ok(())
    }

    fn layer_norm(
        &self,
        s: &Stream,
        ln: LayerNormShape,
        x: &Operand,
        gamma: &Operand,
        beta: &Operand,
        y: &Operand,
        mean: &Operand,
        rstd: &Operand,
    ) -> Result<()> {
        let (xa, ga, ba, ya, ma, ra) = (
            x.clone(),
            gamma.clone(),
            beta.clone(),
            y.clone(),
            mean.clone(),
            rstd.clone(),
        );
        let (cols, eps) = (ln.rows.cols, ln.eps);
        let op = "layer_norm";
        launch(s, op, move || {
            xa.f32(op, |x| {
                ga.f32(op, |g| {
                    ba.f32(op, |b| {
                        ya.f32_mut(op, false, |y| {
                            ma.f32_mut(op, false, |m| {
                                ra.f32_mut(op, false, |r| {
                                    cpu::layer_norm(x, g, b, y, m, r, cols, eps)
                                        .unwrap_or_else(|e| fail(op, e))
                                })
                            })
                        })
                    })
                })
            })
        });
        Ok(())
    }

    fn layer_norm_backward(
        &self,
        s: &Stream,
        ln: LayerNormShape,
        x: &Operand,
        gamma: &Operand,
        mean: &Operand,
        rstd: &Operand,
        dy: &Operand,
        dx: &Operand,
        dgamma: &Operand,
        dbeta: &Operand,
    ) -> Result<()> {
        let (xa, ga, ma, ra, dya, dxa, dga, dba) = (
            x.clone(),
            gamma.clone(),
            mean.clone(),
            rstd.clone(),
            dy.clone(),
            dx.clone(),
            dgamma.clone(),
            dbeta.clone(),
        );
        let cols = ln.rows.cols;
        let op = "layer_norm_backward";
        launch(s, op, move || {
            xa.f32(op, |x| {
                ga.f32(op, |g| {
                    ma.f32(op, |m| {
                        ra.f32(op, |r| {
                            dya.f32(op, |dy| {
                                dxa.f32_mut(op, false, |dx| {
                                    dga.f32_mut(op, false, |dg| {
                                        dba.f32_mut(op, false, |db| {
                                            cpu::layer_norm_backward(
                                                x, g, m, r, dy, dx, dg, db, cols,
                                            )
                                            .unwrap_or_else(|e| fail(op, e))
                                        })
                                    })
                                })
                            })
                        })
                    })
                })
            })
        });
        Ok(())
    }

    fn embedding(
        &self,
        s: &Stream,
        e: EmbeddingShape,
        ids: &Operand,
        table: &Operand,
        out: &Operand,
    ) -> Result<()> {
        let (ia, ta, oa) = (ids.clone(), table.clone(), out.clone());
        let (dim, op) = (e.dim, "embedding");
        launch(s, op, move || {
            ia.typed::<i64, _>(op, |i| {
                ta.f32(op, |t| {
                    oa.f32_mut(op, false, |o| {
                        cpu::embedding(i, t, o, dim).unwrap_or_else(|e| fail(op, e))
                    })
                })
            })
        });
        Ok(())
    }

    fn embedding_backward(
        &self,
        s: &Stream,
        e: EmbeddingShape,
        ids: &Operand,
        dy: &Operand,
        dtable: &Operand,
    ) -> Result<()> {
        let (ia, ga, da) = (ids.clone(), dy.clone(), dtable.clone());
        let (dim, op) = (e.dim, "embedding_backward");
        launch(s, op, move || {
            ia.typed::<i64, _>(op, |i| {
                ga.f32(op, |g| {
                    da.f32_mut(op, false, |d| {
                        cpu::embedding_backward(i, g, d, dim).unwrap_or_else(|e| fail(op, e))
                    })
                })
            })
        });
        Ok(())
    }

    fn attention(
        &self,
        s: &Stream,
        a: Attention,
        q: &Operand,
        k: &Operand,
        v: &Operand,
        out: &Operand,
        probs: &Operand,
    ) -> Result<()> {
        let (qa, ka, va, oa, pa) = (q.clone(), k.clone(), v.clone(), out.clone(), probs.clone());
        let op = "attention";
        launch(s, op, move || {
            qa.f32(op, |q| {
                ka.f32(op, |k| {
                    va.f32(op, |v| {
                        oa.f32_mut(op, false, |o| {
                            pa.f32_mut(op, false, |p| {
                                cpu::causal_attention(q, k, v, o, p, a.batch, a.heads, a.t, a.d)
                                    .unwrap_or_else(|e| fail(op, e))
                            })
                        })
                    })
                })
            })
        });
        Ok(())
    }

    fn attention_backward(
        &self,
        s: &Stream,
        a: Attention,
        q: &Operand,
        k: &Operand,
        v: &Operand,
        probs: &Operand,
        dout: &Operand,
        dq: &Operand,
        dk: &Operand,
        dv: &Operand,
    ) -> Result<()> {
        let (qa, ka, va, pa, ga, dqa, dka, dva) = (
            q.clone(),
            k.clone(),
            v.clone(),
            probs.clone(),
            dout.clone(),
            dq.clone(),
            dk.clone(),
            dv.clone(),
        );
        let op = "attention_backward";
        launch(s, op, move || {
            qa.f32(op, |q| {
                ka.f32(op, |k| {
                    va.f32(op, |v| {
                        pa.f32(op, |p| {
                            ga.f32(op, |g| {
                                dqa.f32_mut(op, false, |dq| {
                                    dka.f32_mut(op, false, |dk| {
                                        dva.f32_mut(op, false, |dv| {
                                            cpu::causal_attention_backward(
                                                q, k, v, p, g, dq, dk, dv, a.batch, a.heads, a.t,
                                                a.d,
                                            )
                                            .unwrap_or_else(|e| fail(op, e))
                                        })
                                    })
                                })
                            })
                        })
                    })
                })
            })
        });
        Ok(())
    }

    fn cross_entropy(
        &self,
        s: &Stream,
        rows: Rows,
        logits: &Operand,
        targets: &Operand,
        loss: &Operand,
        lse: &Operand,
    ) -> Result<()> {
        let (la, ta, oa, sa) = (logits.clone(), targets.clone(), loss.clone(), lse.clone());
        let (cols, op) = (rows.cols, "cross_entropy");
        launch(s, op, move || {
            la.f32(op, |l| {
                ta.typed::<i64, _>(op, |t| {
                    let v = sa.f32_mut(op, false, |e| {
                        cpu::cross_entropy(l, t, cols, e).unwrap_or_else(|e| fail(op, e))
                    });
                    oa.f32_mut(op, false, |o| o[0] = v)
                })
            })
        });
        Ok(())
    }

    fn cross_entropy_backward(
        &self,
        s: &Stream,
        rows: Rows,
        logits: &Operand,
        targets: &Operand,
        lse: &Operand,
        dloss: &Operand,
        dlogits: &Operand,
    ) -> Result<()> {
        let (la, ta, ea, ga, da) = (
            logits.clone(),
            targets.clone(),
            lse.clone(),
            dloss.clone(),
            dlogits.clone(),
        );
        let (cols, op) = (rows.cols, "cross_entropy_backward");
        launch(s, op, move || {
            let dloss = ga.f32(op, |g| g[0]);
            la.f32(op, |l| {
                ta.typed::<i64, _>(op, |t| {
                    ea.f32(op, |e| {
                        da.f32_mut(op, false, |d| {
                            cpu::cross_entropy_backward(l, t, e, dloss, d, cols)
                                .unwrap_or_else(|e| fail(op, e))
                        })
                    })
                })
            })
        });
        Ok(())
    }

    fn cast(&self, s: &Stream, _n: usize, x: &Operand, out: &Operand) -> Result<()> {
        let (xa, oa) = (x.clone(), out.clone());
        // Through f32: the half → f32 and f32 → half conversions are `kernels::cpu::cast_*`.
        launch(s, "cast", move || {
            xa.f32("cast", |x| {
                oa.f32_mut("cast", false, |o| o.copy_from_slice(x))
            })
        });
        Ok(())
    }

    fn fill(&self, s: &Stream, _n: usize, value: f64, out: &Operand) -> Result<()> {
        let a = out.clone();
        launch(s, "fill", move || fill_arg("fill", &a, value));
        Ok(())
    }

    fn arange(&self, s: &Stream, _n: usize, out: &Operand) -> Result<()> {
        let a = out.clone();
        launch(s, "arange", move || {
            a.typed_mut::<i64, _>("arange", |d| {
                for (i, x) in d.iter_mut().enumerate() {
                    *x = i as i64;
                }
            })
        });
        Ok(())
    }

    fn copy(
        &self,
        s: &Stream,
        src_view: &View,
        src: &Operand,
        dst_view: &View,
        dst: &Operand,
    ) -> Result<()> {
        let (sa, da, sv, dv) = (src.clone(), dst.clone(), src_view.clone(), dst_view.clone());
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
