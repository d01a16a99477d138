//! `cargo xtask readme` (a step of `ci`): README.md's commands run as written, in a smoke form,
//! and the file paths README.md and `docs/*.md` name exist (issue #41).
//!
//! **Commands.** Every fenced ```` ```sh ```` block of README.md is split into commands (`\`
//! continuations joined, `#` comments dropped, `&&` separating commands). The blocks run in
//! order, each in its own scratch directory under `target/readme-smoke/` holding what the
//! README tells the user to bring: `input.txt` (a copy of README.md), `gpt2-dir` (the tiny
//! GPT-2 fixture, `fsdp-train/tests/fixtures/gpt2-tiny`), `llama-dir` (the tiny Llama fixture,
//! `fsdp-train/tests/fixtures/llama-tiny`) and its `tokenizer.json`; the commands of one block
//! share it, so `sample --checkpoint-dir ck` reads the checkpoint the block's training command
//! wrote.
//! `train_gpt` is built once, release, the way the README builds it: with
//! `-p fsdp-train --features mpi` where OpenMPI is installed (the README's MPI build line; that
//! binary also runs every thread-rank command), else `--bin train_gpt` alone.
//!
//! Rewrite rules (the smoke form; [`smoke_args`]): `cargo run … --bin train_gpt -- ARGS`,
//! `target/release/train_gpt ARGS` and `mpirun … target/release/train_gpt ARGS` run the built
//! binary with ARGS, where `--steps` becomes 2, `--eval-every`, `--checkpoint-every`,
//! `--sample-every`, `--log-every` and `--warmup-steps` 1, `--batch` 1, `--max-new-tokens` 8,
//! and the shape `--d-model 32 --layers 1 --heads 2 --seq-len 32` (only `--seq-len` with
//! `--init-from`, which takes the rest from the weights); `--plan` without `--apply` trains
//! nothing and runs unchanged. `mpirun` gets `--allow-run-as-root` when run as root (the README
//! says so).
//!
//! Skipped, each printed with its reason: commands that need a CUDA GPU (`--device cuda`,
//! `--features cuda`), a launcher that is not installed (`mpirun`, `torchrun`), the
//! `tensorboard` viewer (a server; the event file is checked instead), and `cargo xtask`
//! commands (`ci` runs this step; the others are steps of their own). A `torchrun` command that
//! starts a program that is not a Python script without `--no-python` fails even when skipped
//! (torchrun would run the binary with Python). Any other program is an error: a new kind of
//! README command needs a rule here.
//!
//! A command fails the step on a non-zero exit or a missing promised output: the files of
//! `--metrics`, `--plot`, `--save`, `--profile`; a `step_*` checkpoint in a trained
//! `--checkpoint-dir`; an `events.out.tfevents*` file in `--tensorboard`; `model.safetensors` and `config.json` in `--export-hf`; the token cache
//! `DATA.gpt2.bin` of `--tokenizer gpt2`; a JSON object as the last line of `--json`.
//!
//! **Paths.** Every backticked span without spaces that contains a `/` and starts with one of
//! the repository's top-level directories (not `target`), and every relative Markdown link,
//! must exist (links relative to the file that holds them).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::{cargo, root, run, target_dir};

/// One command of a ```` ```sh ```` block: its words and the README line it starts on.
#[derive(Debug, Clone, PartialEq)]
pub struct ShCommand {
    /// 1-based line in README.md.
    pub line: usize,
    /// The words, quotes removed.
    pub words: Vec<String>,
}

/// The ```` ```sh ```` blocks of a Markdown text, each as its commands.
pub fn sh_blocks(text: &str) -> Vec<Vec<ShCommand>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<(usize, String)>> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        match &mut current {
            None if t.starts_with("```sh") => current = Some(Vec::new()),
            None => {}
            Some(lines) if t.starts_with("```") => {
                blocks.push(commands(lines));
                current = None;
            }
            Some(lines) => lines.push((i + 1, line.to_string())),
        }
    }
    blocks
}

