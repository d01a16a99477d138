//! Unit tests of the resharding core and the file format.

use std::path::{Path, PathBuf};

use super::check::{check_slot_name, check_slots};
use super::format::{
    base_meta, check_param_name, encode_shape, header_crc, parse_shape, write_file, F32View,
    HEADER_CRC_KEY, HEADER_CRC_PLACEHOLDER,
};
use super::*;

fn piece(rank: usize, offset: usize, values: Vec<f32>) -> ShardPiece {
    ShardPiece {
        rank,
        name: "w".into(),
        shape: vec![10],
        offset,
        values,
    }
}

#[test]
fn fill_range_uses_overlapping_pieces_and_reports_gaps() {
    let a = piece(0, 0, vec![0., 1., 2., 3.]);
    let b = piece(1, 4, vec![4., 5., 6.]);
    let c = piece(2, 7, vec![7., 8., 9.]);
    let saved = [&a, &b, &c];
    let mut dst = [0f32; 5];
    fill_range(&mut dst, 2..7, &saved, "w", 0).unwrap();
    assert_eq!(dst, [2., 3., 4., 5., 6.]);
    // A replica overlapping exactly is fine.
    let b2 = piece(3, 4, vec![4., 5., 6.]);
    let mut dst = [0f32; 10];
    fill_range(&mut dst, 0..10, &[&a, &b, &b2, &c], "w", 0).unwrap();
    assert_eq!(dst, [0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    // Without b, elements 4..7 are missing.
    let mut dst = [0f32; 10];
    match fill_range(&mut dst, 0..10, &[&a, &c], "w", 3) {
        Err(StateDictError::IncompleteShards {
            name,
            rank: 3,
            missing,
        }) => {
            assert_eq!((name.as_str(), missing), ("w", 4..7));
        }
        other => panic!("expected IncompleteShards, got {other:?}"),
    }
    // A missing tail.
    let mut dst = [0f32; 3];
    match fill_range(&mut dst, 7..10, &[&a, &b], "w", 1) {
        Err(StateDictError::IncompleteShards { missing, .. }) => assert_eq!(missing, 7..10),
        other => panic!("expected IncompleteShards, got {other:?}"),
    }
}

#[test]
fn shapes_and_names_encode() {
    let p = Path::new("x");
    for s in [vec![], vec![0], vec![3], vec![2, 3, 4]] {
        assert_eq!(parse_shape(&encode_shape(&s), p).unwrap(), s);
    }
    assert!(parse_shape("2,x", p).is_err());
    assert!(check_param_name("a.b").is_ok());
    assert!(matches!(
        check_param_name("a\tb"),
        Err(StateDictError::InvalidName { .. })
    ));
    assert!(check_slot_name("exp_avg").is_ok());
    for bad in ["", "a/b", "a\nb"] {
        assert!(matches!(
            check_slot_name(bad),
            Err(StateDictError::InvalidName { .. })
        ));
    }
    assert!(matches!(
        check_slots(["m", "v", "m"].into_iter()),
        Err(StateDictError::DuplicateEntry { .. })
    ));
}

fn temp_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "fsdp-sd-unit-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

#[test]
fn full_file_round_trip_keeps_order_shapes_and_bits() {
    let dir = temp_dir("full");
    let dict = FullStateDict {
        world_size: 3,
        entries: vec![
            TensorEntry {
                name: "z.scalar".into(),
                shape: vec![],
                values: vec![f32::from_bits(0x7fc0_0001)],
            },
            TensorEntry {
                name: "a.empty".into(),
                shape: vec![0, 4],
                values: vec![],
            },
            TensorEntry {
                name: "m.w".into(),
                shape: vec![2, 3],
                values: vec![1.0, -0.0, 3.5, f32::MIN_POSITIVE, 1e-45, -7.25],
            },
        ],
    };
    let path = dir.join("sub").join("m.safetensors");
    // NaN payloads are kept bit for bit when saving them is allowed explicitly.
    allow_non_finite(|| dict.save(&path)).unwrap();
    let back = FullStateDict::load(&path).unwrap();
    assert_eq!(back.world_size, 3);
    assert_eq!(back.entries.len(), 3);
    for (a, b) in dict.entries.iter().zip(&back.entries) {
        assert_eq!((&a.name, &a.shape), (&b.name, &b.shape));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.values), bits(&b.values));
    }
    // The wrong kind is refused.
    assert!(matches!(
        FullOptimStateDict::load(&path),
        Err(StateDictError::Format { .. })
    ));
    // A missing file names the path.
    match FullStateDict::load(dir.join("nope.safetensors")) {
        Err(StateDictError::Io { path, .. }) => assert!(path.ends_with("nope.safetensors")),
        other => panic!("expected Io, got {other:?}"),
    }
    // Bad value counts are refused before writing.
    let bad = FullStateDict {
        world_size: 1,
        entries: vec![TensorEntry {
            name: "w".into(),
            shape: vec![2],
            values: vec![1.0],
        }],
    };
    assert!(matches!(
        bad.save(dir.join("bad.safetensors")),
        Err(StateDictError::ValueCount { .. })
    ));
    assert!(!dir.join("bad.safetensors").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn other_versions_and_foreign_files_are_refused() {
    let dir = temp_dir("version");
    std::fs::create_dir_all(&dir).unwrap();
    let v = [1.0f32];
    let view = || F32View {
        shape: vec![1],
        values: &v,
    };
    let mut meta = base_meta(KIND_FULL_PARAMS, 1, None);
    meta.insert("format_version".into(), "999".into());
    meta.insert("names".into(), "w".into());
    let p = dir.join("v999.safetensors");
    write_file(&p, vec![("w".into(), view())], meta).unwrap();
    match FullStateDict::load(&p) {
        Err(StateDictError::UnsupportedVersion { found, .. }) => assert_eq!(found, "999"),
        other => panic!("expected UnsupportedVersion, got {other:?}"),
    }
    let p = dir.join("foreign.safetensors");
    safetensors::serialize_to_file(vec![("w".to_string(), view())], None, &p).unwrap();
    assert!(matches!(
        FullStateDict::load(&p),
        Err(StateDictError::Format { .. })
    ));
    let p = dir.join("garbage.safetensors");
    std::fs::write(&p, b"not a safetensors file").unwrap();
    assert!(matches!(
        FullStateDict::load(&p),
        Err(StateDictError::SafeTensors { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merge_checks_compatibility() {
    let cat = vec![ParamMeta {
        name: "w".into(),
        shape: vec![10],
    }];
    let d = |rank: usize, world: usize| ShardedStateDict {
        world_size: world,
        ranks: vec![rank],
        params: cat.clone(),
        pieces: vec![piece(rank, rank * 5, vec![rank as f32; 5])],
    };
    let m = ShardedStateDict::merge([d(1, 2), d(0, 2)]).unwrap();
    assert_eq!(m.ranks, vec![0, 1]);
    assert_eq!(m.pieces.len(), 2);
    assert!(matches!(
        ShardedStateDict::merge([d(0, 2), d(1, 3)]),
        Err(StateDictError::Incompatible { .. })
    ));
    assert!(matches!(
        ShardedStateDict::merge([d(0, 2), d(0, 2)]),
        Err(StateDictError::Incompatible { .. })
    ));
}

#[test]
fn sharded_dir_round_trip() {
    let dir = temp_dir("sharded");
    let cat = vec![
        ParamMeta {
            name: "w".into(),
            shape: vec![10],
        },
        ParamMeta {
            name: "e".into(),
            shape: vec![0],
        },
    ];
    for r in 0..2 {
        ShardedStateDict {
            world_size: 2,
            ranks: vec![r],
            params: cat.clone(),
            pieces: vec![piece(
                r,
                r * 5,
                (0..5).map(|i| (r * 5 + i) as f32).collect(),
            )],
        }
        .save(&dir)
        .unwrap();
    }
    let all = ShardedStateDict::load_dir(&dir).unwrap();
    assert_eq!((all.world_size, all.ranks.clone()), (2, vec![0, 1]));
    assert_eq!(all.params, cat);
    let mut dst = [0f32; 10];
    let mut saved: Vec<&ShardPiece> = all.pieces.iter().collect();
    saved.sort_by_key(|p| p.offset);
    fill_range(&mut dst, 0..10, &saved, "w", 0).unwrap();
    assert_eq!(dst, [0., 1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    // A piece naming an unknown parameter is refused before writing.
    let bad = ShardedStateDict {
        world_size: 2,
        ranks: vec![0],
        params: cat.clone(),
        pieces: vec![ShardPiece {
            name: "x".into(),
            ..piece(0, 0, vec![1.0])
        }],
    };
    assert!(matches!(
        bad.save(dir.join("bad")),
        Err(StateDictError::UnexpectedEntry { .. })
    ));
    assert!(!dir.join("bad").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

fn one_entry(values: Vec<f32>) -> FullStateDict {
    FullStateDict {
        world_size: 1,
        entries: vec![TensorEntry {
            name: "w".into(),
            shape: vec![values.len()],
            values,
        }],
    }
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn non_finite_values_are_refused_on_save_and_on_load() {
    let dir = temp_dir("nonfinite");
    let path = dir.join("m.safetensors");
    one_entry(vec![1.0, 2.0]).save(&path).unwrap();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        match one_entry(vec![1.0, bad, bad]).save(&path) {
            Err(StateDictError::NonFinite { tensor, count, .. }) => {
                assert_eq!((tensor.as_str(), count), ("w", 2));
            }
            other => panic!("{other:?}"),
        }
        // The good file is untouched and no temporary file is left.
        assert_eq!(
            FullStateDict::load(&path).unwrap(),
            one_entry(vec![1.0, 2.0])
        );
        assert_eq!(dir_names(&dir), vec!["m.safetensors".to_string()]);
    }
    // A file with non-finite values not written under the override (here: produced by patching
    // the bytes and the checksum like a foreign writer would) is reported on load.
    let other = dir.join("o.safetensors");
    let view = F32View {
        shape: vec![1],
        values: &[f32::NAN],
    };
    let mut meta = base_meta(KIND_FULL_PARAMS, 1, None);
    meta.insert("names".into(), "w".into());
    meta.insert(
        "crc32/w".into(),
        format!("{:08x}", crc32fast::hash(&f32::NAN.to_le_bytes())),
    );
    meta.insert(HEADER_CRC_KEY.into(), HEADER_CRC_PLACEHOLDER.into());
    let mut bytes = safetensors::serialize(vec![("w".to_string(), view)], Some(meta)).unwrap();
    let (at, crc) = header_crc(&bytes).unwrap();
    bytes[at..at + 8].copy_from_slice(format!("{crc:08x}").as_bytes());
    std::fs::write(&other, bytes).unwrap();
    assert!(matches!(
        FullStateDict::load(&other),
        Err(StateDictError::NonFinite { count: 1, .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flipped_data_bytes_are_caught_by_the_checksum() {
    let dir = temp_dir("crc");
    let path = dir.join("m.safetensors");
    one_entry((0..64).map(|i| i as f32).collect())
        .save(&path)
        .unwrap();
    let clean = std::fs::read(&path).unwrap();
    // Flip one bit in each of several data bytes (the data is the file's tail).
    for back in [1usize, 5, 100, 255] {
        let mut bytes = clean.clone();
        let i = bytes.len() - back;
        bytes[i] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        match FullStateDict::load(&path) {
            Err(StateDictError::ChecksumMismatch {
                path: p, tensor, ..
            }) => {
                assert_eq!((p.as_path(), tensor.as_str()), (path.as_path(), "w"));
            }
            other => panic!("byte -{back}: {other:?}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(unix)]
#[test]
fn saves_refuse_non_regular_targets_and_use_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("targets");
    std::fs::create_dir_all(&dir).unwrap();
    let real = dir.join("real.safetensors");
    one_entry(vec![1.0]).save(&real).unwrap();
    // Mode from the umask (the test process's umask), not a fixed 0600.
    // SAFETY: umask only reads and sets the process's file-mode mask; setting it back at once.
    let mask = unsafe {
        let m = libc::umask(0o022);
        libc::umask(m);
        m
    };
    let mode = std::fs::metadata(&real).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o666 & !(mask as u32), "mode {mode:o}");
    // A symlink is not replaced (nor is what it points to changed).
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(matches!(
        one_entry(vec![2.0]).save(&link),
        Err(StateDictError::NotRegularFile { .. })
    ));
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(FullStateDict::load(&real).unwrap(), one_entry(vec![1.0]));
    // A device node is not replaced (/dev/null: the check comes before any write attempt).
    assert!(matches!(
        one_entry(vec![2.0]).save("/dev/null"),
        Err(StateDictError::NotRegularFile { .. })
    ));
    assert!(!std::fs::symlink_metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_file());
    // A directory is not replaced either.
    std::fs::create_dir_all(dir.join("d.safetensors")).unwrap();
    assert!(matches!(
        one_entry(vec![2.0]).save(dir.join("d.safetensors")),
        Err(StateDictError::NotRegularFile { .. })
    ));
    assert_eq!(
        dir_names(&dir),
        vec!["d.safetensors", "link.safetensors", "real.safetensors"]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn check_save_target_probes_before_training() {
    let dir = temp_dir("target");
    // A directory that can be created is fine, and the probe leaves nothing behind.
    check_save_target(dir.join("ckpt"), None).unwrap();
    assert!(dir_names(&dir).is_empty());
    // Unwritable places are refused with the reason.
    for bad in ["/proc/forbidden/x", "/proc/self/status/x"] {
        match check_save_target(bad, None) {
            Err(StateDictError::TargetUnusable { path, .. }) => assert_eq!(path, Path::new(bad)),
            other => panic!("{bad}: {other:?}"),
        }
    }
    #[cfg(unix)]
    assert!(matches!(
        check_save_target("/dev/null", None),
        Err(StateDictError::TargetUnusable { .. })
    ));
    // Not enough free space for the previous checkpoint's size.
    assert!(matches!(
        check_save_target(dir.join("ckpt"), Some(u64::MAX)),
        Err(StateDictError::TargetUnusable { .. })
    ));
    check_save_target(dir.join("ckpt"), Some(1)).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
