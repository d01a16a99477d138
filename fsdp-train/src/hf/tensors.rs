//! The tensors of a Hugging Face model directory, memory-mapped: one `model.safetensors`, or the
//! shards a `model.safetensors.index.json` names ([`TensorFiles`]). Every tensor's header entry
//! is known after [`TensorFiles::open`]; values are read (and widened to f32 from F32, F16 or
//! BF16) only when asked, range by range, so a rank touches only the bytes of its own pieces.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;
use serde_json::Value;

use super::{HfError, INDEX, WEIGHTS};

/// One memory-mapped safetensors file.
#[derive(Debug)]
struct Mapped {
    path: PathBuf,
    map: Mmap,
    /// Start of the data section.
    data_start: usize,
}

/// Where one tensor is: its file and header entry.
#[derive(Debug, Clone)]
pub struct Entry {
    file: usize,
    /// The header entry (dtype, shape, offsets).
    pub info: TensorInfo,
}

/// The tensors of a model directory (one file or the shards of an index).
#[derive(Debug)]
pub struct TensorFiles {
    files: Vec<Mapped>,
    /// Every tensor by name.
    pub tensors: HashMap<String, Entry>,
    /// The file named in errors: the weights file, or the index.
    pub path: PathBuf,
}

fn io(p: &Path) -> impl FnOnce(std::io::Error) -> HfError {
    let path = p.to_path_buf();
    move |source| HfError::Io { path, source }
}

impl TensorFiles {
    /// Opens `path`: a directory holding `model.safetensors` or `model.safetensors.index.json`
    /// (the single file first), a `.safetensors` file, or an index file.
    ///
    /// # Errors
    /// [`HfError::Io`] for a missing file, [`HfError::Format`] for a malformed header or index,
    /// [`HfError::Config`] for an index whose map names a tensor its shard does not hold.
    pub fn open(path: &Path) -> Result<TensorFiles, HfError> {
        let index = if path.is_dir() {
            let single = path.join(WEIGHTS);
            if single.exists() || !path.join(INDEX).exists() {
                return TensorFiles::single(&single);
            }
            path.join(INDEX)
        } else if path.to_string_lossy().ends_with(".index.json") {
            path.to_path_buf()
        } else {
            return TensorFiles::single(path);
        };
        let text = std::fs::read(&index).map_err(io(&index))?;
        let v: Value = serde_json::from_slice(&text).map_err(|e| HfError::Format {
            path: index.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| HfError::Format {
                path: index.clone(),
                detail: "no `weight_map` object".into(),
            })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut names: BTreeSet<&str> = BTreeSet::new();
        for (t, f) in map {
            let f = f.as_str().ok_or_else(|| HfError::Format {
                path: index.clone(),
                detail: format!("`weight_map.{t}` is not a file name"),
            })?;
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                return Err(HfError::Format {
                    path: index.clone(),
                    detail: format!("`weight_map.{t}` names `{f}`, not a file beside the index"),
                });
            }
            names.insert(f);
        }
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for name in names {
            let (m, infos) = map_file(&dir.join(name))?;
            for (t, info) in infos {
                if map.get(&t).and_then(Value::as_str) == Some(name) {
                    tensors.insert(
                        t,
                        Entry {
                            file: files.len(),
                            info,
                        },
                    );
                }
            }
            files.push(m);
        }
        if let Some((t, f)) = map.iter().find(|(t, _)| !tensors.contains_key(*t)) {
            return Err(HfError::Config {
                path: index.clone(),
                detail: format!("`weight_map` puts tensor `{t}` in {f}, which does not hold it"),
            });
        }
        Ok(TensorFiles {
            files,
            tensors,
            path: index,
        })
    }

    fn single(file: &Path) -> Result<TensorFiles, HfError> {
        let (m, infos) = map_file(file)?;
        let tensors = infos
            .into_iter()
            .map(|(t, info)| (t, Entry { file: 0, info }))
            .collect();
        Ok(TensorFiles {
            files: vec![m],
            tensors,
            path: file.to_path_buf(),
        })
    }

    /// The names of the tensors, sorted.
    pub fn names(&self) -> Vec<&String> {
        let mut n: Vec<&String> = self.tensors.keys().collect();
        n.sort();
        n
    }

    /// The header entries by name (for [`super::missing`]).
    pub fn infos(&self) -> HashMap<String, TensorInfo> {
        self.tensors
            .iter()
            .map(|(k, e)| (k.clone(), e.info.clone()))
            .collect()
    }

    /// Elements `start .. start + out.len()` (row-major) of tensor `e`, widened to f32.
    ///
    /// # Panics
    /// A range past the tensor, or a dtype other than F32, F16 and BF16 (check both first).
    pub fn read(&self, e: &Entry, start: usize, out: &mut [f32]) {
        let f = &self.files[e.file];
        let at = f.data_start + e.info.data_offsets.0;
        match e.info.dtype {
            Dtype::F32 => {
                let b = &f.map[at + 4 * start..at + 4 * (start + out.len())];
                for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Dtype::F16 => {
                let b = &f.map[at + 2 * start..at + 2 * (start + out.len())];
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            Dtype::BF16 => {
                let b = &f.map[at + 2 * start..at + 2 * (start + out.len())];
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            other => unreachable!("{other:?}: callers admit only F32, F16 and BF16"),
        }
    }

    /// The file holding tensor `e` (for errors).
    pub fn file_of(&self, e: &Entry) -> &Path {
        &self.files[e.file].path
    }
}

/// Maps `file` and reads its header.
fn map_file(file: &Path) -> Result<(Mapped, Vec<(String, TensorInfo)>), HfError> {
    let f = File::open(file).map_err(io(file))?;
    // SAFETY: the map is read-only and private to this process; as every reader of a mapped
    // file, we rely on no other process truncating or rewriting the checkpoint while it is read
    // (a truncation would fault).
    let map = unsafe { Mmap::map(&f) }.map_err(io(file))?;
    let (n, meta): (usize, Metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| HfError::Format {
            path: file.to_path_buf(),
            detail: e.to_string(),
        })?;
    let infos = meta
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, v.clone()))
        .collect();
    Ok((
        Mapped {
            path: file.to_path_buf(),
            map,
            data_start: 8 + n,
        },
        infos,
    ))
}
