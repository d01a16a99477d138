//! The one place where the tensor layer calls `kernels::cpu` (so that the kernels' exact
//! signatures are adapted here only). Every function here runs inside stream work.

use crate::kernels::cpu;
use crate::kernels::KernelError;

pub(crate) type KResult<T = ()> = Result<T, KernelError>;

#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
    acc: bool,
) -> KResult {
    cpu::matmul(a, b, c, m, k, n, ta, tb, acc)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn bmm(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
    acc: bool,
) -> KResult {
    cpu::bmm(a, b, c, batch, m, k, n, ta, tb, acc)
}

pub(crate) fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> KResult {
    cpu::add(a, b, out)
}

pub(crate) fn mul(a: &[f32], b: &[f32], out: &mut [f32]) -> KResult {
    cpu::mul(a, b, out)
}

pub(crate) fn scale(x: &[f32], s: f32, out: &mut [f32]) -> KResult {
    cpu::scale(x, s, out)
}

/// `y += alpha · x`.
pub(crate) fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) -> KResult {
    cpu::add_scaled(y, alpha, x)
}

/// `out[r, :] = x[r, :] + bias` for every row.
pub(crate) fn add_bias(x: &[f32], bias: &[f32], out: &mut [f32]) -> KResult {
    cpu::add_row_bias(x, bias, out)
}

/// `out[c] = Σ_r x[r, c]` (overwrites `out`, `cols = out.len()`).
pub(crate) fn col_sums(x: &[f32], out: &mut [f32]) -> KResult {
    cpu::col_sums(x, out)
}

pub(crate) fn sum(x: &[f32]) -> f32 {
    cpu::sum(x)
}

pub(crate) fn gelu(x: &[f32], y: &mut [f32]) -> KResult {
    cpu::gelu(x, y)
}

pub(crate) fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> KResult {
    cpu::gelu_backward(x, dy, dx)
}

pub(crate) fn softmax_rows(x: &[f32], y: &mut [f32], cols: usize) -> KResult {
    cpu::softmax_rows(x, y, cols)
}

pub(crate) fn softmax_rows_backward(y: &[f32], dy: &[f32], dx: &mut [f32], cols: usize) -> KResult {
    cpu::softmax_rows_backward(y, dy, dx, cols)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    cols: usize,
    eps: f32,
) -> KResult {
    cpu::layer_norm(x, gamma, beta, y, mean, rstd, cols, eps)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    cols: usize,
) -> KResult {
    cpu::layer_norm_backward(x, gamma, mean, rstd, dy, dx, dgamma, dbeta, cols)
}

pub(crate) fn embedding(ids: &[i64], table: &[f32], out: &mut [f32], dim: usize) -> KResult {
    cpu::embedding(ids, table, out, dim)
}

/// Overwrites `dtable` with the gradient of the table.
pub(crate) fn embedding_backward(
    ids: &[i64],
    dy: &[f32],
    dtable: &mut [f32],
    dim: usize,
) -> KResult {
    cpu::embedding_backward(ids, dy, dtable, dim)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    probs: &mut [f32],
    b: usize,
    h: usize,
    t: usize,
    d: usize,
) -> KResult {
    cpu::causal_attention(q, k, v, out, probs, b, h, t, d)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    dout: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    b: usize,
    h: usize,
    t: usize,
    d: usize,
) -> KResult {
    cpu::causal_attention_backward(q, k, v, probs, dout, dq, dk, dv, b, h, t, d)
}

pub(crate) fn cross_entropy(
    logits: &[f32],
    targets: &[i64],
    cols: usize,
    lse: &mut [f32],
) -> KResult<f32> {
    cpu::cross_entropy(logits, targets, cols, lse)
}

pub(crate) fn cross_entropy_backward(
    logits: &[f32],
    targets: &[i64],
    lse: &[f32],
    dloss: f32,
    dlogits: &mut [f32],
    cols: usize,
) -> KResult {
    cpu::cross_entropy_backward(logits, targets, lse, dloss, dlogits, cols)
}
