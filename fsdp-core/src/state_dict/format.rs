//! The on-disk format: safetensors files with fsdp-rs metadata, full files and sharded
//! directories.

use super::check::{check_shape, check_slots, format_err, index_entries};
use super::durable::atomic_write;
use super::error::{Result, StateDictError};
use super::types::{ParamMeta, ShardPiece, ShardedStateDict, TensorEntry};
use super::{
    non_finite_allowed, FORMAT, FORMAT_VERSION, GENERATION_KEY, KIND_FULL_OPTIM,
    KIND_SHARDED_OPTIM, META_FILE, NON_FINITE_KEY,
};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
// ------------------------------------------------------------------------------- files

/// An f32 slice as a safetensors tensor view (little-endian bytes made on demand).
pub(super) struct F32View<'a> {
    pub(super) shape: Vec<usize>,
    pub(super) values: &'a [f32],
}

impl View for F32View<'_> {
    fn dtype(&self) -> StDtype {
        StDtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(self.values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn data_len(&self) -> usize {
        self.values.len() * 4
    }
}

pub(super) fn key(slot: &str, name: &str) -> String {
    if slot.is_empty() {
        name.to_string()
    } else {
        format!("{slot}/{name}")
    }
}

pub(super) fn check_param_name(name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        Some("is empty")
    } else if name.contains(['\t', '\n']) {
        Some("contains a tab or newline")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StateDictError::InvalidName {
            what: "parameter",
            name: name.into(),
            reason,
        }),
        None => Ok(()),
    }
}

pub(super) fn encode_shape(shape: &[usize]) -> String {
    shape
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

pub(super) type ParamSteps = [(String, u64)];

pub(super) fn base_meta(
    kind: &str,
    world_size: usize,
    steps: Option<&ParamSteps>,
) -> HashMap<String, String> {
    let mut m = HashMap::new();
    m.insert("format".into(), FORMAT.into());
    m.insert("format_version".into(), FORMAT_VERSION.to_string());
    m.insert("kind".into(), kind.into());
    m.insert("world_size".into(), world_size.to_string());
    if let Some(steps) = steps {
        let lines: Vec<String> = steps.iter().map(|(n, k)| format!("{n}\t{k}")).collect();
        m.insert("steps".into(), lines.join("\n"));
    }
    m
}

pub(super) fn create_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|source| StateDictError::Io {
            op: "create directory",
            path: parent.to_path_buf(),
            source,
        })?;
    }
    Ok(())
}

pub(super) fn write_file(
    path: &Path,
    tensors: Vec<(String, F32View<'_>)>,
    mut meta: HashMap<String, String>,
) -> Result<()> {
    create_parent(path)?;
    let allow = non_finite_allowed();
    for (k, t) in &tensors {
        let count = t.values.iter().filter(|v| !v.is_finite()).count();
        if count > 0 {
            if !allow {
                return Err(StateDictError::NonFinite {
                    path: Some(path.to_path_buf()),
                    tensor: k.clone(),
                    count,
                });
            }
            meta.insert(NON_FINITE_KEY.into(), "allowed".into());
        }
        meta.insert(crc_key(k), format!("{:08x}", crc32fast::hash(&t.data())));
    }
    // The header's own checksum: written as a placeholder, computed over the serialized header
    // (placeholder included), then patched in place (same length, so no offset moves).
    meta.insert(HEADER_CRC_KEY.into(), HEADER_CRC_PLACEHOLDER.into());
    let mut bytes = safetensors::serialize(tensors, Some(meta)).map_err(|source| {
        StateDictError::SafeTensors {
            op: "write",
            path: path.to_path_buf(),
            source,
        }
    })?;
    let (at, crc) = header_crc(&bytes).ok_or_else(|| {
        format_err(
            path,
            "internal: the serialized header has no checksum placeholder",
        )
    })?;
    bytes[at..at + 8].copy_from_slice(format!("{crc:08x}").as_bytes());
    atomic_write(path, &bytes)
}

/// The metadata key of the header checksum (CRC-32 of the whole JSON header with this key's
/// value replaced by [`HEADER_CRC_PLACEHOLDER`]).
pub(super) const HEADER_CRC_KEY: &str = "crc32/__header__";
pub(super) const HEADER_CRC_PLACEHOLDER: &str = "00000000";

/// In a serialized safetensors file: the byte offset of the header checksum's 8 hex digits and
/// the CRC-32 of the header with those digits read as the placeholder. `None` when the file is
/// too short or its header has no checksum entry.
pub(super) fn header_crc(file: &[u8]) -> Option<(usize, u32)> {
    let len = u64::from_le_bytes(file.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(len).ok()?)?;
    let header = file.get(8..end)?;
    let needle = format!("\"{HEADER_CRC_KEY}\":\"");
    let pos = header
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())?
        + needle.len();
    header.get(pos..pos + 8)?;
    let mut h = crc32fast::Hasher::new();
    h.update(&header[..pos]);
    h.update(HEADER_CRC_PLACEHOLDER.as_bytes());
    h.update(&header[pos + 8..]);
    Some((8 + pos, h.finalize()))
}

