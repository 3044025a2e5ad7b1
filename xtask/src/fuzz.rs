//! `cargo xtask fuzz`: every cargo-fuzz target under fuzz/fuzz_targets, each for a bounded
//! time, failing on a crash, a timeout or an out-of-memory input with the reproducer's path.
//!
//! Built with nightly (libFuzzer's instrumentation) and no sanitizer: the parsers are safe
//! Rust, so what a run can find is a panic, an overflow (the targets build with debug
//! assertions), a hang or a blow-up, and ASan would halve the executions and double the
//! build for none of those. Everything a run makes stays under target/fuzz/: the build,
//! the growing corpus (corpus/NAME), the findings (artifacts/NAME), the logs (logs/NAME.log)
//! and the table of the last run (summary.md). The seeds
//! in fuzz/seeds/NAME are only read.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Instant, SystemTime},
};

use anyhow::{Context as _, Result, bail};

use crate::cmd;

/// What `cargo xtask fuzz` was given.
#[derive(Clone, Debug)]
pub struct FuzzOptions {
    /// How long each target runs (libFuzzer's -max_total_time).
    pub seconds: u64,
    /// The targets to run; empty: all of them.
    pub targets: Vec<String>,
}

/// One input may take this long before libFuzzer calls it a hang (-timeout): every parser
/// answers a few KiB in well under a millisecond.
const INPUT_TIMEOUT_SECS: u32 = 10;
/// Memory one run may hold (-rss_limit_mb, -malloc_limit_mb): a parser of a few KiB of
/// text needs a small fraction of it.
const RSS_LIMIT_MB: u32 = 1024;

/// What libFuzzer reported at the end of one target's run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunStats {
    pub execs_per_sec: Option<u64>,
    pub cov: Option<u64>,
    pub ft: Option<u64>,
    pub corpus: Option<u64>,
}

/// The fuzz targets: the file stems under fuzz/fuzz_targets, sorted.
pub fn targets() -> Result<Vec<String>> {
    let dir = fuzz_dir().join("fuzz_targets");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok()?.path().file_name()?.to_str().map(str::to_owned))
        .filter_map(|n| n.strip_suffix(".rs").map(str::to_owned))
        .collect();
    names.sort();
    Ok(names)
}

fn fuzz_dir() -> PathBuf {
    crate::workspace_root().join("fuzz")
}

fn out_dir() -> PathBuf {
    crate::target_dir().join("fuzz")
}

/// `cargo +nightly fuzz SUB` with the build settings every call must share (cargo-fuzz
/// rebuilds when they differ between `build` and `run`).
fn cargo_fuzz(sub: &str) -> Command {
    let mut c = Command::new("cargo");
    c.current_dir(crate::workspace_root())
        // Our own (stable) cargo's settings must not leak into the nightly one.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO")
        .args(["+nightly", "fuzz", sub, "--sanitizer", "none"])
        // Many units: the build (kube, k8s-openapi) is most of a short run's time.
        .args(["--codegen-units", "16"])
        .arg("--target-dir")
        .arg(out_dir());
    c
}