/// Joins `\` continuations, drops comments, splits at `&&`.
fn commands(lines: &[(usize, String)]) -> Vec<ShCommand> {
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (n, line) in lines {
        let (start, mut text) = pending.take().unwrap_or((*n, String::new()));
        let body = line.trim();
        if text.is_empty() && (body.is_empty() || body.starts_with('#')) {
            continue;
        }
        let continued = body.ends_with('\\');
        text.push(' ');
        text.push_str(body.trim_end_matches('\\'));
        // A trailing `&&` continues on the next line too.
        if continued || body.ends_with("&&") {
            pending = Some((start, text));
            continue;
        }
        let words = split_words(&text);
        for part in words.split(|w| w == "&&") {
            if !part.is_empty() {
                out.push(ShCommand {
                    line: start,
                    words: part.to_vec(),
                });
            }
        }
    }
    out
}

/// Shell words: whitespace-separated, single or double quotes grouping, an unquoted word that
/// starts with `#` beginning a comment.
fn split_words(s: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in s.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => word.push(c),
            None if c == '"' || c == '\'' => {
                quote = Some(c);
                in_word = true;
            }
            None if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            None if c == '#' && !in_word => break,
            None => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The value after `flag` in `args`.
fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn has(args: &[String], flag: &str) -> bool {
    args.iter().any(|a| a == flag)
}

/// Sets `flag`'s value (replacing it, or appending the flag).
fn set(args: &mut Vec<String>, flag: &str, v: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = v.to_string(),
        _ => args.extend([flag.to_string(), v.to_string()]),
    }
}

/// `train_gpt` arguments in their smoke form (the module docs list the rules).
pub fn smoke_args(args: &[String]) -> Vec<String> {
    let mut a = args.to_vec();
    if a.first().is_some_and(|s| s == "sample") {
        if has(&a, "--max-new-tokens") {
            set(&mut a, "--max-new-tokens", "8");
        }
        return a;
    }
    if has(&a, "--plan") && !has(&a, "--apply") {
        return a;
    }
    set(&mut a, "--steps", "2");
    for f in [
        "--eval-every",
        "--checkpoint-every",
        "--sample-every",
        "--log-every",
        "--warmup-steps",
    ] {
        if has(&a, f) {
            set(&mut a, f, "1");
        }
    }
    set(&mut a, "--batch", "1");
    if !has(&a, "--init-from") {
        for (f, v) in [("--d-model", "32"), ("--layers", "1"), ("--heads", "2")] {
            set(&mut a, f, v);
        }
    }
    set(&mut a, "--seq-len", "32");
    a
}

/// What to do with one README command.
#[derive(Debug, PartialEq)]
pub enum Plan {
    /// Run `train_gpt` (the built binary) with these arguments, under `launcher` (e.g.
    /// `mpirun -n 4 --oversubscribe`) if any.
    TrainGpt {
        launcher: Vec<String>,
        args: Vec<String>,
    },
    /// The command is the build this step made at its start.
    Built,
    /// Not run, with the reason.
    Skip(String),
}

