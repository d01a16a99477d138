//! Engine semantics: accumulation, several forwards, unused leaves, version counters, graph
//! reuse, grad mode, and the three hook points with their firing order.

mod common;

use std::sync::{Arc, Mutex};

use common::{dev, gradcheck};
use fsdp_alloc::DType;
use fsdp_autograd::{
    backward, custom_op, no_grad, queue_callback, queue_callback_fallible, AutogradError, Tensor,
};

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &dev()).unwrap()
}

fn leaf(v: &[f32], shape: &[usize]) -> Tensor {
    t(v, shape).requires_grad_(true).unwrap()
}

fn grad(x: &Tensor) -> Vec<f32> {
    x.grad().expect("has a gradient").to_vec::<f32>().unwrap()
}

type Log = Arc<Mutex<Vec<String>>>;

fn log() -> Log {
    Arc::new(Mutex::new(Vec::new()))
}

fn push(l: &Log, s: impl Into<String>) {
    l.lock().unwrap().push(s.into());
}

fn entries(l: &Log) -> Vec<String> {
    l.lock().unwrap().clone()
}

#[test]
#[should_panic(expected = "analytic")]
fn gradcheck_detects_a_wrong_backward() {
    gradcheck(
        "deliberately wrong",
        &[(vec![0.5, -1.0, 2.0], vec![3])],
        |x| {
            let y = no_grad(|| x[0].scale(2.0))?;
            let mut y = custom_op("wrong", &[&x[0]], vec![y], |g| {
                Ok(vec![Some(g[0].as_ref().unwrap().scale(3.0)?)]) // should be 2
            })?;
            Ok(y.pop().unwrap())
        },
    );
}

#[test]
fn grads_accumulate_across_backward_calls_until_zeroed() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let x = t(&[3.0, -1.0], &[2]);
    for _ in 0..2 {
        w.mul(&x).unwrap().sum().unwrap().backward().unwrap();
    }
    assert_eq!(grad(&w), vec![6.0, -2.0]);
    w.zero_grad();
    assert!(w.grad().is_none());
    w.mul(&x).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(grad(&w), vec![3.0, -1.0]);
}

#[test]
fn several_forwards_then_one_backward_and_multiple_roots() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let l1 = w.mul(&w).unwrap().sum().unwrap(); // d/dw = 2w
    let l2 = w.scale(3.0).unwrap().sum().unwrap(); // d/dw = 3
    l1.add(&l2).unwrap().backward().unwrap();
    assert_eq!(grad(&w), vec![5.0, 7.0]);
    w.zero_grad();
    let l1 = w.mul(&w).unwrap().sum().unwrap();
    let l2 = w.scale(3.0).unwrap().sum().unwrap();
    backward(&[l1, l2], &[None, None]).unwrap();
    assert_eq!(grad(&w), vec![5.0, 7.0]);
}

#[test]
fn unused_leaves_are_untouched() {
    let used = leaf(&[1.0], &[1]);
    let unused = leaf(&[1.0], &[1]);
    let pre = leaf(&[1.0], &[1]);
    pre.set_grad(Some(t(&[42.0], &[1]))).unwrap();
    let _dangling = unused.scale(2.0).unwrap(); // in a graph that is never backpropagated
    used.scale(2.0).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(grad(&used), vec![2.0]);
    assert!(unused.grad().is_none());
    assert_eq!(grad(&pre), vec![42.0]);
}

