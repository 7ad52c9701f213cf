//! The driver's duration flags, of a run and of every subcommand (`capacity`'s steps and
//! its SLO included), refuse a number without a unit, naming the units.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::{CommandFactory, Parser};
use rpcmesh_driver::Args;
use rpcmesh_testkit::flags::{bare_durations_accepted, duration_flags};

#[test]
fn every_duration_flag_refuses_a_number_without_a_unit() {
    let cmd = Args::command();
    let flags = duration_flags(&cmd, &[]);
    let found: Vec<String> = flags.iter().map(ToString::to_string).collect();
    for known in [
        "driver --duration",
        "driver --warmup",
        "driver --timeout",
        "driver --ramp",
        "driver --step-duration",
        "driver --linger",
        "driver capacity --step-duration",
        "driver capacity --time-limit",
    ] {
        assert!(
            found.iter().any(|f| f == known),
            "{known} not found among {found:?}"
        );
    }
    assert_eq!(bare_durations_accepted(&cmd, &flags), Vec::<String>::new());
}

#[test]
fn an_slo_bound_takes_a_unit() {
    let e = Args::try_parse_from(["driver", "capacity", "--slo", "p99<=5"])
        .expect_err("p99<=5 has no unit")
        .to_string();
    assert!(e.contains("has no unit"), "{e}");
    assert!(Args::try_parse_from(["driver", "capacity", "--slo", "p99<=5ms"]).is_ok());
}