/// Decides what a README command becomes (`mpi`: OpenMPI is installed; `torchrun`: so is
/// torchrun). `Err` for a command that is wrong as written or has no rule.
pub fn plan(c: &ShCommand, mpi: bool) -> Result<Plan, String> {
    let w = &c.words;
    let prog = w.first().map(String::as_str).unwrap_or("");
    let after = |sep: &str| -> Vec<String> {
        match w.iter().position(|x| x == sep) {
            Some(i) => w[i + 1..].to_vec(),
            None => Vec::new(),
        }
    };
    let cuda_feature = w
        .windows(2)
        .any(|p| p[0] == "--features" && p[1].split(',').any(|f| f.ends_with("cuda")));
    match prog {
        "cargo" => match w.get(1).map(String::as_str) {
            Some("xtask") => Ok(Plan::Skip(format!(
                "`cargo xtask {}`: an xtask command, not run from inside xtask (`ci` runs this \
                 step; the others are CI steps or benches of their own)",
                w[2..].join(" ")
            ))),
            Some("run") if has(w, "train_gpt") => {
                let args = after("--");
                if cuda_feature || value(&args, "--device") == Some("cuda") {
                    return Ok(Plan::Skip("needs a CUDA GPU".into()));
                }
                Ok(Plan::TrainGpt {
                    launcher: Vec::new(),
                    args: smoke_args(&args),
                })
            }
            Some("build") if has(w, "train_gpt") => {
                if cuda_feature {
                    Ok(Plan::Skip("builds for a CUDA GPU".into()))
                } else if w.iter().any(|x| x.contains("mpi")) && !mpi {
                    Ok(Plan::Skip("needs OpenMPI (mpirun and its headers)".into()))
                } else {
                    Ok(Plan::Built)
                }
            }
            _ => Err(format!(
                "README.md:{}: no rule for `{}` (add one in xtask/src/readme.rs)",
                c.line,
                w.join(" ")
            )),
        },
        "mpirun" => {
            let Some(i) = w.iter().position(|x| x.ends_with("/train_gpt")) else {
                return Err(format!(
                    "README.md:{}: mpirun runs something other than train_gpt",
                    c.line
                ));
            };
            if !mpi {
                return Ok(Plan::Skip("needs OpenMPI (mpirun is not installed)".into()));
            }
            Ok(Plan::TrainGpt {
                launcher: w[..i].to_vec(),
                args: smoke_args(&w[i + 1..]),
            })
        }
        "torchrun" => {
            let Some(i) = w
                .iter()
                .skip(1)
                .position(|x| !x.starts_with('-') && !x.chars().all(|c| c.is_ascii_digit()))
                .map(|i| i + 1)
            else {
                return Err(format!("README.md:{}: torchrun without a program", c.line));
            };
            if !w[i].ends_with(".py") && !has(&w[..i], "--no-python") {
                return Err(format!(
                    "README.md:{}: `torchrun … {}` needs --no-python (torchrun runs its program \
                     with Python otherwise)",
                    c.line, w[i]
                ));
            }
            let args = &w[i + 1..];
            if value(args, "--device") == Some("cuda") {
                return Ok(Plan::Skip("needs CUDA GPUs".into()));
            }
            Ok(Plan::Skip(
                "torchrun starts one process per GPU (--backend nccl)".into(),
            ))
        }
        p if p.ends_with("/train_gpt") => {
            if value(&w[1..], "--device") == Some("cuda") {
                return Ok(Plan::Skip("needs a CUDA GPU".into()));
            }
            Ok(Plan::TrainGpt {
                launcher: Vec::new(),
                args: smoke_args(&w[1..]),
            })
        }
        "tensorboard" => Ok(Plan::Skip(
            "a viewer (a web server that runs until stopped); the event file it reads is \
             checked as the output `--tensorboard` promises"
                .into(),
        )),
        _ => Err(format!(
            "README.md:{}: no rule for `{}` (add one in xtask/src/readme.rs)",
            c.line,
            w.join(" ")
        )),
    }
}

/// The outputs a command promises (files or directories, and what to check in them).
fn promised(args: &[String]) -> Vec<(PathBuf, &'static str)> {
    let mut out = Vec::new();
    let sample = args.first().is_some_and(|s| s == "sample");
    for f in ["--metrics", "--plot", "--save", "--profile"] {
        if let Some(p) = value(args, f) {
            out.push((PathBuf::from(p), "file"));
        }
    }
    if let (Some(d), false) = (value(args, "--checkpoint-dir"), sample) {
        out.push((PathBuf::from(d), "checkpoint"));
    }
    if let Some(d) = value(args, "--export-hf") {
        out.push((Path::new(d).join("model.safetensors"), "file"));
        out.push((Path::new(d).join("config.json"), "file"));
    }
    if let Some(d) = value(args, "--tensorboard") {
        out.push((PathBuf::from(d), "tensorboard"));
    }
    if let (Some("gpt2"), Some(data)) = (value(args, "--tokenizer"), value(args, "--data")) {
        out.push((PathBuf::from(format!("{data}.gpt2.bin")), "file"));
    }
    out
}