#[test]
fn modifying_a_saved_tensor_in_place_is_a_clear_error() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let x = t(&[3.0, 4.0], &[2]); // does not require grad: in-place is allowed
    let y = w.mul(&x).unwrap().sum().unwrap(); // mul saves x (for dw)
    assert_eq!(x.version(), 0);
    x.scale_(2.0).unwrap();
    assert_eq!(x.version(), 1);
    let err = y.backward().unwrap_err();
    assert!(
        matches!(
            err,
            AutogradError::SavedTensorModified {
                op: "mul",
                saved: 0,
                current: 1
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("modified by an in-place operation"), "{msg}");
    // A view shares the version counter with its base.
    let v = x.narrow(0, 0, 1).unwrap();
    let z = w.narrow(0, 0, 1).unwrap().mul(&v).unwrap().sum().unwrap();
    x.fill_(0.0).unwrap();
    assert!(matches!(
        z.backward(),
        Err(AutogradError::SavedTensorModified { .. })
    ));
}

#[test]
fn in_place_on_a_tensor_requiring_grad_needs_no_grad() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let err = w.add_(&t(&[1.0, 1.0], &[2])).unwrap_err();
    assert!(
        matches!(err, AutogradError::InPlaceOnGradTensor { op: "add_" }),
        "{err:?}"
    );
    assert_eq!(w.version(), 0);
    no_grad(|| w.add_(&t(&[1.0, 1.0], &[2]))).unwrap();
    assert_eq!(w.version(), 1);
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
}

#[test]
fn backward_through_saved_tensors_twice_is_an_error() {
    let w = leaf(&[3.0], &[1]);
    let y = w.mul(&w).unwrap().sum().unwrap(); // mul saves its inputs; the first backward frees them
    y.backward().unwrap();
    let err = y.backward().unwrap_err();
    assert!(
        matches!(err, AutogradError::GraphConsumed { op: "mul" }),
        "{err:?}"
    );
    assert!(err.to_string().contains("second time"));
    // Nodes that saved nothing (views, scale, sum) may run again, as in PyTorch.
    let z = w.scale(2.0).unwrap().sum().unwrap();
    w.zero_grad();
    z.backward().unwrap();
    z.backward().unwrap();
    assert_eq!(grad(&w), vec![4.0]);
}

#[test]
fn grad_mode_and_bad_roots() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let y = no_grad(|| w.scale(2.0)).unwrap();
    assert!(!y.requires_grad() && y.is_leaf());
    assert!(matches!(
        y.sum().unwrap().backward(),
        Err(AutogradError::Backward(_))
    ));
    let z = w.scale(2.0).unwrap();
    assert!(matches!(z.backward(), Err(AutogradError::Backward(_)))); // non-scalar, no seed
    z.backward_with_grad(&t(&[1.0, 10.0], &[2])).unwrap();
    assert_eq!(grad(&w), vec![2.0, 20.0]);
    assert!(t(&[1.0], &[1]).register_hook(|_| None).is_err());
    assert!(z.register_post_accumulate_grad_hook(|_| {}).is_err()); // not a leaf
    let ids = Tensor::from_vec(vec![1i64], &[1], &dev()).unwrap();
    assert!(ids.set_requires_grad(true).is_err());
}

#[test]
fn tensor_hooks_see_summed_gradients_and_can_replace_them() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let h = w.scale(2.0).unwrap();
    let seen = log();
    let s = seen.clone();
    h.register_hook(move |g| {
        push(&s, format!("{:?}", g.to_vec::<f32>().unwrap()));
        Some(g.scale(10.0).unwrap())
    })
    .unwrap();
    // h is used twice: its hook runs once, on the sum.
    h.add(&h).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(entries(&seen), vec!["[2.0, 2.0]"]);
    assert_eq!(grad(&w), vec![40.0, 40.0]); // 2 (sum) · 10 (hook) · 2 (scale)
}

