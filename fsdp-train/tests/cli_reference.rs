//! The built `train_gpt` against `docs/CLI.md` and the README (issue #41): every flag that
//! `train_gpt --help` and `train_gpt sample --help` print appears in the reference, and the
//! README links it. (The reference itself is rendered from the clap definitions and compared
//! byte for byte by the unit test `cli_doc::tests::cli_reference`; this test reads the real
//! binary's output, the way a user sees it.)

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("fsdp-train is one level below the workspace root")
        .to_path_buf()
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_train_gpt"))
        .args(args)
        .output()
        .expect("train_gpt runs");
    assert!(out.status.success(), "train_gpt {args:?} failed: {out:?}");
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The `--long` names of the flag lines of a `--help` text: indented lines whose first word is
/// `--long…`, or `-s,` followed by `--long…` (not the `- value:` lines of possible values).
fn flags(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in help.lines() {
        if !line.starts_with(' ') {
            continue;
        }
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        let long = if first.starts_with("--") {
            first
        } else if first.len() == 3 && first.starts_with('-') && first.ends_with(',') {
            words.next().unwrap_or("")
        } else {
            continue;
        };
        let name: String = long
            .trim_start_matches("--")
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if long.starts_with("--") && !name.is_empty() {
            out.push(format!("--{name}"));
        }
    }
    out
}

#[test]
fn every_help_flag_is_in_the_reference_and_the_readme_links_it() {
    let doc = std::fs::read_to_string(root().join("docs/CLI.md")).expect("docs/CLI.md exists");
    let mut missing = Vec::new();
    for args in [&["--help"][..], &["sample", "--help"]] {
        let names = flags(&help(args));
        assert!(
            names.len() > 5,
            "too few flags parsed from train_gpt {args:?}: {names:?}"
        );
        for n in names {
            if !doc.contains(&format!("`{n}`")) && !doc.contains(&format!("`{n} ")) {
                missing.push(format!("{n} (train_gpt {})", args.join(" ")));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "flags of --help missing from docs/CLI.md (run `cargo xtask cli-doc`): {missing:?}"
    );
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        readme.contains("(docs/CLI.md)"),
        "README.md does not link docs/CLI.md"
    );
}

#[test]
fn flag_lines_are_parsed() {
    let h = "Model:\n      --model <MODEL>\n          Model preset\n          - mini: see --tied\n  -h, --help\n          Print help\n      --tied\n";
    assert_eq!(flags(h), ["--model", "--help", "--tied"]);
}