fn check_promised(dir: &Path, args: &[String]) -> Result<(), String> {
    for (p, kind) in promised(args) {
        let full = dir.join(&p);
        let ok = match kind {
            "checkpoint" => std::fs::read_dir(&full).is_ok_and(|rd| {
                rd.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("step_"))
            }),
            "tensorboard" => std::fs::read_dir(&full).is_ok_and(|rd| {
                rd.flatten().any(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with("events.out.tfevents")
                })
            }),
            _ => std::fs::metadata(&full).is_ok_and(|m| m.is_file() && m.len() > 0),
        };
        if !ok {
            return Err(format!(
                "promised {kind} {} is missing or empty",
                p.display()
            ));
        }
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn tool_runs(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `cargo xtask readme`.
pub fn readme() -> Result<(), String> {
    let root = root();
    let mut failures = check_paths(&root)?;
    let text =
        std::fs::read_to_string(root.join("README.md")).map_err(|e| format!("README.md: {e}"))?;
    let mpi = tool_runs("mpirun");
    let mut build = cargo();
    build.args(["build", "--release", "-p", "fsdp-train"]);
    if mpi {
        build.args(["--features", "mpi"]);
    }
    build.args(["--bin", "train_gpt"]);
    run("readme: build train_gpt (release)", &mut build)?;
    let scratch = target_dir().join("readme-smoke");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(scratch.join("bin")).map_err(|e| format!("{e}"))?;
    // A copy: later builds of target/release/train_gpt do not change what this step runs.
    let bin = scratch.join("bin").join("train_gpt");
    std::fs::copy(target_dir().join("release").join("train_gpt"), &bin)
        .map_err(|e| format!("copying train_gpt: {e}"))?;
    let (mut ran, mut skipped) = (0, 0);
    for (b, block) in sh_blocks(&text).iter().enumerate() {
        let dir = scratch.join(format!("block{}", b + 1));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{e}"))?;
        std::fs::copy(root.join("README.md"), dir.join("input.txt")).map_err(|e| format!("{e}"))?;
        std::os::unix::fs::symlink(
            root.join("fsdp-train/tests/fixtures/gpt2-tiny"),
            dir.join("gpt2-dir"),
        )
        .map_err(|e| format!("{e}"))?;
        let llama = root.join("fsdp-train/tests/fixtures/llama-tiny");
        std::os::unix::fs::symlink(&llama, dir.join("llama-dir")).map_err(|e| format!("{e}"))?;
        std::fs::copy(llama.join("tokenizer.json"), dir.join("tokenizer.json"))
            .map_err(|e| format!("{e}"))?;
        for c in block {
            let shown = c.words.join(" ");
            let plan = match plan(c, mpi) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("xtask: readme: FAIL {e}");
                    failures.push(e);
                    continue;
                }
            };
            match plan {
                Plan::Skip(why) => {
                    skipped += 1;
                    eprintln!(
                        "xtask: readme: SKIPPED README.md:{} `{shown}`: {why}",
                        c.line
                    );
                }
                Plan::Built => {
                    ran += 1;
                    eprintln!(
                        "xtask: readme: ok README.md:{} `{shown}` (the build at the start of this step)",
                        c.line
                    );
                }
                Plan::TrainGpt { mut launcher, args } => {
                    if launcher.first().is_some_and(|p| p == "mpirun") && is_root() {
                        // As the README says: OpenMPI refuses root without it.
                        launcher.push("--allow-run-as-root".into());
                    }
                    let mut cmd = match launcher.split_first() {
                        Some((prog, rest)) => {
                            let mut m = Command::new(prog);
                            m.args(rest).arg(&bin);
                            m
                        }
                        None => Command::new(&bin),
                    };
                    cmd.args(&args).current_dir(&dir);
                    let mut shown = launcher.clone();
                    shown.push("train_gpt".into());
                    shown.extend(args.iter().cloned());
                    let rewritten = shown.join(" ");
                    let start = std::time::Instant::now();
                    let result = cmd
                        .output()
                        .map_err(|e| format!("could not start: {e}"))
                        .and_then(|o| {
                            if !o.status.success() {
                                let err = String::from_utf8_lossy(&o.stderr);
                                return Err(format!(
                                    "{}: {}",
                                    o.status,
                                    err.lines().last().unwrap_or("")
                                ));
                            }
                            if has(&args, "--json") {
                                let out = String::from_utf8_lossy(&o.stdout);
                                let last = out.lines().last().unwrap_or("");
                                serde_json::from_str::<serde_json::Value>(last)
                                    .ok()
                                    .filter(|v| v.is_object())
                                    .ok_or_else(|| {
                                        format!(
                                            "--json: the last line is not a JSON object: {last}"
                                        )
                                    })?;
                            }
                            check_promised(&dir, &args)
                        });
                    ran += 1;
                    match result {
                        Ok(()) => eprintln!(
                            "xtask: readme: ok README.md:{} as `{rewritten}` ({:.1} s)",
                            c.line,
                            start.elapsed().as_secs_f64()
                        ),
                        Err(e) => {
                            let msg = format!("README.md:{} `{rewritten}`: {e}", c.line);
                            eprintln!("xtask: readme: FAIL {msg}");
                            failures.push(msg);
                        }
                    }
                }
            }
        }
    }
    eprintln!(
        "xtask: readme: {ran} commands ran, {skipped} skipped, {} failures",
        failures.len()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("readme failed:\n  {}", failures.join("\n  ")))
    }
}