#[test]
fn hook_firing_order_is_pinned() {
    // loss = sum(((x · w1) · w2)), with hooks everywhere; w1 is also used a second time.
    let x = t(&[1.0, 2.0], &[1, 2]);
    let w1 = leaf(&[1.0, 0.0, 0.0, 1.0], &[2, 2]);
    let w2 = leaf(&[1.0, 1.0], &[2, 1]);
    let l = log();
    for (name, w) in [("w1", &w1), ("w2", &w2)] {
        let (l1, l2) = (l.clone(), l.clone());
        let n1 = name.to_string();
        w.register_hook(move |g| {
            push(
                &l1,
                format!("tensor-hook {n1} (grad is final: {})", g.numel() > 0),
            );
            None
        })
        .unwrap();
        let n2 = name.to_string();
        w.register_post_accumulate_grad_hook(move |leaf| {
            push(
                &l2,
                format!(
                    "post-accumulate {n2} grad={:?}",
                    leaf.grad().unwrap().to_vec::<f32>().unwrap()
                ),
            );
            let l3 = l2.clone();
            let n3 = n2.clone();
            queue_callback(move || push(&l3, format!("callback from {n3}"))).unwrap();
        })
        .unwrap();
    }
    let h = x.matmul(&w1).unwrap(); // [1, 2]
    let lh = l.clone();
    h.register_hook(move |_| {
        push(&lh, "tensor-hook h");
        None
    })
    .unwrap();
    let lh2 = l.clone();
    h.register_hook(move |_| {
        push(&lh2, "tensor-hook h (second)");
        None
    })
    .unwrap();
    let y = h.matmul(&w2).unwrap().sum().unwrap();
    let extra = w1.sum().unwrap(); // second use of w1
    let loss = y.add(&extra).unwrap();
    loss.backward().unwrap();
    let want = vec![
        "tensor-hook w2 (grad is final: true)",
        "post-accumulate w2 grad=[1.0, 2.0]",
        "tensor-hook h",
        "tensor-hook h (second)",
        "tensor-hook w1 (grad is final: true)",
        "post-accumulate w1 grad=[2.0, 2.0, 3.0, 3.0]",
        "callback from w2",
        "callback from w1",
    ];
    assert_eq!(entries(&l), want);
    // Deterministic: the same forward/backward gives the same sequence again.
    l.lock().unwrap().clear();
    w1.zero_grad();
    w2.zero_grad();
    let h = x.matmul(&w1).unwrap();
    let (lh, lh2) = (l.clone(), l.clone());
    h.register_hook(move |_| {
        push(&lh, "tensor-hook h");
        None
    })
    .unwrap();
    h.register_hook(move |_| {
        push(&lh2, "tensor-hook h (second)");
        None
    })
    .unwrap();
    let loss = h
        .matmul(&w2)
        .unwrap()
        .sum()
        .unwrap()
        .add(&w1.sum().unwrap())
        .unwrap();
    loss.backward().unwrap();
    assert_eq!(entries(&l), want);
}

#[test]
fn leaf_tensor_hooks_run_before_accumulation_post_hooks_after() {
    let w = leaf(&[1.0], &[1]);
    w.set_grad(Some(t(&[100.0], &[1]))).unwrap();
    let l = log();
    let l1 = l.clone();
    let wc = w.clone();
    // Hooks hold a clone of the leaf here only to read `.grad()`; fine for a test.
    w.register_hook(move |g| {
        push(
            &l1,
            format!(
                "pre: incoming {} stored {}",
                g.item().unwrap(),
                wc.grad().unwrap().item().unwrap()
            ),
        );
        None
    })
    .unwrap();
    let l2 = l.clone();
    w.register_post_accumulate_grad_hook(move |leaf| {
        push(
            &l2,
            format!("post: stored {}", leaf.grad().unwrap().item().unwrap()),
        );
    })
    .unwrap();
    w.scale(3.0).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(
        entries(&l),
        vec!["pre: incoming 3 stored 100", "post: stored 103"]
    );
}

#[test]
fn post_accumulate_hooks_fire_in_reverse_order_of_use_once_per_backward() {
    // A chain of 4 "layers": post-accumulate hooks (FSDP's reduce-scatter points) fire from
    // the last layer to the first, each exactly once per backward.
    let ws: Vec<Tensor> = (0..4)
        .map(|_| leaf(&[0.5, 0.25, -0.5, 1.0], &[2, 2]))
        .collect();
    let l = log();
    for (i, w) in ws.iter().enumerate() {
        let l = l.clone();
        w.register_post_accumulate_grad_hook(move |_| push(&l, format!("w{i}")))
            .unwrap();
    }
    let mut x = t(&[1.0, -1.0], &[1, 2]);
    for w in &ws {
        x = x.matmul(w).unwrap().gelu().unwrap();
    }
    x.sum().unwrap().backward().unwrap();
    assert_eq!(entries(&l), vec!["w3", "w2", "w1", "w0"]);
}

