//! The table a person reads: candidates the model cannot tell apart merged into one row that
//! names the settings that do not matter, and the resource that bounds the top plan.

use crate::candidate::PlanConfig;
use crate::search::{PlanEstimate, Planner};
use fsdp_core::config::BackwardPrefetch;

/// What limits a plan's step time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The compute stream is busy for most of the step.
    Compute,
    /// A process group inside one node (NVLink) is the busiest resource.
    IntraNodeLink,
    /// A process group that spans nodes (the network) is the busiest resource.
    InterNodeLink,
    /// A faster configuration exists but does not fit in device memory.
    Memory,
}

impl Bound {
    /// A short name: `compute`, `intra-node link`, `inter-node link`, `memory`.
    pub fn name(self) -> &'static str {
        match self {
            Bound::Compute => "compute",
            Bound::IntraNodeLink => "intra-node link",
            Bound::InterNodeLink => "inter-node link",
            Bound::Memory => "memory",
        }
    }
}

/// One row of the merged table: candidates with the same strategy and shard size whose printed
/// figures are all equal.
#[derive(Debug, Clone, PartialEq)]
pub struct MergedRow {
    /// The first (best-ranked) member's prediction; every member prints the same figures.
    pub estimate: PlanEstimate,
    /// Every member's configuration, in rank order.
    pub members: Vec<PlanConfig>,
    /// The row's label: the strategy and shard size, then each of backward prefetch, forward
    /// prefetch and limiter as one value, `a|b` or `any` (every value) when the members differ
    /// only there; a member list when they are not such a product.
    pub label: String,
}

const BWD: [BackwardPrefetch; 3] = [
    BackwardPrefetch::BackwardPre,
    BackwardPrefetch::BackwardPost,
    BackwardPrefetch::None,
];

fn bwd_name(b: BackwardPrefetch) -> &'static str {
    match b {
        BackwardPrefetch::None => "none",
        BackwardPrefetch::BackwardPre => "pre",
        BackwardPrefetch::BackwardPost => "post",
    }
}

fn on(x: bool) -> &'static str {
    if x {
        "on"
    } else {
        "off"
    }
}

/// The figures a row prints (everything but its label and rank).
fn figures(p: &PlanEstimate) -> String {
    let e = &p.estimate;
    format!(
        "{:>10.2} {:>10.2} {:>10.2} {:>11.2} {:>12.2} {:>4}",
        e.step_s * 1e3,
        e.compute_s * 1e3,
        e.comm_s * 1e3,
        e.peak_bytes as f64 / 1048576.0,
        e.cross_node_bytes / 1048576.0,
        if p.fits { "yes" } else { "no" }
    )
}

fn strategy_prefix(c: &PlanConfig) -> String {
    let label = c.label();
    // `full-shard F=4 bwd=...`: the strategy and F are the first two words.
    label.split(' ').take(2).collect::<Vec<_>>().join(" ")
}

