//! Tensor basics: construction and readback errors, storage release/attach, version counters,
//! views' layouts, and laws of the layout/broadcast machinery (proptest against naive
//! references).

mod common;

use common::dev;
use fsdp_alloc::{DType, Device};
use fsdp_autograd::{AutogradError, Storage, Tensor};
use proptest::prelude::*;

#[test]
fn construction_and_readback_errors() {
    let d = dev();
    assert!(matches!(
        Tensor::from_vec(vec![1.0f32; 5], &[2, 3], &d),
        Err(AutogradError::Shape { .. })
    ));
    let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2], &d).unwrap();
    assert!(matches!(
        t.to_vec::<i64>(),
        Err(AutogradError::DType { .. })
    ));
    assert!(matches!(t.item(), Err(AutogradError::Shape { .. })));
    let e = Tensor::zeros(&[0, 3], DType::F32, &d).unwrap();
    assert_eq!(e.numel(), 0);
    assert!(e.to_vec::<f32>().unwrap().is_empty());
    assert_eq!(
        Tensor::arange(4, &d).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 1, 2, 3]
    );
    let h = Tensor::full(&[3], 1.5, DType::F16, &d).unwrap();
    assert_eq!(h.to_vec_f32().unwrap(), vec![1.5; 3]);
    assert!(matches!(
        h.add(&t.narrow(0, 0, 1).unwrap()),
        Err(AutogradError::DType { .. })
    ));
    let other = Device::cpu(99);
    let u = Tensor::ones(&[2], DType::F32, &other).unwrap();
    assert!(matches!(t.add(&u), Err(AutogradError::Device { .. })));
    assert!(t.transpose(0, 1).is_err());
    assert!(t.view(&[3]).is_err());
    assert!(t.split(&[1, 2]).is_err());
    assert!(t.narrow(0, 1, 2).is_err());
    // Absurd sizes are errors, not overflows.
    let huge = [usize::MAX / 2, 4];
    assert!(matches!(
        Tensor::zeros(&huge, DType::F32, &d),
        Err(AutogradError::Shape { .. })
    ));
    assert!(Tensor::from_vec(vec![0.0f32; 2], &huge, &d).is_err());
    assert!(t.view(&huge).is_err());
    assert!(t.expand(&[usize::MAX, 2]).is_err());
    assert!(t.narrow(0, usize::MAX, 2).is_err());
    assert!(t.split(&[usize::MAX, 3]).is_err());
    assert!(Tensor::from_storage(
        t.storage().clone(),
        &[2, 2],
        &[usize::MAX, 1],
        0,
        DType::F32
    )
    .is_err());
}

#[test]
fn storage_release_and_attach_rules() {
    let d = dev();
    let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[4], &d).unwrap();
    let s: Storage = t.storage().clone();
    assert_eq!(s.nbytes(), 16);
    let v0 = t.version();
    let buf = s.release().unwrap();
    assert!(s.release().is_none());
    assert!(!s.is_allocated());
    assert_eq!(s.allocated_size(), 0);
    assert!(matches!(
        t.sum(),
        Err(AutogradError::StorageReleased { .. })
    ));
    let err = t.to_vec::<f32>().unwrap_err();
    assert!(err.to_string().contains("released"), "{err}");
    // Wrong size, wrong device.
    let small = d.alloc(8, d.default_stream()).unwrap();
    assert!(matches!(s.attach(small), Err(AutogradError::Attach { .. })));
    let other = Device::cpu(98);
    let foreign = other.alloc(16, other.default_stream()).unwrap();
    assert!(matches!(
        s.attach(foreign),
        Err(AutogradError::Attach { .. })
    ));
    s.attach(buf).unwrap();
    assert_eq!(t.version(), v0, "attach does not bump the version");
    let again = d.alloc(16, d.default_stream()).unwrap();
    assert!(matches!(s.attach(again), Err(AutogradError::Attach { .. })));
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    // from_storage checks bounds.
    assert!(Tensor::from_storage(s.clone(), &[5], &[1], 0, DType::F32).is_err());
    assert!(Tensor::from_storage(s.clone(), &[2], &[1], 3, DType::F32).is_err());
    let view = Tensor::from_storage(s, &[2], &[2], 1, DType::F32).unwrap();
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
}

#[test]
fn in_place_ops_bump_the_shared_version_counter() {
    let d = dev();
    let t = Tensor::zeros(&[2, 3], DType::F32, &d).unwrap();
    let v = t.narrow(0, 1, 1).unwrap();
    assert_eq!(t.version(), 0);
    v.fill_(2.0).unwrap();
    t.scale_(3.0).unwrap();
    t.add_(&Tensor::ones(&[3], DType::F32, &d).unwrap())
        .unwrap(); // row broadcast
    t.add_scaled_(&Tensor::ones(&[2, 3], DType::F32, &d).unwrap(), 0.5)
        .unwrap();
    assert_eq!(v.version(), 4);
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![1.5, 1.5, 1.5, 7.5, 7.5, 7.5]
    );
    // Self-aliasing in-place ops are safe.
    t.add_(&t).unwrap();
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![3.0, 3.0, 3.0, 15.0, 15.0, 15.0]
    );
    t.copy_(&t.t().unwrap().contiguous().unwrap().view(&[2, 3]).unwrap())
        .unwrap();
    assert_eq!(
        t.to_vec::<f32>().unwrap(),
        vec![3.0, 15.0, 3.0, 15.0, 3.0, 15.0]
    );
    // copy_ converts dtypes; non-contiguous destinations are refused.
    let h = Tensor::zeros(&[2, 3], DType::BF16, &d).unwrap();
    h.copy_(&t).unwrap();
    assert_eq!(h.to_vec_f32().unwrap(), t.to_vec::<f32>().unwrap());
    assert!(t.t().unwrap().fill_(0.0).is_err());
}

