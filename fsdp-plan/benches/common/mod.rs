//! Helpers of fsdp-plan's `planner` bench (the same helpers as fsdp-core's benches use).

/// The `train_gpt` example's synthetic counting sequences.
pub fn token_batch(index: usize, batch: usize, seq: usize, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let mut ids = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for b in 0..batch {
        let k = index * batch + b;
        let start = (k * 7 + 3) % vocab;
        let stride = 1 + (k % 3);
        for t in 0..seq {
            ids.push(((start + stride * t) % vocab) as i64);
            targets.push(((start + stride * (t + 1)) % vocab) as i64);
        }
    }
    (ids, targets)
}

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