/// Builds every target, then runs the chosen ones one after another.
pub fn fuzz(o: &FuzzOptions) -> Result<()> {
    let all = targets()?;
    for t in &o.targets {
        if !all.contains(t) {
            bail!("no fuzz target {t:?}; there are: {}", all.join(", "));
        }
    }
    let chosen: Vec<&String> = all
        .iter()
        .filter(|t| o.targets.is_empty() || o.targets.contains(t))
        .collect();
    let started = Instant::now();
    let mut build = cargo_fuzz("build");
    println!("fuzz: building `{}`", cmd::describe(&build));
    cmd::run(&mut build).context("building the fuzz targets failed")?;
    println!("fuzz: built in {:.0} s", started.elapsed().as_secs_f64());

    let mut failed = Vec::new();
    let mut table = String::from(
        "| target | execs/s | cov | ft | corpus | result |\n|---|---|---|---|---|---|\n",
    );
    for name in chosen {
        let (stats, result) = run_one(name, o.seconds)?;
        let show = |v: Option<u64>| v.map_or("?".to_owned(), |v| v.to_string());
        let verdict = if result.is_ok() {
            "no findings"
        } else {
            "FAILED (see above)"
        };
        table.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {verdict} |\n",
            show(stats.execs_per_sec),
            show(stats.cov),
            show(stats.ft),
            show(stats.corpus),
        ));
        if let Err(e) = result {
            eprintln!("fuzz: {name}: {e}");
            failed.push(name.clone());
        }
    }
    let table = format!(
        "{table}\n{} s per target; the whole run took {:.0} s.\n",
        o.seconds,
        started.elapsed().as_secs_f64()
    );
    println!("\n{table}");
    fs::write(out_dir().join("summary.md"), &table).context("writing the fuzz summary")?;
    if !failed.is_empty() {
        bail!(
            "fuzz: {} found a failing input (see above)",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Runs one target; the error names the reproducer libFuzzer wrote.
fn run_one(name: &str, seconds: u64) -> Result<(RunStats, Result<()>)> {
    let out = out_dir();
    let corpus = out.join("corpus").join(name);
    let artifacts = out.join("artifacts").join(name);
    let log_path = out.join("logs").join(format!("{name}.log"));
    for dir in [&corpus, &artifacts, &out.join("logs")] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut run = cargo_fuzz("run");
    run.arg(name).arg(&corpus);
    // libFuzzer adds what it finds to the first folder only; the seeds stay as committed.
    let seeds = fuzz_dir().join("seeds").join(name);
    if seeds.is_dir() {
        run.arg(&seeds);
    }
    run.arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-timeout={INPUT_TIMEOUT_SECS}"))
        .arg(format!("-rss_limit_mb={RSS_LIMIT_MB}"))
        .arg(format!("-malloc_limit_mb={RSS_LIMIT_MB}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-print_final_stats=1");
    let dict = fuzz_dir().join("dicts").join(format!("{name}.dict"));
    if dict.is_file() {
        run.arg(format!("-dict={}", dict.display()));
    }
    println!("fuzz: {name} for {seconds} s (log: {})", log_path.display());
    let log = fs::File::create(&log_path)?;
    let since = SystemTime::now();
    let status = run
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .with_context(|| format!("cannot start `{}`", cmd::describe(&run)))?;
    let text = fs::read_to_string(&log_path).unwrap_or_default();
    let stats = parse_stats(&text);
    if status.success() {
        return Ok((stats, Ok(())));
    }
    // The log's end says what went wrong (the panic message, the stack).
    let lines: Vec<&str> = text.lines().collect();
    for line in &lines[lines.len().saturating_sub(40)..] {
        eprintln!("  {line}");
    }
    let found = newest_since(&artifacts, since);
    let why = match found {
        Some(path) => anyhow::anyhow!(
            "{status}; reproducer: {} (replay: {} {})",
            path.display(),
            binary(name).display(),
            path.display()
        ),
        None => anyhow::anyhow!(
            "{status}, and no reproducer was written; see {}",
            log_path.display()
        ),
    };
    Ok((stats, Err(why)))
}

/// A built target: run with a file, it replays that input alone.
fn binary(name: &str) -> PathBuf {
    let triple = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    out_dir().join(triple).join("release").join(name)
}

/// The newest file in `dir` written after `since`.
fn newest_since(dir: &Path, since: SystemTime) -> Option<PathBuf> {
    fs::read_dir(dir)
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let modified = e.metadata().ok()?.modified().ok()?;
            (modified >= since).then(|| (modified, e.path()))
        })
        .max()
        .map(|(_, p)| p)
}

/// The numbers of libFuzzer's last status line (`#N DONE cov: C ft: F corp: K/Sb ...
/// exec/s: E ...`), or of its last line with coverage when the run ended early.
pub fn parse_stats(log: &str) -> RunStats {
    let Some(line) = log
        .lines()
        .rfind(|l| l.starts_with('#') && l.contains(" cov: "))
    else {
        return RunStats::default();
    };
    let after = |key: &str| -> Option<u64> {
        let mut words = line.split_whitespace();
        words.find(|w| *w == key)?;
        let value = words.next()?;
        value.split('/').next()?.parse().ok()
    };
    RunStats {
        execs_per_sec: after("exec/s:"),
        cov: after("cov:"),
        ft: after("ft:"),
        corpus: after("corp:"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_status_line_gives_the_numbers() {
        let log = "INFO: Seed: 1\n\
            #2\tINITED cov: 10 ft: 11 corp: 1/1b exec/s: 0 rss: 30Mb\n\
            #4096\tpulse  cov: 500 ft: 900 corp: 40/2Kb lim: 100 exec/s: 2048 rss: 40Mb\n\
            #60000\tDONE   cov: 812 ft: 2301 corp: 95/11Kb lim: 4096 exec/s: 1999 rss: 61Mb\n\
            Done 60000 runs in 31 second(s)\n";
        assert_eq!(
            parse_stats(log),
            RunStats {
                execs_per_sec: Some(1999),
                cov: Some(812),
                ft: Some(2301),
                corpus: Some(95),
            }
        );
        assert_eq!(parse_stats("no status here\n"), RunStats::default());
    }

    /// cargo builds only the targets fuzz/Cargo.toml lists: a file without its `[[bin]]`
    /// would be found by the runner and then fail to build.
    #[test]
    fn every_target_file_is_a_target() {
        let names = targets().expect("fuzz/fuzz_targets is readable");
        assert!(names.iter().any(|n| n == "manifest_file"), "{names:?}");
        assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted: {names:?}");
        let manifest = fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
        for name in &names {
            assert!(
                manifest.contains(&format!("path = \"fuzz_targets/{name}.rs\"")),
                "fuzz/Cargo.toml has no [[bin]] for fuzz_targets/{name}.rs"
            );
        }
    }
}