fn naive_index(shape: &[usize], flat: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    let mut r = flat;
    for d in (0..shape.len()).rev() {
        idx[d] = r % shape[d];
        r /= shape[d];
    }
    idx
}

fn flat_of(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn permute_contiguous_matches_naive_gather(
        shape in proptest::collection::vec(1usize..4, 1..5),
        seed in 0u64..1000,
    ) {
        let d = dev();
        let nd = shape.len();
        let mut perm: Vec<usize> = (0..nd).collect();
        let mut s = seed;
        for i in (1..nd).rev() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            perm.swap(i, (s >> 33) as usize % (i + 1));
        }
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let t = Tensor::from_vec(vals.clone(), &shape, &d).unwrap();
        let p = t.permute(&perm).unwrap();
        let got = p.contiguous().unwrap().to_vec::<f32>().unwrap();
        let pshape: Vec<usize> = perm.iter().map(|&q| shape[q]).collect();
        prop_assert_eq!(p.shape(), pshape.as_slice());
        for (f, g) in got.iter().enumerate() {
            let oi = naive_index(&pshape, f);
            let mut ii = vec![0; nd];
            for (o, &q) in perm.iter().enumerate() {
                ii[q] = oi[o];
            }
            prop_assert_eq!(*g, vals[flat_of(&shape, &ii)]);
        }
        // Readback of the strided view directly gives the same.
        prop_assert_eq!(p.to_vec::<f32>().unwrap(), got);
    }

    #[test]
    fn broadcast_add_and_its_gradient_match_naive(
        out in proptest::collection::vec(1usize..4, 1..4),
        mask_a in proptest::collection::vec(any::<bool>(), 4),
        mask_b in proptest::collection::vec(any::<bool>(), 4),
        drop_a in 0usize..2,
    ) {
        let d = dev();
        let nd = out.len();
        let sa: Vec<usize> = (0..nd).map(|i| if mask_a[i] { 1 } else { out[i] }).collect();
        let sa: Vec<usize> = sa[drop_a.min(nd - 1)..].to_vec(); // fewer leading dims
        let sb: Vec<usize> = (0..nd).map(|i| if mask_b[i] { 1 } else { out[i] }).collect();
        let na: usize = sa.iter().product();
        let nb: usize = sb.iter().product();
        let av: Vec<f32> = (0..na).map(|i| i as f32 * 0.5).collect();
        let bv: Vec<f32> = (0..nb).map(|i| 100.0 + i as f32).collect();
        let a = Tensor::from_vec(av.clone(), &sa, &d).unwrap().requires_grad_(true).unwrap();
        let b = Tensor::from_vec(bv.clone(), &sb, &d).unwrap().requires_grad_(true).unwrap();
        let c = a.add(&b).unwrap();
        let oshape = c.shape().to_vec();
        let got = c.to_vec::<f32>().unwrap();
        let lead = oshape.len() - sa.len();
        let mut count_a = vec![0.0f32; na];
        let mut count_b = vec![0.0f32; nb];
        for (f, g) in got.iter().enumerate() {
            let oi = naive_index(&oshape, f);
            let ia: Vec<usize> = (0..sa.len()).map(|j| if sa[j] == 1 { 0 } else { oi[lead + j] }).collect();
            let ib: Vec<usize> = (0..sb.len()).map(|j| if sb[j] == 1 { 0 } else { oi[j] }).collect();
            let (fa, fb) = (flat_of(&sa, &ia), flat_of(&sb, &ib));
            prop_assert_eq!(*g, av[fa] + bv[fb]);
            count_a[fa] += 1.0;
            count_b[fb] += 1.0;
        }
        c.sum().unwrap().backward().unwrap();
        prop_assert_eq!(a.grad().unwrap().to_vec::<f32>().unwrap(), count_a);
        prop_assert_eq!(b.grad().unwrap().to_vec::<f32>().unwrap(), count_b);
    }

    #[test]
    fn split_then_gradients_cover_the_input_exactly(
        sizes in proptest::collection::vec(0usize..5, 1..6),
        used in proptest::collection::vec(any::<bool>(), 6),
    ) {
        let d = dev();
        let n: usize = sizes.iter().sum();
        prop_assume!(n > 0);
        let x = Tensor::from_vec((0..n).map(|i| i as f32).collect(), &[n], &d).unwrap().requires_grad_(true).unwrap();
        let parts = x.split(&sizes).unwrap();
        let mut loss: Option<Tensor> = None;
        let mut want = vec![0.0f32; n];
        let mut off = 0;
        for (i, (p, &len)) in parts.iter().zip(&sizes).enumerate() {
            if used[i] && len > 0 {
                let term = p.scale((i + 1) as f32).unwrap().sum().unwrap();
                loss = Some(match loss { Some(l) => l.add(&term).unwrap(), None => term });
                for w in &mut want[off..off + len] {
                    *w = (i + 1) as f32;
                }
            }
            off += len;
        }
        if let Some(l) = loss {
            l.backward().unwrap();
            prop_assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), want);
        }
    }
}
