//! `--tensorboard DIR`: TensorBoard event files, written by rank 0's observer
//! ([`TensorBoard`], wrapping the console) after every step.
//!
//! ## Scalars (tag: value, per step)
//! - `train/loss`: the global-batch mean cross-entropy (the step line's `loss`);
//! - `val/loss`: the validation loss, at the steps that evaluate (`--eval-every`, the last);
//! - `train/lr`: the learning rate of the step; `train/grad_norm`: the global gradient norm
//!   before clipping;
//! - `perf/tokens_per_s`: tokens of the global batch over rank 0's step time;
//!   `perf/mfu`: model FLOP/s (`6·Ψ + 12·L·d·T` per token, as the summary counts them) over the
//!   GEMM rate the start-up probe measured on the training device — written when that rate is
//!   known before training (CPU ranks, and `--plan` runs); on `--device cuda` the probe runs
//!   after training, so there is no per-step MFU;
//! - `memory/peak_allocated_bytes`, `memory/peak_reserved_bytes`: the step's largest per-rank
//!   peaks (as the step line's `peak`).
//!
//! ## The format
//! One file `events.out.tfevents.<unix seconds>.<host>.<pid>` per run (the name TensorBoard
//! looks for), a sequence of TFRecord records: the payload length (u64, little-endian), the
//! masked CRC-32C of those 8 bytes, the payload, the masked CRC-32C of the payload (masked:
//! `((crc >> 15) | (crc << 17)) + 0xa282ead8`). Each payload is a `tensorflow.Event` protocol
//! buffer: `wall_time` (field 1, double), `step` (2, int64), and either `file_version` (3,
//! string; `brain.Event:2`, the first record) or `summary` (5) holding one `Summary.Value`
//! (field 1) with `tag` (1, string) and `simple_value` (2, float). Written by hand here (a few
//! dozen lines) rather than through a protobuf crate: nothing else in the project speaks
//! protobuf. The file is flushed after every step, so `tensorboard --logdir DIR` shows a run as
//! it trains. A resumed run writes a new file into the same directory; its steps continue the
//! old ones.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::job::{Observer, StepRecord};

/// The CRC-32C (Castagnoli, reflected polynomial `0x82F63B78`) table.
const CRC32C_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

/// CRC-32C of `data` (the checksum TFRecord files use).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c = CRC32C_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// TFRecord's masked CRC-32C of `data`.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `payload` framed as one TFRecord record.
pub fn record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out
}

