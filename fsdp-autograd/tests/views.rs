//! Autograd-visible views of a flat leaf (FSDP's flat parameter): gradients of the views land at
//! their offsets in one flat gradient; the flat storage can be released after forward and
//! re-attached (from a hook) before backward.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{dev, Rng};
use fsdp_alloc::DType;
use fsdp_autograd::nn::{named_parameters, Linear, Module};
use fsdp_autograd::{linear, AutogradError, InitContext, Tensor};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Two linear layers' parameters flattened: w1 [4,3], b1 [4], w2 [2,4], b2 [2], plus 3 padding.
const SHAPES: [&[usize]; 4] = [&[4, 3], &[4], &[2, 4], &[2]];

fn forward(x: &Tensor, p: &[Tensor]) -> Tensor {
    let h = linear(x, &p[0], Some(&p[1])).unwrap().gelu().unwrap();
    linear(&h, &p[2], Some(&p[3])).unwrap().mean().unwrap()
}

#[test]
fn split_views_of_a_flat_leaf_write_one_flat_gradient() {
    let d = dev();
    let mut r = Rng::new(3);
    let sizes: Vec<usize> = SHAPES.iter().map(|s| s.iter().product()).collect();
    let total: usize = sizes.iter().sum::<usize>() + 3;
    let values = r.vec(total);
    let x = Tensor::from_vec(r.vec(5 * 3), &[5, 3], &d).unwrap();

    // Reference: separate leaves.
    let mut off = 0;
    let refs: Vec<Tensor> = SHAPES
        .iter()
        .zip(&sizes)
        .map(|(s, &n)| {
            let t = Tensor::from_vec(values[off..off + n].to_vec(), s, &d)
                .unwrap()
                .requires_grad_(true)
                .unwrap();
            off += n;
            t
        })
        .collect();
    forward(&x, &refs).backward().unwrap();
    let mut expected: Vec<f32> = refs
        .iter()
        .flat_map(|t| t.grad().unwrap().to_vec::<f32>().unwrap())
        .collect();
    expected.extend([0.0; 3]); // the padding gets a zero gradient

    // Flat leaf, one split, views.
    let flat = Tensor::from_vec(values, &[total], &d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let fired = Arc::new(AtomicUsize::new(0));
    let f = fired.clone();
    flat.register_post_accumulate_grad_hook(move |_| {
        f.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let mut split_sizes = sizes.clone();
    split_sizes.push(3);
    let pieces = flat.split(&split_sizes).unwrap();
    let views: Vec<Tensor> = pieces
        .iter()
        .zip(SHAPES)
        .map(|(p, s)| p.view(s).unwrap())
        .collect();
    assert!(views.iter().all(|v| v.storage().ptr_eq(flat.storage())));
    forward(&x, &views).backward().unwrap();
    let g = flat.grad().unwrap();
    assert_eq!(g.shape(), &[total]);
    assert_eq!(bits(&g.to_vec::<f32>().unwrap()), bits(&expected));
    assert_eq!(
        fired.load(Ordering::SeqCst),
        1,
        "post-accumulate hook fires once"
    );
    // Views are not leaves: no per-view gradients are kept.
    assert!(views.iter().all(|v| v.grad().is_none()));

    // A view that receives no gradient contributes zeros (b2 unused here).
    flat.zero_grad();
    let h = linear(&x, &views[0], Some(&views[1])).unwrap();
    h.sum().unwrap().backward().unwrap();
    let g = flat.grad().unwrap().to_vec::<f32>().unwrap();
    assert!(g[sizes[0] + sizes[1]..].iter().all(|&v| v == 0.0));
    assert!(g[..sizes[0]].iter().any(|&v| v != 0.0));
}

#[test]
fn narrow_views_of_a_flat_leaf() {
    let d = dev();
    let flat = Tensor::from_vec((0..10).map(|i| i as f32).collect(), &[10], &d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let a = flat.narrow(0, 2, 3).unwrap();
    let b = flat.narrow(0, 6, 2).unwrap().view(&[2, 1]).unwrap();
    a.scale(2.0)
        .unwrap()
        .sum()
        .unwrap()
        .add(&b.mul(&b).unwrap().sum().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(
        flat.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 0.0, 2.0, 2.0, 2.0, 0.0, 12.0, 14.0, 0.0, 0.0]
    );
}

#[test]
fn flat_storage_released_after_forward_and_reattached_by_a_pre_backward_hook() {
    let d = dev();
    let mut r = Rng::new(5);
    let sizes: Vec<usize> = SHAPES.iter().map(|s| s.iter().product()).collect();
    let total: usize = sizes.iter().sum();
    let values = r.vec(total);
    let x = Tensor::from_vec(r.vec(5 * 3), &[5, 3], &d).unwrap();

    let run = |reshard: bool| -> Vec<f32> {
        let flat = Tensor::from_vec(values.clone(), &[total], &d)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let views: Vec<Tensor> = flat
            .split(&sizes)
            .unwrap()
            .iter()
            .zip(SHAPES)
            .map(|(p, s)| p.view(s).unwrap())
            .collect();
        let loss = forward(&x, &views);
        if reshard {
            // "Reshard": keep the data elsewhere (like a local shard) and free the storage.
            let saved = flat.detach().contiguous_copy().unwrap();
            let buf = flat.storage().release().unwrap();
            drop(buf);
            assert!(!views[0].storage().is_allocated());
            let err = views[0].scale(1.0).unwrap_err();
            assert!(
                matches!(err, AutogradError::StorageReleased { .. }),
                "{err:?}"
            );
            // "Unshard" in the pre-backward hook on the output.
            let storage = flat.storage().clone();
            let dev2 = d.clone();
            loss.register_hook(move |_| {
                // Like an all-gather: fill a fresh buffer, then attach it (no version bump).
                let buf = dev2.alloc(storage.nbytes(), dev2.default_stream()).unwrap();
                let staging = Tensor::from_buffer(buf, &[total], DType::F32, &dev2).unwrap();
                staging.copy_(&saved).unwrap();
                storage
                    .attach(staging.storage().release().unwrap())
                    .unwrap();
                None
            })
            .unwrap();
        }
        loss.backward().unwrap();
        flat.grad().unwrap().to_vec::<f32>().unwrap()
    };
    assert_eq!(bits(&run(false)), bits(&run(true)));
}

#[test]
fn parameters_can_be_swapped_for_views_of_a_flat_tensor() {
    // What FSDP does with a module: replace each parameter's tensor by a view of a flat leaf.
    let d = dev();
    let fc = Linear::new(&InitContext::eager(&d, 1), 3, 2, true).unwrap();
    let params = named_parameters(&fc);
    let vals: Vec<f32> = params
        .iter()
        .flat_map(|(_, p)| p.get().unwrap().to_vec::<f32>().unwrap())
        .collect();
    let flat = Tensor::from_vec(vals, &[8], &d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let pieces = flat.split(&[6, 2]).unwrap();
    for ((_, p), piece) in params.iter().zip(&pieces) {
        p.set(piece.view(p.shape()).unwrap()).unwrap();
    }
    assert!(
        params[0].1.set(pieces[1].clone()).is_err(),
        "shape is checked"
    );
    let x = Tensor::ones(&[4, 3], DType::F32, &d).unwrap();
    fc.call(&x).unwrap().sum().unwrap().backward().unwrap();
    let g = flat.grad().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(g, vec![4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]);
}

#[test]
fn views_recreated_per_forward_share_one_accumulation() {
    // FSDP re-creates the views at every forward; two forwards before one backward give two
    // split nodes feeding the same flat leaf: one summed gradient, one post-accumulate firing.
    let d = dev();
    let flat = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[6], &d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let fired = Arc::new(AtomicUsize::new(0));
    let f = fired.clone();
    flat.register_post_accumulate_grad_hook(move |_| {
        f.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let x = Tensor::from_vec(vec![1.0f32, -1.0], &[1, 2], &d).unwrap();
    let mut losses = Vec::new();
    for scale in [1.0f32, 10.0] {
        let p = flat.split(&[4, 2]).unwrap();
        let w = p[0].view(&[2, 2]).unwrap();
        losses.push(
            linear(&x, &w, Some(&p[1]))
                .unwrap()
                .sum()
                .unwrap()
                .scale(scale)
                .unwrap(),
        );
    }
    losses[0].add(&losses[1]).unwrap().backward().unwrap();
    assert_eq!(fired.load(Ordering::SeqCst), 1);
    // d/dw[o, i] = x[i] per forward, d/db = 1; times (1 + 10).
    assert_eq!(
        flat.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![11.0, -11.0, 11.0, -11.0, 11.0, 11.0]
    );
}

#[test]
fn split_shaped_folds_each_gradient_into_one_flat_gradient_including_repeated_use() {
    let d = dev();
    let flat = Tensor::from_vec((0..8).map(|i| i as f32 * 0.5).collect::<Vec<_>>(), &[8], &d)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    // [2, 3] + [1] + one unused padding element.
    let parts = flat.split_shaped(&[&[2, 3], &[1], &[1]]).unwrap();
    let (a, b) = (&parts[0], &parts[1]);
    // a used twice (two contributions to one piece), b once, the padding never.
    let loss = a
        .mul(a)
        .unwrap()
        .sum()
        .unwrap()
        .add(&a.sum().unwrap())
        .unwrap()
        .add(&b.sum().unwrap().scale(3.0).unwrap())
        .unwrap();
    loss.backward().unwrap();
    let g = flat.grad().unwrap().to_vec::<f32>().unwrap();
    let x: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
    let mut want: Vec<f32> = x.iter().map(|v| 2.0 * v + 1.0).collect();
    want.extend([3.0, 0.0]);
    assert_eq!(g, want);
    assert!(
        flat.split_shaped(&[&[2, 3]]).is_err(),
        "pieces must cover the tensor"
    );
}
