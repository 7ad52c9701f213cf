//! The provider's flags as a user meets them: every duration flag, and every duration of a
//! `--service-time` distribution, refuses a number without a unit, naming the units.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::{CommandFactory, Parser};
use rpcmesh_provider::config::Args;
use rpcmesh_testkit::flags::{bare_durations_accepted, duration_flags};

#[test]
fn every_duration_flag_refuses_a_number_without_a_unit() {
    let cmd = Args::command();
    let flags = duration_flags(&cmd, &[]);
    let names: Vec<&str> = flags.iter().map(|f| f.long.as_str()).collect();
    for known in [
        "--grace",
        "--idle-timeout",
        "--frame-timeout",
        "--write-timeout",
        "--service-time",
    ] {
        assert!(names.contains(&known), "{known} not found among {names:?}");
    }
    assert_eq!(bare_durations_accepted(&cmd, &flags), Vec::<String>::new());
}

#[test]
fn every_duration_of_a_service_time_distribution_takes_a_unit() {
    for bare in [
        "5",
        "fixed:5",
        "exp:5",
        "uniform:1,9ms",
        "uniform:1ms,9",
        "lognormal:5,50ms",
        "lognormal:5ms,50",
    ] {
        let e = Args::try_parse_from(["provider", "--service-time", bare])
            .expect_err(bare)
            .to_string();
        assert!(e.contains("has no unit"), "{bare}: {e}");
    }
    for ok in [
        "0",
        "5ms",
        "exp:5ms",
        "uniform:1ms,9ms",
        "lognormal:5ms,50ms",
    ] {
        assert!(
            Args::try_parse_from(["provider", "--service-time", ok]).is_ok(),
            "{ok}"
        );
    }
}

#[test]
fn an_address_to_listen_on_may_be_a_port_alone() {
    let a = Args::try_parse_from(["provider", "--listen", ":7801", "--metrics-listen", ":9781"])
        .unwrap();
    assert_eq!(a.listen, "0.0.0.0:7801".parse().unwrap());
    assert_eq!(a.metrics_listen.0, Some("0.0.0.0:9781".parse().unwrap()));
}
