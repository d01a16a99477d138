//! The GPU executor and gate: these tests need `FSDP_GPU_TESTS=1` and a CUDA GPU (`cargo xtask
//! gpu-test` runs them with `--include-ignored`).

use fsdp_alloc::{Buffer, Device, Stream};

use crate::kernels::attention::flash::FlashPath;
use crate::kernels::attention::AttentionLayout;
use crate::kernels::cuda::{CudaKernelError, CudaKernels};
use crate::kernels::gemm::Gemm;

use super::exec::{CastKind, Exec, Op, TypedOp, H, TH};

/// The kernels of `cuda:0` if GPU tests are enabled: `None` (with a printed message) when
/// `FSDP_GPU_TESTS` is not `1`; a panic when it is but no GPU or CUDA library is usable, so a
/// GPU run can never pass by skipping.
pub(super) fn gpu_or_skip(test: &str) -> Option<CudaKernels> {
    if std::env::var("FSDP_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!(
            "SKIPPED {test}: GPU test; run with FSDP_GPU_TESTS=1 on a machine with a CUDA GPU \
             (cargo xtask gpu-test)"
        );
        return None;
    }
    let dev = match Device::cuda(0) {
        Ok(d) => d,
        Err(e) => panic!("FSDP_GPU_TESTS=1 but cuda:0 is unusable: {e}"),
    };
    match CudaKernels::new(&dev) {
        Ok(k) => Some(k),
        Err(e) => panic!("FSDP_GPU_TESTS=1 but the CUDA kernels cannot be loaded: {e}"),
    }
}

/// Runs ops through the public [`CudaKernels`] API on one stream of a real GPU.
pub(super) struct GpuExec {
    pub(super) k: CudaKernels,
    pub(super) stream: Stream,
    pub(super) bufs: Vec<Buffer>,
}

impl GpuExec {
    /// An executor on the device's default stream.
    pub(super) fn new(k: CudaKernels) -> GpuExec {
        let stream = k.device().default_stream().clone();
        GpuExec {
            k,
            stream,
            bufs: Vec::new(),
        }
    }
}

impl Exec for GpuExec {
    fn alloc(&mut self, bytes: usize) -> H {
        let buf = self
            .k
            .device()
            .alloc(bytes, &self.stream)
            .unwrap_or_else(|e| panic!("allocating {bytes} bytes: {e}"));
        self.bufs.push(buf);
        self.bufs.len() - 1
    }

    fn upload(&mut self, bytes: &[u8]) -> H {
        let h = self.alloc(bytes.len());
        self.k
            .upload(&self.stream, bytes, self.bufs[h].data())
            .unwrap_or_else(|e| panic!("upload: {e}"));
        h
    }

    fn download(&mut self, h: H) -> Vec<u8> {
        let mut out = vec![0u8; self.bufs[h].len()];
        self.k
            .download(&self.stream, self.bufs[h].data(), &mut out)
            .unwrap_or_else(|e| panic!("download: {e}"));
        out
    }

