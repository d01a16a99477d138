//! `docs/CLI.md`, the flags reference, rendered from the clap definitions ([`crate::cli::Cli`]
//! and [`crate::sample::SampleCli`]) and kept in sync by the test `cli_reference` below (test
//! builds only: the binary itself carries none of this).
//!
//! The test renders the reference and fails when `docs/CLI.md` differs;
//! `UPDATE_CLI_DOC=1 cargo test -p fsdp-train --bin train_gpt cli_reference` (or
//! `cargo xtask cli-doc`) rewrites the file instead. Every subcommand gets a section; inside it,
//! the flags are grouped under the headings `--help` prints, in `--help`'s order, one table row
//! per flag: its spelling with the value it takes, its default, its help text on one line (and
//! the possible values with theirs).

use clap::builder::PossibleValue;
use clap::{Arg, ArgAction, Command, CommandFactory};

/// Where the reference lives, from the workspace root.
pub const PATH: &str = "docs/CLI.md";

/// The whole of `docs/CLI.md`.
pub fn render() -> String {
    let mut out = String::from(
        "# `train_gpt` command-line reference\n\n\
         <!-- Generated from the clap definitions (fsdp-train/src/cli.rs and the argument groups it \
         flattens, fsdp-train/src/sample.rs) by `cargo xtask cli-doc`; `cargo test` fails when this \
         file differs from them. Edit the help texts there, not this file. -->\n\n\
         Every flag of `train_gpt --help` and `train_gpt sample --help`, grouped as `--help` \
         groups them. A flag without a default is off (switches) or unset (values); where the \
         default depends on other flags, the meaning says so. The README's walk-through \
         ([README.md](../README.md)) shows the flags in use.\n",
    );
    section(&mut out, "train_gpt", crate::cli::Cli::command());
    section(
        &mut out,
        "train_gpt sample",
        crate::sample::SampleCli::command(),
    );
    out
}

/// One command: its description, usage line and one table per help heading.
fn section(out: &mut String, name: &str, mut cmd: Command) {
    cmd.build();
    out.push_str(&format!("\n## `{name}`\n\n"));
    let about = cmd
        .get_long_about()
        .or(cmd.get_about())
        .map(|a| one_line(&a.to_string()))
        .unwrap_or_default();
    if !about.is_empty() {
        out.push_str(&format!("{about}\n\n"));
    }
    out.push_str(&format!("Usage: `{name} [OPTIONS]`\n"));
    // `--help` prints the arguments without a heading first ("Options"), then each heading in
    // the order of its first argument.
    let args: Vec<&Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !a.is_positional())
        .collect();
    let mut headings: Vec<Option<&str>> = vec![None];
    for a in &args {
        if !headings.contains(&a.get_help_heading()) {
            headings.push(a.get_help_heading());
        }
    }
    for heading in headings {
        let group: Vec<&&Arg> = args
            .iter()
            .filter(|a| a.get_help_heading() == heading)
            .collect();
        if group.is_empty() {
            continue;
        }
        out.push_str(&format!(
            "\n### {}\n\n| flag | default | meaning |\n| --- | --- | --- |\n",
            heading.unwrap_or("Options")
        ));
        for a in group {
            out.push_str(&format!(
                "| {} | {} | {} |\n",
                cell(&spelling(a)),
                default(a),
                meaning(a)
            ));
        }
    }
}

/// `-s, --long <VALUE>` as `--help` spells it, in code.
fn spelling(a: &Arg) -> String {
    let mut s = String::new();
    if let Some(c) = a.get_short() {
        s.push_str(&format!("`-{c}`, "));
    }
    let long = a.get_long().expect("every train_gpt flag has a long name");
    let takes_value = matches!(a.get_action(), ArgAction::Set | ArgAction::Append);
    let value = if takes_value {
        let names: Vec<String> = a
            .get_value_names()
            .map(|n| n.iter().map(|n| n.to_string()).collect())
            .unwrap_or_else(|| vec![a.get_id().as_str().to_uppercase()]);
        let v = format!("<{}>", names.join("> <"));
        match a.get_num_args() {
            Some(r) if r.min_values() == 0 => format!(" [{v}]"),
            _ => format!(" {v}"),
        }
    } else {
        String::new()
    };
    s.push_str(&format!("`--{long}{value}`"));
    s
}

fn default(a: &Arg) -> String {
    let d: Vec<String> = a
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    let shown = match d.as_slice() {
        [] => return "".into(),
        [one] if one.is_empty() => "\"\"".to_string(),
        _ => d.join(", "),
    };
    // A switch's `false` says nothing a reader needs.
    if matches!(a.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return String::new();
    }
    format!("`{}`", shown.replace('|', "\\|"))
}

fn meaning(a: &Arg) -> String {
    let help = a
        .get_long_help()
        .or(a.get_help())
        .map(|h| one_line(&h.to_string()))
        .unwrap_or_default();
    let values: Vec<PossibleValue> = match a.get_action() {
        ArgAction::Set | ArgAction::Append => a
            .get_possible_values()
            .into_iter()
            .filter(|v| !v.is_hide_set())
            .collect(),
        _ => Vec::new(),
    };
    let mut s = cell(&help);
    if !values.is_empty() {
        let list: Vec<String> = values
            .iter()
            .map(|v| match v.get_help() {
                Some(h) => format!("`{}`: {}", v.get_name(), cell(&one_line(&h.to_string()))),
                None => format!("`{}`", v.get_name()),
            })
            .collect();
        if !s.is_empty() && !s.ends_with('.') {
            s.push('.');
        }
        s.push_str(&format!(" Values: {}.", list.join("; ")));
    }
    s.trim().to_string()
}

/// Whitespace runs (line breaks of the doc comments included) as one space.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Text safe inside a table cell.
fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::{render, PATH};

    fn doc_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("fsdp-train is one level below the workspace root")
            .join(PATH)
    }

    /// `docs/CLI.md` is what the clap definitions render; `UPDATE_CLI_DOC=1` rewrites it.
    #[test]
    fn cli_reference() {
        let want = render();
        let path = doc_path();
        if std::env::var_os("UPDATE_CLI_DOC").is_some_and(|v| v != "0") {
            std::fs::write(&path, &want).unwrap();
            eprintln!("cli_reference: wrote {}", path.display());
            return;
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        if have != want {
            let first = have
                .lines()
                .zip(want.lines())
                .position(|(h, w)| h != w)
                .unwrap_or(have.lines().count().min(want.lines().count()));
            panic!(
                "{} is out of date with the clap definitions (first difference at line {}: have \
                 {:?}, want {:?}); regenerate it with `cargo xtask cli-doc` (or \
                 `UPDATE_CLI_DOC=1 cargo test -p fsdp-train --bin train_gpt cli_reference`)",
                path.display(),
                first + 1,
                have.lines().nth(first),
                want.lines().nth(first),
            );
        }
    }

    /// Every flag of both commands has a row.
    #[test]
    fn every_flag_has_a_row() {
        use clap::CommandFactory;
        let doc = render();
        for mut cmd in [
            crate::cli::Cli::command(),
            crate::sample::SampleCli::command(),
        ] {
            cmd.build();
            for a in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                let long = format!("`--{}", a.get_long().unwrap());
                let rows = doc
                    .lines()
                    .filter(|l| {
                        l.starts_with(&format!("| {long}")) || l.contains(&format!(", {long}"))
                    })
                    .count();
                assert!(rows >= 1, "{long} has no row");
            }
        }
        assert!(
            !doc.contains("fsdp-core/mpi"),
            "the MPI build is `-p fsdp-train --features mpi`"
        );
    }
}