/// The repository's top-level directories a backticked path may start with.
fn top_dirs(root: &Path) -> Result<Vec<String>, String> {
    let mut dirs = Vec::new();
    for e in std::fs::read_dir(root)
        .map_err(|e| format!("{e}"))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() && name != "target" && (!name.starts_with('.') || name == ".ci") {
            dirs.push(name);
        }
    }
    Ok(dirs)
}

/// The paths a Markdown text names: (1-based line, path as written, relative to the file's
/// directory (links) or to the root (backticked spans)).
pub fn named_paths(text: &str, tops: &[String]) -> Vec<(usize, String, bool)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        for (k, span) in line.split('`').enumerate() {
            // Odd pieces are inside backticks.
            if k % 2 == 1
                && span.contains('/')
                && !span.contains(char::is_whitespace)
                && !span.contains(['*', '<', '>', '…', '$', '{', '|'])
                && tops
                    .iter()
                    .any(|t| span.split('/').next() == Some(t.as_str()))
            {
                // `file.rs::item` names an item of the file.
                let file = span.split("::").next().unwrap_or(span);
                out.push((i + 1, file.to_string(), false));
            }
        }
        let mut rest = line;
        while let Some(p) = rest.find("](") {
            let tail = &rest[p + 2..];
            let end = tail.find(')').unwrap_or(tail.len());
            let target = tail[..end].split('#').next().unwrap_or("");
            if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
                out.push((i + 1, target.to_string(), true));
            }
            rest = &tail[end..];
        }
    }
    out
}

/// `tests/…` and `examples/…` name the workspace's `tests` and `examples` packages or, in a
/// paragraph about one crate, that crate's own `tests/` or `examples/` directory: such a path
/// also counts when a tracked file or directory of some crate ends with it.
fn inside_a_crate(tracked: &[String], p: &str) -> bool {
    let p = p.trim_end_matches('/');
    matches!(p.split('/').next(), Some("tests" | "examples"))
        && tracked
            .iter()
            .any(|f| f.ends_with(&format!("/{p}")) || f.contains(&format!("/{p}/")))
}