#[test]
fn callbacks_can_queue_callbacks_and_only_exist_inside_backward() {
    assert!(matches!(
        queue_callback(|| {}),
        Err(AutogradError::NotInBackward)
    ));
    let w = leaf(&[1.0], &[1]);
    let l = log();
    let l1 = l.clone();
    w.register_post_accumulate_grad_hook(move |_| {
        let l2 = l1.clone();
        queue_callback(move || {
            push(&l2, "first");
            let l3 = l2.clone();
            queue_callback(move || push(&l3, "queued by the first")).unwrap();
        })
        .unwrap();
    })
    .unwrap();
    w.sum().unwrap().backward().unwrap();
    assert_eq!(entries(&l), vec!["first", "queued by the first"]);
}

#[test]
fn hook_errors_abort_backward_and_drop_callbacks() {
    let w = leaf(&[1.0], &[1]);
    let ran = log();
    let r = ran.clone();
    w.register_post_accumulate_grad_hook_fallible(move |_| {
        let r2 = r.clone();
        queue_callback(move || push(&r2, "callback")).unwrap();
        Err(AutogradError::Hook {
            what: "test".into(),
            detail: "boom".into(),
        })
    })
    .unwrap();
    let err = w.sum().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("boom"));
    assert!(entries(&ran).is_empty());
    // A failing callback fails backward too.
    let v = leaf(&[1.0], &[1]);
    v.register_hook(|_| {
        queue_callback_fallible(|| Err(AutogradError::Backward("late".into()))).unwrap();
        None
    })
    .unwrap();
    assert!(v
        .sum()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string()
        .contains("late"));
}

#[test]
fn hooks_can_be_removed() {
    let w = leaf(&[1.0], &[1]);
    let l = log();
    let l1 = l.clone();
    let h = w
        .register_hook(move |_| {
            push(&l1, "hook");
            None
        })
        .unwrap();
    let l2 = l.clone();
    let p = w
        .register_post_accumulate_grad_hook(move |_| push(&l2, "post"))
        .unwrap();
    assert!(h.remove());
    assert!(!h.remove());
    w.sum().unwrap().backward().unwrap();
    assert_eq!(entries(&l), vec!["post"]);
    assert!(p.remove());
    w.sum().unwrap().backward().unwrap();
    assert_eq!(entries(&l), vec!["post"]);
}

#[test]
fn replacement_gradient_of_the_wrong_shape_is_refused() {
    let w = leaf(&[1.0, 2.0], &[2]);
    let y = w.scale(2.0).unwrap();
    y.register_hook(|g| Some(g.narrow(0, 0, 1).unwrap()))
        .unwrap();
    let err = y.sum().unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("replacement gradient"), "{err}");
}

#[test]
fn gradients_are_bitwise_reproducible() {
    let run = || {
        let mut r = common::Rng::new(11);
        let w = leaf(&r.vec(64), &[8, 8]);
        let x = t(&r.vec(32), &[4, 8]);
        let h = x.matmul(&w).unwrap().gelu().unwrap();
        let h = h
            .add(&x.matmul(&w.t().unwrap()).unwrap())
            .unwrap()
            .softmax()
            .unwrap();
        h.mul(&h).unwrap().mean().unwrap().backward().unwrap();
        grad(&w)
    };
    let a = run();
    let b = run();
    assert_eq!(
        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn zeros_are_zero_even_on_reused_memory() {
    let d = dev();
    for _ in 0..3 {
        let a = Tensor::full(&[1000], 7.0, DType::F32, &d).unwrap();
        drop(a);
        let z = Tensor::zeros(&[1000], DType::F32, &d).unwrap();
        assert!(z.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    }
}
