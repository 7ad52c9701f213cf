//! The broker's flags as a user meets them: every duration flag refuses a number without
//! a unit, naming the units.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::CommandFactory;
use rpcmesh_broker::Args;
use rpcmesh_testkit::flags::{bare_durations_accepted, duration_flags};

#[test]
fn every_duration_flag_refuses_a_number_without_a_unit() {
    let cmd = Args::command();
    let flags = duration_flags(&cmd, &["busy-poll"]);
    let names: Vec<&str> = flags.iter().map(|f| f.long.as_str()).collect();
    for known in [
        "--call-timeout",
        "--connect-timeout",
        "--health-interval",
        "--health-timeout",
        "--grace",
        "--idle-timeout",
        "--frame-timeout",
        "--write-timeout",
        "--busy-poll",
        "--pack-wait",
    ] {
        assert!(names.contains(&known), "{known} not found among {names:?}");
    }
    assert_eq!(bare_durations_accepted(&cmd, &flags), Vec::<String>::new());
}

#[test]
fn an_address_to_listen_on_may_be_a_port_alone() {
    use clap::Parser;
    let a = Args::try_parse_from([
        "broker",
        "--listen",
        ":7701",
        "--metrics-listen",
        ":9781",
        "--upstream",
        "p:7800",
    ])
    .unwrap();
    assert_eq!(a.listen, "0.0.0.0:7701".parse().unwrap());
    assert_eq!(a.metrics_listen.0, Some("0.0.0.0:9781".parse().unwrap()));
    let e = Args::try_parse_from(["broker", "--listen", "7701"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("or :PORT for every interface"), "{e}");
}
