//! Flatten + shard throughput on a GPT-2-small-sized unit list, against plain memcpy.
//!
//! Units: 12 GPT-2-small transformer blocks (d = 768), one FSDP unit each, sharding factor 8.
//! Each block has 2 layer norms (weight + bias, 768 each), the fused qkv projection
//! (768×2304 + 2304), the attention output projection (768×768 + 768) and the MLP
//! (768×3072 + 3072, 3072×768 + 768): 7,087,872 parameters, ~28 MB in f32, ~340 MB for the list,
//! far beyond any cache.
//!
//! Per repetition, side by side in the same run:
//! - `flatten`: `FlatParamLayout::flatten_into` for every unit (one `copy_from_slice` per
//!   parameter plus the zero padding) into that unit's flat buffer;
//! - `memcpy`: one `copy_from_slice` per unit of a contiguous source holding the same number of
//!   elements into the same flat buffers.
//!
//! Throughput counts bytes written (padded numel × 4) per second; both sides also read as many
//! bytes. The order of the two alternates between repetitions and the medians are reported.
//! Sharding is timed too (`flatten_shard_into` for every rank, which writes the same bytes as
//! a flatten) and checked against `shard_of` on the flat buffers. The last stdout line is
//! `{"flatten_gbps": x, "memcpy_gbps": y, "flatten_over_memcpy": x/y}`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use fsdp_flatparam::FlatParamLayout;

const D: usize = 768;
const BLOCKS: usize = 12;
const F: usize = 8;
const REPS: usize = 15;

