//! Two CPU streams, an event between them, and the device's memory statistics.
//!
//! `cargo run --release -p fsdp-alloc --example streams`

use fsdp_alloc::{Device, Result};

fn main() -> Result<()> {
    let dev = Device::cpu(0);
    let compute = dev.default_stream().clone();
    let comm = dev.new_stream("comm");

    let n = 1 << 20;
    let src = dev.alloc(n * 4, &comm)?;
    let dst = dev.alloc(n * 4, &compute)?;
    let (s, d) = (src.data().clone(), dst.data().clone());
    comm.launch(move || {
        for (i, x) in s.write::<f32>().expect("src").iter_mut().enumerate() {
            *x = i as f32;
        }
    });
    let ready = comm.record_event();
    compute.wait_event(&ready);
    let s = src.data().clone();
    compute.launch(move || {
        let src = s.read::<f32>().expect("src");
        let mut dst = d.write::<f32>().expect("dst");
        for (o, i) in dst.iter_mut().zip(src.iter()) {
            *o = 2.0 * i;
        }
    });
    dev.synchronize()?;
    let last = dst.data().read::<f32>()?[n - 1];
    println!(
        "dst[{}] = {last} (expected {})",
        n - 1,
        2.0 * (n - 1) as f32
    );
    println!("{:?}", dev.memory_stats());
    drop((src, dst));
    println!(
        "after free: allocated {} bytes",
        dev.memory_stats().allocated_bytes
    );
    Ok(())
}
