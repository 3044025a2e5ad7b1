//! Running `fastpath inspect` and `fastpath explain` from the tests and picking their JSON
//! apart.
#![allow(dead_code)]

use std::collections::BTreeSet;

use serde_json::Value;

const FASTPATH: &str = env!("CARGO_BIN_EXE_fastpath");

/// `fastpath ARGS`' stdout; fails the test on a non-zero exit.
pub fn tool(args: &[&str]) -> String {
    let out = xtask::seccomp::command(FASTPATH)
        .args(args)
        .output()
        .expect("fastpath runs");
    assert!(
        out.status.success(),
        "fastpath {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `fastpath ARGS -o json`, parsed.
pub fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let out = tool(&all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}):\n{out}"))
}

/// The row of `frontend` in `inspect services` JSON.
pub fn row<'a>(rows: &'a Value, frontend: &str) -> &'a Value {
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r["frontend"] == frontend)
        .unwrap_or_else(|| panic!("no row for {frontend} in {rows:#}"))
}

/// A row's backend addresses.
pub fn addresses(row: &Value) -> BTreeSet<String> {
    row["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["address"].as_str().unwrap().to_string())
        .collect()
}

/// `inspect services` once every row agrees with the model: the rules of a sync can be in
/// the kernel a moment before the daemon publishes that sync's model. Waits at most `secs`.
pub fn services_in_sync(admin: &str, secs: u64) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let rows = json(&["inspect", "services", "--admin", admin]);
        let synced = rows
            .as_array()
            .is_some_and(|r| !r.is_empty() && r.iter().all(|r| r["in_sync"] == true));
        if synced {
            return rows;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "inspect services never agreed with the model:\n{rows:#}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