fn block_shapes() -> Vec<Vec<usize>> {
    vec![
        vec![D],        // ln_1.weight
        vec![D],        // ln_1.bias
        vec![D, 3 * D], // attn.c_attn.weight
        vec![3 * D],    // attn.c_attn.bias
        vec![D, D],     // attn.c_proj.weight
        vec![D],        // attn.c_proj.bias
        vec![D],        // ln_2.weight
        vec![D],        // ln_2.bias
        vec![D, 4 * D], // mlp.c_fc.weight
        vec![4 * D],    // mlp.c_fc.bias
        vec![4 * D, D], // mlp.c_proj.weight
        vec![D],        // mlp.c_proj.bias
    ]
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() -> Result<(), fsdp_flatparam::LayoutError> {
    let shapes = block_shapes();
    let layouts: Vec<FlatParamLayout> = (0..BLOCKS)
        .map(|_| FlatParamLayout::new(&shapes, F))
        .collect::<Result<_, _>>()?;

    // Parameters with distinct values per block and parameter.
    let params: Vec<Vec<Vec<f32>>> = layouts
        .iter()
        .enumerate()
        .map(|(b, l)| {
            l.params()
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let base = (b * 100 + i) as f32;
                    (0..p.numel()).map(|j| base + (j % 1024) as f32).collect()
                })
                .collect()
        })
        .collect();
    let mut flats: Vec<Vec<f32>> = layouts
        .iter()
        .map(|l| vec![0.0; l.padded_numel()])
        .collect();
    let sources: Vec<Vec<f32>> = layouts
        .iter()
        .map(|l| (0..l.padded_numel()).map(|j| j as f32).collect())
        .collect();
    let mut shards: Vec<Vec<Vec<f32>>> = layouts
        .iter()
        .map(|l| (0..F).map(|_| vec![0.0; l.chunk_numel()]).collect())
        .collect();

    let total_elems: usize = layouts.iter().map(|l| l.padded_numel()).sum();
    let bytes = total_elems * std::mem::size_of::<f32>();
    let l0 = &layouts[0];
    println!(
        "units: {BLOCKS} GPT-2-small blocks, {} params each, {} elements/unit (padded {}, chunk {}), F = {F}, {:.1} MB total",
        l0.num_params(),
        l0.total_numel(),
        l0.padded_numel(),
        l0.chunk_numel(),
        bytes as f64 / 1e6
    );

    let flatten_all = |flats: &mut Vec<Vec<f32>>| -> Result<Duration, fsdp_flatparam::LayoutError> {
        let t = Instant::now();
        for ((l, p), out) in layouts.iter().zip(&params).zip(flats.iter_mut()) {
            l.flatten_into(p, out)?;
        }
        let e = t.elapsed();
        black_box(&flats);
        Ok(e)
    };
    let memcpy_all = |flats: &mut Vec<Vec<f32>>| -> Duration {
        let t = Instant::now();
        for (src, out) in sources.iter().zip(flats.iter_mut()) {
            out.copy_from_slice(black_box(src));
        }
        let e = t.elapsed();
        black_box(&flats);
        e
    };

    // Warm up: fault in every page of every buffer.
    memcpy_all(&mut flats);
    flatten_all(&mut flats)?;

    let mut t_flatten = Vec::with_capacity(REPS);
    let mut t_memcpy = Vec::with_capacity(REPS);
    for rep in 0..REPS {
        if rep % 2 == 0 {
            t_flatten.push(flatten_all(&mut flats)?);
            t_memcpy.push(memcpy_all(&mut flats));
        } else {
            t_memcpy.push(memcpy_all(&mut flats));
            t_flatten.push(flatten_all(&mut flats)?);
        }
    }

    // The flats now hold the flattened parameters (the last op may have been a memcpy).
    flatten_all(&mut flats)?;
    for ((l, p), flat) in layouts.iter().zip(&params).zip(&flats) {
        for (view, orig) in l.unflatten(flat)?.iter().zip(p) {
            assert_eq!(
                *view,
                &orig[..],
                "flatten_into produced a wrong flat parameter"
            );
        }
    }

    // Shard: build every rank's shard straight from the parameters.
    let shard_all =
        |shards: &mut Vec<Vec<Vec<f32>>>| -> Result<Duration, fsdp_flatparam::LayoutError> {
            let t = Instant::now();
            for ((l, p), per_rank) in layouts.iter().zip(&params).zip(shards.iter_mut()) {
                for (rank, out) in per_rank.iter_mut().enumerate() {
                    l.flatten_shard_into(p, rank, out)?;
                }
            }
            let e = t.elapsed();
            black_box(&shards);
            Ok(e)
        };
    shard_all(&mut shards)?;
    let t_shard: Vec<Duration> = (0..REPS / 3)
        .map(|_| shard_all(&mut shards))
        .collect::<Result<_, _>>()?;
    for ((l, flat), per_rank) in layouts.iter().zip(&flats).zip(&shards) {
        for (rank, shard) in per_rank.iter().enumerate() {
            assert_eq!(l.shard_of(flat, rank)?, &shard[..], "shard mismatch");
        }
    }
    // Zero-copy shard views of the flats (what a rank keeps after flattening).
    let t = Instant::now();
    let mut view_elems = 0;
    for (l, flat) in layouts.iter().zip(&flats) {
        for rank in 0..F {
            view_elems += black_box(l.shard_of(flat, rank)?).len();
        }
    }
    let t_views = t.elapsed();
    assert_eq!(view_elems, total_elems);

    let mf = median(t_flatten.clone());
    let mm = median(t_memcpy.clone());
    let ms = median(t_shard);
    let flatten_gbps = gbps(bytes, mf);
    let memcpy_gbps = gbps(bytes, mm);
    let shard_gbps = gbps(bytes, ms);
    println!(
        "flatten_into: median {:.2} ms over {REPS} reps (min {:.2} ms) -> {flatten_gbps:.2} GB/s",
        mf.as_secs_f64() * 1e3,
        t_flatten.iter().min().unwrap().as_secs_f64() * 1e3
    );
    println!(
        "memcpy:       median {:.2} ms over {REPS} reps (min {:.2} ms) -> {memcpy_gbps:.2} GB/s",
        mm.as_secs_f64() * 1e3,
        t_memcpy.iter().min().unwrap().as_secs_f64() * 1e3
    );
    println!(
        "flatten_shard_into (all {F} ranks of every unit): median {:.2} ms -> {shard_gbps:.2} GB/s",
        ms.as_secs_f64() * 1e3
    );
    println!(
        "shard_of (zero-copy views, all ranks of every unit): {:.3} us",
        t_views.as_secs_f64() * 1e6
    );
    println!(
        "{{\"flatten_gbps\": {flatten_gbps:.3}, \"memcpy_gbps\": {memcpy_gbps:.3}, \"flatten_over_memcpy\": {:.3}}}",
        flatten_gbps / memcpy_gbps
    );
    Ok(())
}
