//! The capacity lab, `scripts/capacity-lab`, in its smoke mode: the namespaces, the shaped
//! links, the servers in their namespaces and `driver capacity` against them all run,
//! briefly, so that the command cannot rot: one experiment comparing compression, one
//! comparing TLS (two brokers, a provider listening with TLS and plaintext, a throwaway
//! CA). The figures are not asserted (they need the full runs; see docs/capacity.md): only
//! that it exits 0 and that its summary has both settings' capacity and CPU per call of
//! every program, read across the namespaces.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use rpcmesh_system_tests as system;

/// The smoke run takes about fifteen seconds; this only catches a hang.
const SMOKE_TIMEOUT: Duration = Duration::from_secs(240);

#[test]
fn capacity_lab_smoke_mode_runs_the_search_across_namespaces() {
    let smoke = system::smoke_script(
        "capacity-lab",
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        SMOKE_TIMEOUT,
    );
    let output = &smoke.run.output;
    let rows: serde_json::Value =
        serde_json::from_str(&smoke.report("capacity-lab-", "json")).unwrap();
    let rows = rows.as_array().expect("a list of experiments");
    let compared: Vec<&str> = rows.iter().filter_map(|r| r["compared"].as_str()).collect();
    assert_eq!(compared, ["compression", "tls"], "{output}");
    for r in rows {
        for k in ["off", "on"] {
            assert!(
                r[format!("capacity_{k}")].as_f64().is_some(),
                "{r}\n{output}"
            );
            for role in ["driver", "broker", "provider"] {
                assert!(
                    r[format!("cpu_{k}")][role].as_f64().is_some(),
                    "{k} {role}: {r}\n{output}"
                );
            }
        }
    }
    // A verdict on TLS (which one depends on the machine: at the smoke's low --max-rate
    // both settings often pass).
    assert!(
        rows[1]["verdict"].as_str().unwrap_or("").contains("TLS"),
        "{output}"
    );
    assert!(smoke.run.stdout.contains("| experiment |"), "{output}");
    // Nothing is left behind: the lab's namespaces (`rpcm<pid>-<host>`) are gone. Only its
    // own are looked for: a deployment rehearsal's (`rpcm-<machine>`) may exist meanwhile.
    let lab = system::lab_namespaces_left("rpcm");
    assert!(lab.is_empty(), "namespaces left: {lab:?}");
}
