//! The accuracy benchmark, `scripts/accuracy`, in its smoke mode: every check (A1-A4) runs
//! against the real programs, briefly, so that the command cannot rot. The verdicts are not
//! asserted (they need the full runs and a quiet machine; see docs/accuracy.md): only that
//! the command exits 0 and reports every check with a verdict (rows printed only for
//! comparison, without a target, have none).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use rpcmesh_system_tests as system;

/// The smoke run takes about ten seconds; this only catches a hang.
const SMOKE_TIMEOUT: Duration = Duration::from_secs(180);

#[test]
fn accuracy_smoke_mode_runs_every_check_and_gives_each_a_verdict() {
    let smoke = system::smoke_script(
        "accuracy",
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        SMOKE_TIMEOUT,
    );
    let (run, output) = (&smoke.run, &smoke.run.output);
    let rows: serde_json::Value = serde_json::from_str(&smoke.report("accuracy-", "json")).unwrap();
    let rows = rows.as_array().expect("a list of checks");
    for id in ["A1", "A2", "A3", "A4"] {
        let mine: Vec<&serde_json::Value> = rows.iter().filter(|r| r["id"] == id).collect();
        assert!(!mine.is_empty(), "no {id} in the report\n{output}");
        for r in mine {
            // A row with a target has a verdict; one printed for comparison has "-".
            let compared = r["target"] == "(for comparison)";
            assert!(
                r["verdict"] == "PASS" || r["verdict"] == "MISS" || compared && r["verdict"] == "-",
                "{id} has no verdict: {r}\n{output}"
            );
            assert!(r["measured"].as_str().is_some_and(|m| !m.is_empty()), "{r}");
        }
    }
    assert!(
        run.stdout.contains("| A2 |"),
        "the table is printed\n{output}"
    );
}
