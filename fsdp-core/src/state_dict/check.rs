//! Small validation helpers shared by the state-dict files (error constructors, name, shape
//! and duplicate checks). A low file: it imports only the errors and the value types, so the
//! files above it (format, durable, reshard, optim, the save/load methods) form no cycle.

use super::error::{Result, StateDictError};
use super::types::{ShardedStateDict, TensorEntry};
use std::collections::{HashMap, HashSet};
use std::path::Path;

pub(super) fn format_err(path: &Path, detail: impl Into<String>) -> StateDictError {
    StateDictError::Format {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

pub(super) fn missing(what: &str, name: &str) -> StateDictError {
    StateDictError::MissingEntry {
        what: what.into(),
        name: name.into(),
    }
}

pub(super) fn check_shape(what: &str, name: &str, expected: &[usize], got: &[usize]) -> Result<()> {
    if expected != got {
        return Err(StateDictError::ShapeMismatch {
            what: what.into(),
            name: name.into(),
            expected: expected.to_vec(),
            got: got.to_vec(),
        });
    }
    Ok(())
}

/// Indexes entries by name, checking duplicates and value counts.
pub(super) fn index_entries<'a>(
    entries: &'a [TensorEntry],
    what: &str,
) -> Result<HashMap<&'a str, &'a TensorEntry>> {
    let mut map = HashMap::with_capacity(entries.len());
    for e in entries {
        let n: usize = e.shape.iter().product();
        if e.values.len() != n {
            return Err(StateDictError::ValueCount {
                what: what.into(),
                name: e.name.clone(),
                shape: e.shape.clone(),
                expected: n,
                got: e.values.len(),
            });
        }
        if map.insert(e.name.as_str(), e).is_some() {
            return Err(StateDictError::DuplicateEntry {
                what: what.into(),
                name: e.name.clone(),
            });
        }
    }
    Ok(map)
}

pub(super) fn check_unused(
    entries: &[TensorEntry],
    used: &HashSet<&str>,
    what: &str,
) -> Result<()> {
    match entries.iter().find(|e| !used.contains(e.name.as_str())) {
        Some(e) => Err(StateDictError::UnexpectedEntry {
            what: what.into(),
            name: e.name.clone(),
        }),
        None => Ok(()),
    }
}

pub(super) fn check_slot_name(s: &str) -> Result<()> {
    let reason = if s.is_empty() {
        Some("is empty")
    } else if s.contains('/') {
        Some("contains `/` (it separates slot and parameter in file keys)")
    } else if s.contains(['\t', '\n']) {
        Some("contains a tab or newline")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StateDictError::InvalidName {
            what: "optimizer slot",
            name: s.into(),
            reason,
        }),
        None => Ok(()),
    }
}

pub(super) fn check_slots<'a>(names: impl Iterator<Item = &'a str>) -> Result<()> {
    let mut seen = HashSet::new();
    for s in names {
        check_slot_name(s)?;
        if !seen.insert(s) {
            return Err(StateDictError::DuplicateEntry {
                what: "optimizer slot".into(),
                name: s.into(),
            });
        }
    }
    Ok(())
}

pub(super) fn optim_ranks(slots: &[(String, ShardedStateDict)]) -> Result<Vec<usize>> {
    let mut ranks: Option<&Vec<usize>> = None;
    let mut world: Option<usize> = None;
    for (s, d) in slots {
        if ranks.is_some_and(|r| *r != d.ranks) || world.is_some_and(|w| w != d.world_size) {
            return Err(StateDictError::Incompatible {
                detail: format!("slot `{s}` has other ranks or another world size"),
            });
        }
        ranks = Some(&d.ranks);
        world = Some(d.world_size);
    }
    Ok(ranks.cloned().unwrap_or_default())
}