/// Refuses a file whose header does not match its recorded checksum.
fn check_header_crc(path: &Path, bytes: &[u8], meta: &HashMap<String, String>) -> Result<()> {
    let recorded = meta_str(meta, HEADER_CRC_KEY, path)?;
    let recorded = u32::from_str_radix(recorded, 16)
        .map_err(|_| format_err(path, format!("bad header checksum `{recorded}`")))?;
    match header_crc(bytes) {
        Some((_, found)) if found == recorded => Ok(()),
        Some((_, found)) => Err(format_err(
            path,
            format!(
                "header checksum mismatch (recorded {recorded:08x}, computed {found:08x}): the \
                 file's header is damaged"
            ),
        )),
        None => Err(format_err(path, "the header checksum entry is damaged")),
    }
}

fn crc_key(tensor: &str) -> String {
    format!("crc32/{tensor}")
}

pub(super) fn write_full_file(
    path: &Path,
    kind: &str,
    world_size: usize,
    steps: Option<&ParamSteps>,
    slots: &[(&str, &[TensorEntry])],
) -> Result<()> {
    if let Some(steps) = steps {
        for (n, _) in steps {
            check_param_name(n)?;
        }
    }
    let mut meta = base_meta(kind, world_size, steps);
    let mut tensors = Vec::new();
    if steps.is_some() {
        meta.insert(
            "slots".into(),
            slots.iter().map(|(s, _)| *s).collect::<Vec<_>>().join("\n"),
        );
    }
    for (slot, entries) in slots {
        index_entries(entries, "parameter")?;
        for e in entries.iter() {
            check_param_name(&e.name)?;
            tensors.push((
                key(slot, &e.name),
                F32View {
                    shape: e.shape.clone(),
                    values: &e.values,
                },
            ));
        }
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        meta.insert(names_key(slot), names.join("\n"));
    }
    write_file(path, tensors, meta)
}

pub(super) fn names_key(slot: &str) -> String {
    if slot.is_empty() {
        "names".into()
    } else {
        format!("names/{slot}")
    }
}

/// The whole file `path`, which must be a regular file: it is opened with `O_NONBLOCK` (a FIFO
/// then returns at once instead of blocking the load forever) and checked on the opened file.
pub(super) fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| StateDictError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(io)?;
    let m = f.metadata().map_err(io)?;
    if !m.is_file() {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, device or directory)",
        )));
    }
    let mut out = Vec::with_capacity(m.len() as usize);
    f.read_to_end(&mut out).map_err(io)?;
    Ok(out)
}