/// Appends `v` as a protobuf varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends field `field` of wire type 2 (length-delimited) holding `bytes`.
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// What an event carries besides its time and step.
enum Payload<'a> {
    /// `file_version`.
    Version(&'a str),
    /// A summary of one scalar: `tag`, value.
    Scalar(&'a str, f32),
}

/// A `tensorflow.Event` protocol buffer.
fn event(wall_time: f64, step: i64, p: Payload<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(0x09); // field 1, 64-bit
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(0x10); // field 2, varint (an int64's two's complement)
    varint(&mut out, step as u64);
    match p {
        Payload::Version(v) => bytes_field(&mut out, 3, v.as_bytes()),
        Payload::Scalar(tag, value) => {
            let mut val = Vec::new();
            bytes_field(&mut val, 1, tag.as_bytes());
            val.push(0x15); // field 2, 32-bit
            val.extend_from_slice(&value.to_le_bytes());
            let mut summary = Vec::new();
            bytes_field(&mut summary, 1, &val);
            bytes_field(&mut out, 5, &summary);
        }
    }
    out
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An event file being written.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir` (and parents) and a new event file in it, and writes its version record.
    ///
    /// # Errors
    /// The file system's error, naming the path.
    pub fn create(dir: &Path) -> Result<EventWriter, String> {
        let name_err = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
        std::fs::create_dir_all(dir).map_err(|e| name_err(dir, e))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().replace(['/', '.'], "_"))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".into());
        let secs = now() as u64;
        let pid = std::process::id();
        let mut n = 0;
        let path = loop {
            let suffix = if n == 0 {
                String::new()
            } else {
                format!(".{n}")
            };
            let p = dir.join(format!("events.out.tfevents.{secs}.{host}.{pid}{suffix}"));
            if !p.exists() {
                break p;
            }
            n += 1;
        };
        let file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| name_err(&path, e))?;
        let mut w = EventWriter {
            path,
            out: BufWriter::new(file),
        };
        w.write(&event(now(), 0, Payload::Version("brain.Event:2")))?;
        w.flush()?;
        Ok(w)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write(&mut self, payload: &[u8]) -> Result<(), String> {
        self.out
            .write_all(&record(payload))
            .map_err(|e| format!("{}: {e}", self.path.display()))
    }

    /// Appends scalar `tag` = `value` at `step` (wall time: now).
    ///
    /// # Errors
    /// The write error, naming the file.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f32) -> Result<(), String> {
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        self.write(&event(now(), step, Payload::Scalar(tag, value)))
    }

    /// Pushes the records written so far to the file.
    ///
    /// # Errors
    /// The write error, naming the file.
    pub fn flush(&mut self) -> Result<(), String> {
        self.out
            .flush()
            .map_err(|e| format!("{}: {e}", self.path.display()))
    }
}

/// What MFU is measured against: model FLOPs per token and the probe's GEMM rate (FLOP/s).
#[derive(Debug, Clone, Copy)]
pub struct MfuBasis {
    /// `6·Ψ + 12·L·d·T`.
    pub flops_per_token: f64,
    /// The GEMM probe's rate on the training device.
    pub gemm_flops_per_s: f64,
}

impl MfuBasis {
    /// The basis of a model of config `g` with `params` parameters against `gemm_flops_per_s`.
    pub fn new(g: &dyn crate::model::Family, params: u64, gemm_flops_per_s: f64) -> MfuBasis {
        MfuBasis {
            flops_per_token: crate::report::flops_per_token(g, params),
            gemm_flops_per_s,
        }
    }
}

/// The scalars of step record `r`: (tag, value), in the order they are written.
pub fn scalars(r: &StepRecord, mfu: Option<MfuBasis>) -> Vec<(&'static str, f32)> {
    let mut v = vec![("train/loss", r.loss)];
    if let Some(val) = r.val_loss {
        v.push(("val/loss", val));
    }
    v.push(("train/lr", r.lr));
    v.push(("train/grad_norm", r.grad_norm as f32));
    v.push(("perf/tokens_per_s", r.tokens_per_s as f32));
    if let Some(m) = mfu.filter(|m| m.gemm_flops_per_s > 0.0) {
        v.push((
            "perf/mfu",
            (r.tokens_per_s * m.flops_per_token / m.gemm_flops_per_s) as f32,
        ));
    }
    v.push(("memory/peak_allocated_bytes", r.peak_allocated as f32));
    v.push(("memory/peak_reserved_bytes", r.peak_reserved as f32));
    v
}

/// Rank 0's observer with `--tensorboard`: the scalars of every step into the event file, then
/// whatever the inner observer does (the console). A write error does not stop training: the
/// first one is reported at the end (like `--metrics`).
pub struct TensorBoard {
    inner: Box<dyn Observer>,
    writer: EventWriter,
    mfu: Option<MfuBasis>,
    error: Option<String>,
}

impl TensorBoard {
    /// Writes into `writer` and passes everything on to `inner`; `mfu`: the MFU basis when the
    /// GEMM rate is known before training.
    pub fn new(inner: Box<dyn Observer>, writer: EventWriter, mfu: Option<MfuBasis>) -> Self {
        TensorBoard {
            inner,
            writer,
            mfu,
            error: None,
        }
    }
}

impl Observer for TensorBoard {
    fn start(&mut self, first: usize, total: usize) {
        self.inner.start(first, total);
    }

    fn step(&mut self, rec: &StepRecord) {
        let step = rec.step as u64;
        let res = scalars(rec, self.mfu)
            .into_iter()
            .try_for_each(|(tag, v)| self.writer.scalar(tag, step, v))
            .and_then(|()| self.writer.flush());
        if let Err(e) = res {
            self.error.get_or_insert(e);
        }
        self.inner.step(rec);
    }

    fn note(&mut self, line: &str) {
        self.inner.note(line);
    }

    fn finish(&mut self) -> Result<(), String> {
        if let Err(e) = self.writer.flush() {
            self.error.get_or_insert(e);
        }
        let inner = self.inner.finish();
        match self.error.take() {
            Some(e) => Err(format!("--tensorboard: {e}")),
            None => inner,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Quiet;
    use serde_json::Value;

    /// A decoded event: wall time, step, and `Ok(file_version)` or `Err((tag, value))`.
    type Decoded = (f64, i64, Result<String, (String, f32)>);

    /// Reads an event file back with the record format's checks: every length and payload
    /// checksum verified, each event decoded (`wall_time`, `step`, `file_version` or one scalar).
    fn read_records(path: &Path) -> Vec<Decoded> {
        let data = std::fs::read(path).unwrap();
        let mut at = 0;
        let mut out = Vec::new();
        while at < data.len() {
            let len_bytes = &data[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(len_bytes), "length checksum at {at}");
            let payload = &data[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(data[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(payload), "payload checksum at {at}");
            out.push(decode_event(payload));
            at += 16 + len;
        }
        assert_eq!(at, data.len(), "no trailing bytes");
        out
    }

    fn read_varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let x = b[*at];
            *at += 1;
            v |= u64::from(x & 0x7f) << shift;
            if x & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }

    /// The fields of a length-delimited message: (field, wire type, value bytes or varint).
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let mut at = 0;
        let mut out = Vec::new();
        while at < b.len() {
            let key = read_varint(b, &mut at);
            let (field, wire) = (key >> 3, key & 7);
            let value = match wire {
                0 => read_varint(b, &mut at).to_le_bytes().to_vec(),
                1 => {
                    at += 8;
                    b[at - 8..at].to_vec()
                }
                2 => {
                    let n = read_varint(b, &mut at) as usize;
                    at += n;
                    b[at - n..at].to_vec()
                }
                5 => {
                    at += 4;
                    b[at - 4..at].to_vec()
                }
                w => panic!("wire type {w}"),
            };
            out.push((field, wire, value));
        }
        out
    }

    fn decode_event(b: &[u8]) -> Decoded {
        let (mut wall, mut step, mut what) = (0.0, 0, None);
        for (f, _, v) in fields(b) {
            match f {
                1 => wall = f64::from_le_bytes(v.try_into().unwrap()),
                2 => step = i64::from_le_bytes(v.try_into().unwrap()),
                3 => what = Some(Ok(String::from_utf8(v).unwrap())),
                5 => {
                    let vals = fields(&v);
                    assert_eq!(vals.len(), 1, "one value a summary");
                    let inner = fields(&vals[0].2);
                    let tag = String::from_utf8(inner[0].2.clone()).unwrap();
                    let x = f32::from_le_bytes(inner[1].2.clone().try_into().unwrap());
                    what = Some(Err((tag, x)));
                }
                other => panic!("field {other}"),
            }
        }
        (wall, step, what.expect("a payload"))
    }

    #[test]
    fn crc32c_known_answers() {
        // The CRC-32C check value, and iSCSI's (RFC 3720) 32 zero bytes.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b""), 0);
    }

    fn record_at(step: usize) -> StepRecord {
        StepRecord {
            step,
            loss: 3.0 - step as f32 * 0.25,
            val_loss: (step % 2 == 0).then_some(2.5),
            lr: 1e-3,
            grad_norm: 0.5 + step as f64,
            secs: 0.01,
            host_syncs: 2,
            tokens_per_s: 1234.5,
            peak_allocated: 1 << 20,
            peak_reserved: 3 << 20,
            retries: 0,
            state_bytes: 0,
            ag: 0,
            rs: 0,
            ar: 0,
        }
    }

    /// The writer's records pass the format's checks and decode to the version record and one
    /// scalar event per (step, tag) in order, with the values written.
    #[test]
    fn records_are_framed_and_decode() {
        let dir = tempfile::tempdir().unwrap();
        let w = EventWriter::create(&dir.path().join("tb")).unwrap();
        let path = w.path().to_path_buf();
        assert!(path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."));
        let mfu = MfuBasis {
            flops_per_token: 1e6,
            gemm_flops_per_s: 1e10,
        };
        let mut tb = TensorBoard::new(Box::new(Quiet), w, Some(mfu));
        let recs: Vec<StepRecord> = (1..=3).map(record_at).collect();
        for r in &recs {
            tb.step(r);
        }
        tb.finish().unwrap();
        let events = read_records(&path);
        assert_eq!(events[0].2, Ok("brain.Event:2".to_string()));
        let mut want = Vec::new();
        for r in &recs {
            for (tag, v) in scalars(r, Some(mfu)) {
                want.push((r.step as i64, tag.to_string(), v));
            }
        }
        let got: Vec<(i64, String, f32)> = events[1..]
            .iter()
            .map(|(w, s, e)| {
                assert!(*w > 1e9, "wall time in seconds since 1970");
                let (tag, v) = e.clone().unwrap_err();
                (*s, tag, v)
            })
            .collect();
        assert_eq!(got, want);
        assert!(got
            .iter()
            .any(|(_, t, v)| t == "perf/mfu" && (*v - 0.12345).abs() < 1e-6));
        // Steps without evaluation have no val/loss; the others have every scalar.
        let tags_at = |s: i64| got.iter().filter(|g| g.0 == s).count();
        assert_eq!((tags_at(1), tags_at(2)), (7, 8));
    }

    /// A run with `--tensorboard` read back by TensorBoard's own reader (the `tensorboard`
    /// Python package's `EventAccumulator`): every scalar at every step (with `--eval-every 1`,
    /// `val/loss` too), equal to the run's step records. Skipped with a message where python3
    /// or tensorboard is missing, unless `FSDP_TB_REQUIRED=1` (`.ci/run` installs it and sets it).
    #[test]
    fn tensorboard_reads_every_scalar_at_every_step() {
        let dir = tempfile::tempdir().unwrap();
        let tb_dir = dir.path().join("runs");
        let c = {
            use clap::Parser;
            crate::cli::Cli::try_parse_from([
                "train_gpt",
                "--d-model",
                "16",
                "--layers",
                "1",
                "--heads",
                "2",
                "--seq-len",
                "8",
                "--vocab",
                "32",
                "--ranks",
                "2",
                "--steps",
                "4",
                "--eval-every",
                "1",
                "--eval-seqs",
                "4",
            ])
            .unwrap()
            .into_config()
            .unwrap()
        };
        let mfu = MfuBasis::new(&*c.model, c.model.params(), 1e9);
        let w = EventWriter::create(&tb_dir).unwrap();
        let path = w.path().to_path_buf();
        let obs = TensorBoard::new(Box::new(Quiet), w, Some(mfu));
        let mut rep = crate::train::run_job(&c, Box::new(obs), false).unwrap();
        rep.observer.finish().unwrap();
        let mut want: Vec<(String, u64, f32)> = Vec::new();
        for r in &rep.steps {
            for (tag, v) in scalars(r, Some(mfu)) {
                want.push((tag.to_string(), r.step as u64, v));
            }
        }
        want.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(want.len(), 4 * 8, "8 scalars at each of 4 steps");
        // The Rust check of the records, always.
        let mut mine: Vec<(String, u64, f32)> = read_records(&path)[1..]
            .iter()
            .map(|(_, s, e)| {
                let (t, v) = e.clone().unwrap_err();
                (t, *s as u64, v)
            })
            .collect();
        mine.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(mine, want);
        // TensorBoard's reader.
        let script = "import json, sys\n\
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
ea = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n\
ea.Reload()\n\
print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()['scalars']}))\n";
        let required = std::env::var("FSDP_TB_REQUIRED").is_ok_and(|v| v == "1");
        let out = std::process::Command::new("python3")
            .args(["-c", script, tb_dir.to_str().unwrap()])
            .output();
        let out = match out {
            Ok(o) if o.status.success() => o,
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    !required,
                    "FSDP_TB_REQUIRED=1 but TensorBoard's reader did not run: {why}"
                );
                eprintln!(
                    "skipped the TensorBoard reader (python3 -m pip install tensorboard): {why}"
                );
                return;
            }
        };
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut theirs: Vec<(String, u64, f32)> = Vec::new();
        for (tag, evs) in got.as_object().unwrap() {
            for e in evs.as_array().unwrap() {
                let v = e[1].as_f64().unwrap() as f32;
                theirs.push((tag.clone(), e[0].as_u64().unwrap(), v));
            }
        }
        theirs.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        assert_eq!(theirs, want);
    }
}