    fn run(&mut self, op: &Op) -> Result<(), CudaKernelError> {
        let (k, s) = (&self.k, &self.stream);
        let b = |h: &H| self.bufs[*h].data();
        match op {
            Op::Add { a, b: bb, out } => k.add(s, b(a), b(bb), b(out)),
            Op::Mul { a, b: bb, out } => k.mul(s, b(a), b(bb), b(out)),
            Op::Scale { x, alpha, out } => k.scale(s, b(x), *alpha, b(out)),
            Op::ScaleInplace { y, alpha } => k.scale_inplace(s, b(y), *alpha),
            Op::AddScaled { y, alpha, x } => k.add_scaled(s, b(y), *alpha, b(x)),
            Op::AddRowBias { x, bias, out } => k.add_row_bias(s, b(x), b(bias), b(out)),
            Op::AddRowBiasInplace { y, bias } => k.add_row_bias_inplace(s, b(y), b(bias)),
            Op::ColSums { x, out } => k.col_sums(s, b(x), b(out)),
            Op::Typed(t) => {
                let tb = |(h, d): &TH| (self.bufs[*h].data(), *d);
                match t {
                    TypedOp::Add { a, b, out } => k.add_t(s, tb(a), tb(b), tb(out)),
                    TypedOp::Mul { a, b, out } => k.mul_t(s, tb(a), tb(b), tb(out)),
                    TypedOp::Scale { x, alpha, out } => k.scale_t(s, tb(x), *alpha, tb(out)),
                    TypedOp::ScaleInplace { y, alpha } => k.scale_inplace_t(s, tb(y), *alpha),
                    TypedOp::Sum { x, out, mean } => k.sum_t(s, tb(x), tb(out), *mean),
                    TypedOp::AddScaled { y, alpha, x } => k.add_scaled_t(s, tb(y), *alpha, tb(x)),
                    TypedOp::AddRowBias { x, bias, out } => {
                        k.add_row_bias_t(s, tb(x), tb(bias), tb(out))
                    }
                    TypedOp::AddRowBiasInplace { y, bias } => {
                        k.add_row_bias_inplace_t(s, tb(y), tb(bias))
                    }
                    TypedOp::ColSums { x, out } => k.col_sums_t(s, tb(x), tb(out)),
                    TypedOp::Gelu { kind, x, y } => k.gelu_t(s, *kind, tb(x), tb(y)),
                    TypedOp::GeluBackward { kind, x, dy, dx } => {
                        k.gelu_backward_t(s, *kind, tb(x), tb(dy), tb(dx))
                    }
                    TypedOp::LayerNorm {
                        x,
                        gamma,
                        beta,
                        y,
                        mean,
                        rstd,
                        cols,
                        eps,
                    } => k.layer_norm_t(
                        s,
                        tb(x),
                        tb(gamma),
                        tb(beta),
                        tb(y),
                        b(mean),
                        b(rstd),
                        *cols,
                        *eps,
                    ),
                    TypedOp::RmsNorm {
                        x,
                        gamma,
                        y,
                        rstd,
                        cols,
                        eps,
                    } => k.rms_norm_t(s, tb(x), tb(gamma), tb(y), b(rstd), *cols, *eps),
                    TypedOp::Dropout { x, y, cols, mask } => {
                        k.dropout_t(s, tb(x), tb(y), *cols, mask)
                    }
                    TypedOp::RmsNormBackward {
                        x,
                        gamma,
                        rstd,
                        dy,
                        dx,
                        dgamma,
                        cols,
                    } => k.rms_norm_backward_t(
                        s,
                        tb(x),
                        tb(gamma),
                        b(rstd),
                        tb(dy),
                        tb(dx),
                        tb(dgamma),
                        *cols,
                    ),
                    TypedOp::SiluMul { gate, up, y } => k.silu_mul_t(s, tb(gate), tb(up), tb(y)),
                    TypedOp::SiluMulBackward {
                        gate,
                        up,
                        dy,
                        dgate,
                        dup,
                    } => k.silu_mul_backward_t(s, tb(gate), tb(up), tb(dy), tb(dgate), tb(dup)),
                    TypedOp::Rope {
                        backward,
                        input,
                        cos,
                        sin,
                        output,
                        s: shape,
                    } => k.rope_t(s, *backward, tb(input), b(cos), b(sin), tb(output), shape),
                    TypedOp::Embedding {
                        ids,
                        table,
                        out,
                        dim,
                    } => k.embedding_t(s, b(ids), tb(table), tb(out), *dim)?.wait(),
                    TypedOp::EmbeddingBackward {
                        ids,
                        dy,
                        dtable,
                        dim,
                    } => k
                        .embedding_backward_t(s, b(ids), tb(dy), tb(dtable), *dim)?
                        .wait(),
                    TypedOp::CrossEntropy {
                        logits,
                        targets,
                        cols,
                        lse,
                        loss,
                    } => k
                        .cross_entropy_t(s, tb(logits), b(targets), *cols, b(lse), tb(loss))?
                        .wait(),
                    TypedOp::CrossEntropyBackward {
                        logits,
                        targets,
                        lse,
                        dloss,
                        dlogits,
                        cols,
                    } => k
                        .cross_entropy_backward_t(
                            s,
                            tb(logits),
                            b(targets),
                            b(lse),
                            tb(dloss),
                            tb(dlogits),
                            *cols,
                        )?
                        .wait(),
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
                    } => k.layer_norm_backward_t(
                        s,
                        tb(x),
                        tb(gamma),
                        b(mean),
                        b(rstd),
                        tb(dy),
                        tb(dx),
                        tb(dgamma),
                        tb(dbeta),
                        *cols,
                    ),
                }
            }
            Op::Sum { x, out } => k.sum(s, b(x), b(out)),
            Op::Mean { x, out } => k.mean(s, b(x), b(out)),
            Op::Gelu { kind, x, y } => k.gelu(s, *kind, b(x), b(y)),
            Op::GeluBackward { kind, x, dy, dx } => k.gelu_backward(s, *kind, b(x), b(dy), b(dx)),
            Op::Softmax { x, y, cols } => k.softmax_rows(s, b(x), b(y), *cols),
            Op::SoftmaxBackward { y, dy, dx, cols } => {
                k.softmax_rows_backward(s, b(y), b(dy), b(dx), *cols)
            }
            Op::LayerNorm {
                x,
                gamma,
                beta,
                y,
                mean,
                rstd,
                cols,
                eps,
            } => k.layer_norm(
                s,
                b(x),
                b(gamma),
                b(beta),
                b(y),
                b(mean),
                b(rstd),
                *cols,
                *eps,
            ),
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
            } => k.layer_norm_backward(
                s,
                b(x),
                b(gamma),
                b(mean),
                b(rstd),
                b(dy),
                b(dx),
                b(dgamma),
                b(dbeta),
                *cols,
            ),
            Op::Embedding {
                ids,
                table,
                out,
                dim,
            } => k.embedding(s, b(ids), b(table), b(out), *dim)?.wait(),
            Op::EmbeddingBackward {
                ids,
                dy,
                dtable,
                dim,
            } => k
                .embedding_backward(s, b(ids), b(dy), b(dtable), *dim)?
                .wait(),
            Op::CrossEntropy {
                logits,
                targets,
                cols,
                lse,
                loss,
            } => k
                .cross_entropy(s, b(logits), b(targets), *cols, b(lse), b(loss))?
                .wait(),
            Op::CrossEntropyBackward {
                logits,
                targets,
                lse,
                dloss,
                dlogits,
                cols,
            } => k
                .cross_entropy_backward(
                    s,
                    b(logits),
                    b(targets),
                    b(lse),
                    b(dloss),
                    b(dlogits),
                    *cols,
                )?
                .wait(),
            Op::Attention {
                q,
                k: kk,
                v,
                out,
                probs,
                a,
            } => k.causal_attention(s, b(q), b(kk), b(v), b(out), b(probs), a),
            Op::AttentionBackward {
                q,
                k: kk,
                v,
                probs,
                dout,
                dq,
                dk,
                dv,
                a,
            } => k.causal_attention_backward(
                s,
                b(q),
                b(kk),
                b(v),
                b(probs),
                b(dout),
                b(dq),
                b(dk),
                b(dv),
                a,
            ),
            Op::Bmm {
                a,
                b: bb,
                c,
                batch,
                m,
                k: kk,
                n,
                ta,
                tb,
                acc,
            } => {
                let g = Gemm::new(*batch, *m, *kk, *n)
                    .transposed(*ta, *tb)
                    .accumulating(*acc);
                k.gemm(s, &g, b(a), b(bb), b(c))
            }
            Op::GemmEx { a, b: bb, c, g, p } => k.gemm_ex(s, g, *p, b(a), b(bb), b(c)),
            Op::Flash {
                dtype,
                q,
                k: kk,
                v,
                out,
                lse,
                a,
            } => {
                // The CUDA-core kernels (the tensor-core forward is Op::FlashMma).
                let qkv = [q, kk, v, out, lse].map(&b);
                k.flash_forward_on(s, *dtype, qkv, a, FlashPath::CudaCores)
            }
            Op::FlashMma {
                dtype,
                q,
                k: kk,
                v,
                out,
                lse,
                a,
            } => {
                let qkv = [q, kk, v, out, lse].map(&b);
                k.flash_forward_on(s, *dtype, qkv, a, FlashPath::TensorCores)
            }
            Op::FlashBackward {
                dtype,
                q,
                k: kk,
                v,
                out,
                lse,
                dout,
                dq,
                dk,
                dv,
                a,
            } => match a.layout {
                AttentionLayout::Packed => k.flash_attention_packed_backward(
                    s,
                    *dtype,
                    b(q),
                    b(out),
                    b(lse),
                    b(dout),
                    b(dq),
                    a,
                ),
                AttentionLayout::Heads => k.flash_attention_backward(
                    s,
                    *dtype,
                    b(q),
                    b(kk),
                    b(v),
                    b(out),
                    b(lse),
                    b(dout),
                    b(dq),
                    b(dk),
                    b(dv),
                    a,
                ),
            },
            Op::Cast { kind, src, dst } => match kind {
                CastKind::F32ToF16 => k.cast_f32_to_f16(s, b(src), b(dst)),
                CastKind::F16ToF32 => k.cast_f16_to_f32(s, b(src), b(dst)),
                CastKind::F32ToBf16 => k.cast_f32_to_bf16(s, b(src), b(dst)),
                CastKind::Bf16ToF32 => k.cast_bf16_to_f32(s, b(src), b(dst)),
            },
            Op::StridedCopy {
                src,
                offset,
                shape,
                strides,
                dst,
                dtype,
            } => k.strided_copy(s, b(src), *offset, shape, strides, b(dst), *dtype),
            Op::StridedAdd {
                dst,
                offset,
                shape,
                strides,
                src,
            } => k.strided_add_assign(s, b(dst), *offset, shape, strides, b(src)),
            Op::Zero { buf } => k.zero(s, b(buf)),
            Op::Copy { src, dst } => k.copy(s, b(src), b(dst)),
            Op::SgdStep {
                rule,
                first,
                p,
                g,
                buf,
            } => k.sgd_step(s, rule, *first, b(p), b(g), buf.as_ref().map(b)),
            Op::AdamWStep { c, p, g, m, v } => k.adamw_step(s, c, b(p), b(g), b(m), b(v)),
            Op::LambDirection { c, p, g, m, v, u } => {
                k.lamb_direction(s, c, b(p), b(g), b(m), b(v), b(u))
            }
            Op::LambApply {
                lr,
                w_sq,
                u_sq,
                sums,
                u,
                p,
            } => k.lamb_apply(s, *lr, *w_sq, *u_sq, b(sums), b(u), b(p)),
            Op::SumSquares { xs, pieces, out } => {
                let xs: Vec<_> = xs.iter().map(|h| b(h).clone()).collect();
                k.sum_squares(s, &xs, pieces, b(out))
            }
            Op::Unscale { inv, g, flag } => k.unscale(s, *inv, b(g), b(flag)),
        }
    }
}