/// Parses a file's header, checks format, version and kind; returns the metadata and the raw
/// bytes (for tensor access).
pub(super) fn read_file_meta(
    path: &Path,
    kind: &str,
) -> Result<(HashMap<String, String>, Vec<u8>)> {
    let bytes = read_bytes(path)?;
    let (_, header) =
        SafeTensors::read_metadata(&bytes).map_err(|source| StateDictError::SafeTensors {
            op: "read",
            path: path.to_path_buf(),
            source,
        })?;
    let meta = header
        .metadata()
        .clone()
        .ok_or_else(|| format_err(path, "no __metadata__ (not written by fsdp-rs)"))?;
    match meta.get("format") {
        Some(f) if f == FORMAT => {}
        other => {
            return Err(format_err(
                path,
                format!("metadata `format` is {other:?}, expected `{FORMAT}`"),
            ))
        }
    }
    match meta.get("format_version") {
        Some(v) if *v == FORMAT_VERSION.to_string() => {}
        other => {
            return Err(StateDictError::UnsupportedVersion {
                path: path.to_path_buf(),
                found: other.cloned().unwrap_or_else(|| "(none)".into()),
                supported: FORMAT_VERSION,
            })
        }
    }
    match meta.get("kind") {
        Some(k) if k == kind => {}
        other => {
            return Err(format_err(
                path,
                format!("metadata `kind` is {other:?}, expected `{kind}`"),
            ))
        }
    }
    check_header_crc(path, &bytes, &meta)?;
    Ok((meta, bytes))
}

pub(super) fn meta_str<'a>(
    meta: &'a HashMap<String, String>,
    k: &str,
    path: &Path,
) -> Result<&'a str> {
    meta.get(k)
        .map(|s| s.as_str())
        .ok_or_else(|| format_err(path, format!("metadata key `{k}` is missing")))
}

pub(super) fn meta_num<T: std::str::FromStr>(
    meta: &HashMap<String, String>,
    k: &str,
    path: &Path,
) -> Result<T> {
    let s = meta_str(meta, k, path)?;
    s.parse()
        .map_err(|_| format_err(path, format!("metadata `{k}` = `{s}` is not a number")))
}

pub(super) fn parse_steps(
    meta: &HashMap<String, String>,
    path: &Path,
) -> Result<Vec<(String, u64)>> {
    lines(meta_str(meta, "steps", path)?)
        .map(|line| {
            let bad = || format_err(path, format!("bad step-count line `{line}`"));
            let (name, n) = line.split_once('\t').ok_or_else(bad)?;
            Ok((name.to_string(), n.parse().map_err(|_| bad())?))
        })
        .collect()
}

pub(super) fn lines(s: &str) -> impl Iterator<Item = &str> {
    s.split('\n').filter(|l| !l.is_empty())
}

pub(super) fn parse_shape(s: &str, path: &Path) -> Result<Vec<usize>> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|d| {
            d.parse()
                .map_err(|_| format_err(path, format!("bad shape `{s}`")))
        })
        .collect()
}

pub(super) fn parse_slots(
    meta: &HashMap<String, String>,
    path: &Path,
    optim: bool,
) -> Result<Vec<String>> {
    if !optim {
        return Ok(vec![String::new()]);
    }
    let slots: Vec<String> = lines(meta_str(meta, "slots", path)?)
        .map(String::from)
        .collect();
    check_slots(slots.iter().map(|s| s.as_str()))?;
    Ok(slots)
}

pub(super) fn f32_values(
    view: &safetensors::tensor::TensorView<'_>,
    k: &str,
    path: &Path,
    meta: &HashMap<String, String>,
) -> Result<Vec<f32>> {
    if view.dtype() != StDtype::F32 {
        return Err(format_err(
            path,
            format!("tensor `{k}` is {:?}, expected F32", view.dtype()),
        ));
    }
    let recorded = meta_str(meta, &crc_key(k), path)?;
    let expected = u32::from_str_radix(recorded, 16)
        .map_err(|_| format_err(path, format!("bad checksum `{recorded}` of `{k}`")))?;
    let found = crc32fast::hash(view.data());
    if found != expected {
        return Err(StateDictError::ChecksumMismatch {
            path: path.to_path_buf(),
            tensor: k.into(),
            expected,
            found,
        });
    }
    let values: Vec<f32> = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let count = values.iter().filter(|v| !v.is_finite()).count();
    if count > 0 && meta.get(NON_FINITE_KEY).map(String::as_str) != Some("allowed") {
        return Err(StateDictError::NonFinite {
            path: Some(path.to_path_buf()),
            tensor: k.into(),
            count,
        });
    }
    Ok(values)
}

