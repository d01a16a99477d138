//! The shared-GPU backend's conformance where no GPU is needed: making a group is a typed error,
//! never a panic, without the `cuda` feature or without a CUDA driver, and bad group sizes are
//! refused in every build. Its kernels run on the host emulator in the crate's unit tests
//! (`shared_gpu::tests`); its GPU tests are `shared_gpu::gpu_tests` (`cargo xtask gpu-test`,
//! suite `shared-gpu`).

use std::sync::Arc;
use std::time::Duration;

use fsdp_collectives::shared_gpu::MAX_SHARED_GPU_RANKS;
use fsdp_collectives::{CollectiveError, ProcessGroup, SharedGpuConfig, SharedGpuGroup};

/// A GPU run covers creation itself (`FSDP_GPU_TESTS=1`).
fn on_a_gpu_machine() -> bool {
    std::env::var("FSDP_GPU_TESTS").as_deref() == Ok("1")
}

#[test]
fn without_cuda_making_a_group_is_a_typed_error() {
    if on_a_gpu_machine() {
        eprintln!("SKIPPED: FSDP_GPU_TESTS=1; the GPU tests make real groups");
        return;
    }
    let e = SharedGpuGroup::new(4, 0).unwrap_err();
    let CollectiveError::CudaUnavailable(why) = &e else {
        panic!("expected CudaUnavailable, got {e:?}");
    };
    if cfg!(feature = "cuda") {
        // This machine has no driver (else FSDP_GPU_TESTS would be set): the message says so.
        assert!(
            why.contains("libcuda") || why.contains("could not open"),
            "{why}"
        );
    } else {
        assert!(why.contains("--features cuda"), "{why}");
    }
    assert!(why.contains("cuda:0"), "names the device: {why}");
}

#[test]
fn group_sizes_outside_1_to_the_limit_are_refused_in_every_build() {
    for world in [0, MAX_SHARED_GPU_RANKS + 1] {
        match SharedGpuGroup::new(world, 0) {
            Err(CollectiveError::InvalidGroup { detail, .. }) => {
                assert!(detail.contains(&world.to_string()), "{detail}");
            }
            other => panic!("W={world}: {other:?}"),
        }
    }
}

#[test]
fn the_group_is_a_process_group_and_its_config_builds() {
    fn assert_group<T: ProcessGroup + 'static>() {}
    assert_group::<SharedGpuGroup>();
    let _: Option<Arc<dyn ProcessGroup>> = None::<SharedGpuGroup>.map(|g| Arc::new(g) as _);
    let c = SharedGpuConfig::new(1).with_timeout(Duration::from_secs(5));
    assert_eq!((c.ordinal, c.timeout), (1, Duration::from_secs(5)));
    assert_eq!(
        SharedGpuConfig::new(0).timeout,
        fsdp_collectives::GroupConfig::default().timeout
    );
}
