//! Prints the layout of the paper's Figure 3: one 4×3 `nn.Linear` (in 4, out 3: weight `[3, 4]`,
//! bias `[3]`, 15 elements) fully sharded across 16 ranks. Every rank holds one element of the
//! flat parameter; the last rank holds the padding.
//!
//! Run with `cargo run -p fsdp-flatparam --example layout`.

use fsdp_flatparam::{FlatParamLayout, LayoutError};

fn main() -> Result<(), LayoutError> {
    let names = ["weight", "bias"];
    let layout = FlatParamLayout::new(&[vec![3, 4], vec![3]], 16)?;

    println!(
        "FlatParameter of a 4x3 nn.Linear on {} ranks",
        layout.sharding_factor()
    );
    for (name, p) in names.iter().zip(layout.params()) {
        println!(
            "  {name:<6} shape {:?}: numel {:>2}, flat {:?}",
            p.shape(),
            p.numel(),
            p.flat_range()
        );
    }
    println!(
        "  total numel {}, padded numel {} (padding {}), chunk numel {}",
        layout.total_numel(),
        layout.padded_numel(),
        layout.padding_numel(),
        layout.chunk_numel()
    );

    println!("\nper rank:");
    for rank in 0..layout.sharding_factor() {
        let shard = layout.shard(rank)?;
        let mut parts: Vec<String> = shard
            .pieces()
            .iter()
            .map(|pc| {
                format!(
                    "{}[{:?}] at shard {:?}",
                    names[pc.param_index],
                    pc.param_range(),
                    pc.shard_range()
                )
            })
            .collect();
        if shard.padding_numel() > 0 {
            parts.push(format!(
                "padding x{} at shard {:?}",
                shard.padding_numel(),
                shard.padding_range_in_shard()
            ));
        }
        println!(
            "  rank {rank:>2}: flat {:?} -> {}",
            shard.flat_range(),
            parts.join(", ")
        );
    }

    println!("\nper parameter (which ranks hold which elements):");
    for (i, name) in names.iter().enumerate() {
        let pieces = layout.param_pieces(i)?;
        let spans: Vec<String> = pieces
            .iter()
            .map(|pc| format!("r{}:{:?}", pc.rank, pc.param_range()))
            .collect();
        println!(
            "  {name:<6} on ranks {:?}: {}",
            layout.param_ranks(i)?,
            spans.join(" ")
        );
    }

    // Data: flatten, show each rank's shard.
    let weight: Vec<f32> = (1..=12).map(|x| x as f32).collect();
    let bias = [13.0f32, 14.0, 15.0];
    let flat = layout.flatten(&[&weight[..], &bias[..]])?;
    let shards: Vec<String> = (0..layout.sharding_factor())
        .map(|r| layout.shard_of(&flat, r).map(|s| format!("{s:?}")))
        .collect::<Result<_, _>>()?;
    println!("\nshards of flatten(weight = 1..=12, bias = 13..=15):");
    println!("  {}", shards.join(" "));
    Ok(())
}