pub(super) struct FullFile {
    pub(super) world_size: usize,
    pub(super) steps: Option<Vec<(String, u64)>>,
    pub(super) slots: Vec<(String, Vec<TensorEntry>)>,
}

pub(super) fn read_full_file(path: &Path, kind: &str) -> Result<FullFile> {
    let (meta, bytes) = read_file_meta(path, kind)?;
    let optim = kind == KIND_FULL_OPTIM;
    let st = SafeTensors::deserialize(&bytes).map_err(|source| StateDictError::SafeTensors {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    let world_size = meta_num(&meta, "world_size", path)?;
    let steps = if optim {
        Some(parse_steps(&meta, path)?)
    } else {
        None
    };
    let mut slots = Vec::new();
    let mut used = 0usize;
    for slot in parse_slots(&meta, path, optim)? {
        let mut entries = Vec::new();
        for name in lines(meta_str(&meta, &names_key(&slot), path)?) {
            let k = key(&slot, name);
            let view = st
                .tensor(&k)
                .map_err(|_| format_err(path, format!("tensor `{k}` listed but absent")))?;
            entries.push(TensorEntry {
                name: name.to_string(),
                shape: view.shape().to_vec(),
                values: f32_values(&view, &k, path, &meta)?,
            });
            used += 1;
        }
        slots.push((slot, entries));
    }
    if used != st.len() {
        return Err(format_err(
            path,
            format!("{} tensors, the metadata lists {used}", st.len()),
        ));
    }
    Ok(FullFile {
        world_size,
        steps,
        slots,
    })
}

/// Top-level metadata of a sharded checkpoint directory.
pub(super) struct ShardedMeta {
    /// The save id every file of the directory must carry.
    pub(super) generation: String,
    pub(super) world_size: usize,
    pub(super) steps: Option<Vec<(String, u64)>>,
    /// Per slot, the catalogue.
    pub(super) slots: Vec<(String, Vec<ParamMeta>)>,
}

impl ShardedMeta {
    pub(super) fn slot_names(&self) -> Vec<String> {
        self.slots.iter().map(|(s, _)| s.clone()).collect()
    }
}

pub(super) fn rank_path(dir: &Path, rank: usize, world: usize, index: bool) -> PathBuf {
    let suffix = if index { ".pieces" } else { "" };
    dir.join(format!("rank-{rank:05}-of-{world:05}{suffix}.safetensors"))
}

pub(super) fn pieces_key(slot: &str) -> String {
    format!("pieces/{slot}")
}

pub(super) fn params_key(slot: &str) -> String {
    format!("params/{slot}")
}

pub(super) fn write_sharded_dir(
    dir: &Path,
    kind: &str,
    steps: Option<&ParamSteps>,
    slots: &[(&str, &ShardedStateDict)],
    ranks: &[usize],
    generation: &str,
) -> Result<()> {
    let world = slots.first().map_or(0, |(_, d)| d.world_size);
    if let Some(steps) = steps {
        for (n, _) in steps {
            check_param_name(n)?;
        }
    }
    let mut base = base_meta(kind, world, None);
    base.insert(GENERATION_KEY.into(), generation.into());
    base.insert(
        "slots".into(),
        slots.iter().map(|(s, _)| *s).collect::<Vec<_>>().join("\n"),
    );
    // Validate everything before writing anything.
    for (_, d) in slots {
        let catalogue: HashMap<&str, &ParamMeta> =
            d.params.iter().map(|p| (p.name.as_str(), p)).collect();
        for p in &d.params {
            check_param_name(&p.name)?;
        }
        for p in &d.pieces {
            let meta =
                catalogue
                    .get(p.name.as_str())
                    .ok_or_else(|| StateDictError::UnexpectedEntry {
                        what: "piece of parameter".into(),
                        name: p.name.clone(),
                    })?;
            check_shape("piece of parameter", &p.name, &meta.shape, &p.shape)?;
            if !ranks.contains(&p.rank) {
                return Err(StateDictError::Incompatible {
                    detail: format!(
                        "a piece of `{}` is from rank {}, which is not among the dict's ranks \
                         {ranks:?}",
                        p.name, p.rank
                    ),
                });
            }
            if p.offset + p.values.len() > meta.numel() {
                return Err(StateDictError::PieceOutOfRange {
                    name: p.name.clone(),
                    rank: p.rank,
                    offset: p.offset,
                    len: p.values.len(),
                    numel: meta.numel(),
                });
            }
        }
    }
    for &r in ranks {
        let mut meta = base.clone();
        meta.insert("rank".into(), r.to_string());
        let mut tensors = Vec::new();
        let mut seen = HashSet::new();
        for (slot, d) in slots {
            let mut table = String::new();
            for p in d.pieces.iter().filter(|p| p.rank == r) {
                let k = key(slot, &p.name);
                if !seen.insert(k.clone()) {
                    return Err(StateDictError::DuplicateEntry {
                        what: format!("piece (rank {r}) of parameter"),
                        name: p.name.clone(),
                    });
                }
                table.push_str(&format!("{}\t{}\t{}\n", p.name, p.offset, p.values.len()));
                tensors.push((
                    k,
                    F32View {
                        shape: vec![p.values.len()],
                        values: &p.values,
                    },
                ));
            }
            meta.insert(pieces_key(slot), table);
        }
        write_file(&rank_path(dir, r, world, false), tensors, meta.clone())?;
        meta.insert("kind".into(), format!("{kind}-pieces"));
        write_file(&rank_path(dir, r, world, true), Vec::new(), meta)?;
    }
    if ranks.contains(&0) {
        let mut meta = base_meta(kind, world, steps);
        meta.extend(base);
        meta.insert("kind".into(), format!("{kind}-meta"));
        for (slot, d) in slots {
            let cat: Vec<String> = d
                .params
                .iter()
                .map(|p| format!("{}\t{}", p.name, encode_shape(&p.shape)))
                .collect();
            meta.insert(params_key(slot), cat.join("\n"));
        }
        write_file(&dir.join(META_FILE), Vec::new(), meta)?;
    }
    Ok(())
}

pub(super) fn read_sharded_meta(dir: &Path, kind: &str) -> Result<ShardedMeta> {
    let path = dir.join(META_FILE);
    let (meta, _) = read_file_meta(&path, &format!("{kind}-meta"))?;
    let optim = kind == KIND_SHARDED_OPTIM;
    let world_size = meta_num(&meta, "world_size", &path)?;
    let steps = if optim {
        Some(parse_steps(&meta, &path)?)
    } else {
        None
    };
    let mut slots = Vec::new();
    for slot in parse_slots(&meta, &path, optim)? {
        let mut cat = Vec::new();
        for line in lines(meta_str(&meta, &params_key(&slot), &path)?) {
            let (name, shape) = line
                .split_once('\t')
                .ok_or_else(|| format_err(&path, format!("bad catalogue line `{line}`")))?;
            cat.push(ParamMeta {
                name: name.into(),
                shape: parse_shape(shape, &path)?,
            });
        }
        slots.push((slot, cat));
    }
    Ok(ShardedMeta {
        generation: meta_str(&meta, GENERATION_KEY, &path)?.to_string(),
        world_size,
        steps,
        slots,
    })
}

pub(super) type PieceTable = Vec<(String, Vec<(String, usize, usize)>)>;

/// Per slot, the `(name, offset, len)` piece list of a rank file's metadata.
pub(super) fn parse_pieces(
    meta: &HashMap<String, String>,
    path: &Path,
    slots: &[String],
) -> Result<PieceTable> {
    let mut out = Vec::with_capacity(slots.len());
    for slot in slots {
        let mut pieces = Vec::new();
        for line in lines(meta_str(meta, &pieces_key(slot), path)?) {
            let mut it = line.split('\t');
            let (Some(name), Some(off), Some(len), None) =
                (it.next(), it.next(), it.next(), it.next())
            else {
                return Err(format_err(path, format!("bad piece line `{line}`")));
            };
            let num = |s: &str| {
                s.parse::<usize>()
                    .map_err(|_| format_err(path, format!("bad piece line `{line}`")))
            };
            pieces.push((name.to_string(), num(off)?, num(len)?));
        }
        out.push((slot.clone(), pieces));
    }
    Ok(out)
}

/// Reads the data files of `ranks`; per slot, a dict of their pieces with the catalogue.
pub(super) fn read_sharded_ranks(
    dir: &Path,
    kind: &str,
    meta: &ShardedMeta,
    ranks: &[usize],
) -> Result<Vec<(String, ShardedStateDict)>> {
    let mut slots: Vec<(String, ShardedStateDict)> = meta
        .slots
        .iter()
        .map(|(s, cat)| {
            (
                s.clone(),
                ShardedStateDict {
                    world_size: meta.world_size,
                    ranks: ranks.to_vec(),
                    params: cat.clone(),
                    pieces: Vec::new(),
                },
            )
        })
        .collect();
    for &r in ranks {
        let path = rank_path(dir, r, meta.world_size, false);
        let (m, bytes) = read_file_meta(&path, kind)?;
        check_generation(&m, &path, &meta.generation)?;
        let file_rank: usize = meta_num(&m, "rank", &path)?;
        if file_rank != r {
            return Err(format_err(&path, format!("metadata says rank {file_rank}")));
        }
        let st =
            SafeTensors::deserialize(&bytes).map_err(|source| StateDictError::SafeTensors {
                op: "read",
                path: path.clone(),
                source,
            })?;
        let table = parse_pieces(&m, &path, &meta.slot_names())?;
        for ((_, pieces), (slot, dict)) in table.into_iter().zip(slots.iter_mut()) {
            let shapes: HashMap<&str, &[usize]> = dict
                .params
                .iter()
                .map(|p| (p.name.as_str(), p.shape.as_slice()))
                .collect();
            let mut new = Vec::with_capacity(pieces.len());
            for (name, offset, len) in pieces {
                let k = key(slot, &name);
                let view = st
                    .tensor(&k)
                    .map_err(|_| format_err(&path, format!("tensor `{k}` listed but absent")))?;
                let values = f32_values(&view, &k, &path, &m)?;
                if values.len() != len {
                    return Err(format_err(
                        &path,
                        format!("tensor `{k}` has {} values, listed as {len}", values.len()),
                    ));
                }
                let shape = shapes
                    .get(name.as_str())
                    .ok_or_else(|| StateDictError::UnexpectedEntry {
                        what: "piece of parameter".into(),
                        name: name.clone(),
                    })?
                    .to_vec();
                new.push(ShardPiece {
                    rank: r,
                    name,
                    shape,
                    offset,
                    values,
                });
            }
            dict.pieces.extend(new);
        }
    }
    Ok(slots)
}

/// Refuses a file of a sharded directory whose save id differs from the metadata's.
pub(super) fn check_generation(
    m: &HashMap<String, String>,
    path: &Path,
    expected: &str,
) -> Result<()> {
    let found = meta_str(m, GENERATION_KEY, path)?;
    if found != expected {
        return Err(StateDictError::GenerationMismatch {
            path: path.to_path_buf(),
            expected: expected.into(),
            found: found.into(),
        });
    }
    Ok(())
}