/// Every path README.md and `docs/*.md` name exists; returns the failures.
fn check_paths(root: &Path) -> Result<Vec<String>, String> {
    let tops = top_dirs(root)?;
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .map_err(|e| format!("docs/: {e}"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let tracked: Vec<String> = Command::new("git")
        .args(["ls-files"])
        .current_dir(root)
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let mut failures = Vec::new();
    let mut checked = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let rel = f.strip_prefix(root).unwrap_or(f).display().to_string();
        for (line, p, link) in named_paths(&text, &tops) {
            let base = if link {
                f.parent().unwrap_or(root)
            } else {
                root
            };
            checked += 1;
            let found = base.join(&p).exists() || (!link && inside_a_crate(&tracked, &p));
            if !found {
                let msg = format!("{rel}:{line}: `{p}` does not exist");
                eprintln!("xtask: readme: FAIL {msg}");
                failures.push(msg);
            }
        }
    }
    eprintln!(
        "xtask: readme: {checked} file paths named in README.md and docs/*.md checked, {} missing",
        failures.len()
    );
    Ok(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn blocks_split_into_commands() {
        let md = "text\n```sh\n# a comment\ncargo run --release --bin train_gpt -- --data x \\\n    --steps 300  # trailing\ncargo build -p a &&\n    mpirun -n 4 t/train_gpt --x \"a b\"\n```\n```rust\nnot sh\n```\n";
        let b = sh_blocks(md);
        assert_eq!(b.len(), 1);
        let c = &b[0];
        assert_eq!(c.len(), 3);
        assert_eq!(c[0].line, 4);
        assert_eq!(
            c[0].words,
            words("cargo run --release --bin train_gpt -- --data x --steps 300")
        );
        assert_eq!(c[1].words, words("cargo build -p a"));
        assert_eq!(c[2].words.last().unwrap(), "a b");
    }

    #[test]
    fn smoke_form() {
        let a = smoke_args(&words(
            "--data input.txt --steps 300 --eval-every 100 --plot l.svg",
        ));
        assert_eq!(value(&a, "--steps"), Some("2"));
        assert_eq!(value(&a, "--eval-every"), Some("1"));
        assert_eq!(value(&a, "--d-model"), Some("32"));
        assert_eq!(value(&a, "--plot"), Some("l.svg"));
        let a = smoke_args(&words("--init-from m --seq-len 256"));
        assert_eq!(value(&a, "--seq-len"), Some("32"));
        assert!(!has(&a, "--d-model"));
        let plan_only = words("--plan --d-model 12288 --ranks 512");
        assert_eq!(smoke_args(&plan_only), plan_only);
        let s = smoke_args(&words("sample --checkpoint-dir ck --max-new-tokens 100"));
        assert_eq!(value(&s, "--max-new-tokens"), Some("8"));
    }

    #[test]
    fn plans() {
        let c = |s: &str| ShCommand {
            line: 1,
            words: words(s),
        };
        assert!(matches!(
            plan(&c("cargo xtask ci"), true),
            Ok(Plan::Skip(_))
        ));
        assert!(matches!(
            plan(&c("cargo run --release -p fsdp-train --features cuda --bin train_gpt -- --device cuda"), true),
            Ok(Plan::Skip(_))
        ));
        let e = plan(
            &c("torchrun --nproc-per-node 8 target/release/train_gpt --device cuda"),
            true,
        );
        assert!(e.unwrap_err().contains("--no-python"));
        assert!(matches!(
            plan(&c("torchrun --nproc-per-node 8 --no-python target/release/train_gpt --device cuda"), true),
            Ok(Plan::Skip(_))
        ));
        match plan(
            &c("mpirun -n 4 --oversubscribe target/release/train_gpt --backend mpi"),
            true,
        ) {
            Ok(Plan::TrainGpt { launcher, args }) => {
                assert_eq!(launcher, words("mpirun -n 4 --oversubscribe"));
                assert_eq!(value(&args, "--backend"), Some("mpi"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            plan(&c("mpirun -n 4 target/release/train_gpt"), false),
            Ok(Plan::Skip(_))
        ));
        assert!(plan(&c("rm -rf /"), true).is_err());
        assert!(matches!(
            plan(&c("target/release/train_gpt --device cuda --ranks 4"), true),
            Ok(Plan::Skip(_))
        ));
        assert!(matches!(
            plan(&c("target/release/train_gpt --ranks 4"), true),
            Ok(Plan::TrainGpt { .. })
        ));
        assert!(matches!(
            plan(&c("tensorboard --logdir runs"), true),
            Ok(Plan::Skip(_))
        ));
    }

    #[test]
    fn paths_in_spans_and_links() {
        let tops = vec!["docs".to_string(), "fsdp-core".to_string()];
        let md = "see `fsdp-core/benches/x.rs` and `target/q/` and `a b/c` and [a](docs/A.md#x)\n```sh\n`docs/in-fence`\n```\n";
        let p = named_paths(md, &tops);
        assert_eq!(
            p,
            vec![
                (1, "fsdp-core/benches/x.rs".to_string(), false),
                (1, "docs/A.md".to_string(), true)
            ]
        );
    }
}