fn values<T: PartialEq + Copy>(members: &[PlanConfig], f: impl Fn(&PlanConfig) -> T) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for m in members {
        let v = f(m);
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

fn label(members: &[PlanConfig]) -> String {
    let head = strategy_prefix(&members[0]);
    if members.len() == 1 {
        return members[0].label();
    }
    let bwd = values(members, |c| c.backward_prefetch);
    let fwd = values(members, |c| c.forward_prefetch);
    let lim = values(members, |c| c.limit_all_gathers);
    if bwd.len() * fwd.len() * lim.len() == members.len() {
        let b = if bwd.len() == BWD.len() {
            "any".to_string()
        } else {
            bwd.iter()
                .map(|&b| bwd_name(b))
                .collect::<Vec<_>>()
                .join("|")
        };
        let two = |v: &[bool]| {
            if v.len() == 2 {
                "any".to_string()
            } else {
                on(v[0]).to_string()
            }
        };
        format!("{head} bwd={b} fwd={} lim={}", two(&fwd), two(&lim))
    } else {
        let list: Vec<String> = members
            .iter()
            .map(|c| {
                format!(
                    "{}/{}/{}",
                    bwd_name(c.backward_prefetch),
                    on(c.forward_prefetch),
                    on(c.limit_all_gathers)
                )
            })
            .collect();
        format!("{head} bwd/fwd/lim={}", list.join(","))
    }
}

/// Merges `plans` (in rank order) into rows: candidates with the same strategy and shard size
/// whose printed figures (step, compute, communication, peak, cross-node bytes, fits) are all
/// equal become one row, placed where its best member ranks.
pub fn merge_rows(plans: &[PlanEstimate]) -> Vec<MergedRow> {
    let mut keys: Vec<(String, String)> = Vec::new();
    let mut rows: Vec<(PlanEstimate, Vec<PlanConfig>)> = Vec::new();
    for p in plans {
        let key = (strategy_prefix(&p.config), figures(p));
        match keys.iter().position(|k| *k == key) {
            Some(i) => rows[i].1.push(p.config),
            None => {
                keys.push(key);
                rows.push((*p, vec![p.config]));
            }
        }
    }
    rows.into_iter()
        .map(|(estimate, members)| MergedRow {
            label: label(&members),
            estimate,
            members,
        })
        .collect()
}

impl Planner {
    /// The merged table of `plans` ([`merge_rows`]): rank, plan (settings that do not matter
    /// shown as `any` or `a|b`), how many candidates the row stands for, step time, compute,
    /// communication busy time, peak memory, cross-node bytes, fits.
    pub fn merged_table(plans: &[PlanEstimate]) -> String {
        let rows = merge_rows(plans);
        let width = rows
            .iter()
            .map(|r| r.label.chars().count())
            .max()
            .unwrap_or(4)
            .max(44);
        let mut s = format!(
            "{:>4}  {:<width$} {:>5} {:>10} {:>10} {:>10} {:>11} {:>12} {:>4}\n",
            "rank",
            "plan",
            "alike",
            "step ms",
            "compute",
            "comm busy",
            "peak MiB",
            "x-node MiB",
            "fits"
        );
        for (i, r) in rows.iter().enumerate() {
            s.push_str(&format!(
                "{:>4}  {:<width$} {:>5} {}\n",
                i + 1,
                r.label,
                r.members.len(),
                figures(&r.estimate)
            ));
        }
        s
    }

    /// What bounds `top` among `all` (every candidate's prediction): [`Bound::Memory`] when a
    /// candidate predicted faster does not fit; otherwise the busiest of the compute stream,
    /// the groups inside a node and the groups across nodes. With a one-line explanation
    /// (busy times as percentages of the step).
    pub fn bound(&self, top: &PlanEstimate, all: &[PlanEstimate]) -> (Bound, String) {
        let e = &top.estimate;
        let pct = |x: f64| 100.0 * x / e.step_s.max(f64::MIN_POSITIVE);
        let busy = format!(
            "compute {:.0}%, intra-node links {:.0}%, inter-node links {:.0}% of the step; \
             peak {:.1} GiB of {:.1} GiB with {:.0}% allocator headroom",
            pct(e.compute_s),
            pct(e.intra_busy_s),
            pct(e.inter_busy_s),
            e.peak_bytes as f64 * (1.0 + self.allocator_headroom) / (1u64 << 30) as f64,
            self.cluster.device_memory_bytes as f64 / (1u64 << 30) as f64,
            self.allocator_headroom * 100.0
        );
        let faster = all
            .iter()
            .filter(|p| !p.fits && p.estimate.step_s < e.step_s * (1.0 - 1e-9))
            .min_by(|a, b| a.estimate.step_s.total_cmp(&b.estimate.step_s));
        if let Some(f) = faster {
            return (
                Bound::Memory,
                format!(
                    "{} would take {:.2} ms but needs {:.1} GiB; {busy}",
                    f.config.label(),
                    f.estimate.step_s * 1e3,
                    f.estimate.peak_bytes as f64 * (1.0 + self.allocator_headroom)
                        / (1u64 << 30) as f64
                ),
            );
        }
        let b = if e.compute_s >= e.intra_busy_s.max(e.inter_busy_s) {
            Bound::Compute
        } else if e.inter_busy_s >= e.intra_busy_s {
            Bound::InterNodeLink
        } else {
            Bound::IntraNodeLink
        };
        (b, busy)
    }
}
