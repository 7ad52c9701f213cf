//! `driver capacity`'s flags ([`CapacityArgs`], in [`crate::config`] with the driver's
//! other commands) validated into [`CapacityConfig`]: the load every step offers, the
//! planner's [`Plan`], the programs on the path to read, and the local mesh's provider.
//! What only the driver knows is checked here (which rates its pacer keeps, which
//! settings need the extension flags, what shapes a local provider); the planner checks
//! its own flags.

use std::net::SocketAddr;

use rpcmesh_capacity::{OutputArgs, Plan};
use rpcmesh_common::cli::ConfigProblems;
use rpcmesh_wire::compress::CompressionConfig;

use crate::config::{CapacityArgs, DriverConfig, check_rate};
use crate::pacer::Pacing;
use rpcmesh_provider::service::ServiceTime;

/// The pacer of a capacity step unless told otherwise: lean. The exact pacer spins up to
/// a core, which on a machine shared with the system under test is taken from it; a lean
/// pacer's lateness (tens to hundreds of µs) is far below any SLO worth searching for,
/// and is reported per step as the start lag.
pub const DEFAULT_CAPACITY_PACING: Pacing = Pacing::Lean;

/// The plaintext way through the path, when `--compare-tls` compares it with the load's
/// own (TLS) one: whom it calls and which programs it reads.
#[derive(Debug, Clone, Default)]
pub struct PlainPath {
    /// Targets without TLS (`--plain-target`, or the local plaintext mesh's broker).
    pub targets: Vec<String>,
    /// `/metrics` endpoints on it, by role.
    pub probes: Vec<(String, SocketAddr)>,
}

/// Validated capacity settings.
#[derive(Debug, Clone)]
pub struct CapacityConfig {
    /// The load of every step (its schedule, stop and warm-up are set per step).
    pub load: DriverConfig,
    /// Compression when on (for `--compress on` or the comparison's second search).
    pub compression_on: CompressionConfig,
    /// The experiment.
    pub plan: Plan,
    /// `/metrics` endpoints on the path, by role.
    pub probes: Vec<(String, SocketAddr)>,
    /// With `--compare-tls`: the plaintext path (the load's own, above, is the TLS one).
    /// For the local mesh it is filled in once the meshes run.
    pub plain: Option<PlainPath>,
    /// Flags of the local mesh's provider.
    pub provider_flags: Vec<String>,
    /// Where the report goes.
    pub outputs: OutputArgs,
}

impl CapacityConfig {
    /// Checks every setting of `args` and lists all problems at once.
    pub fn new(args: &CapacityArgs) -> Result<CapacityConfig, ConfigProblems> {
        let mut p = ConfigProblems::default();
        let load = args.load.config(DEFAULT_CAPACITY_PACING, &mut p);
        let compression_on = match &load.compression {
            Some(c) => *c,
            None => args
                .load
                .compression
                .config(true, &mut p)
                .unwrap_or_default(),
        };
        p.check(args.plan.compare_compression && args.load.v1, || {
            "--compare-compression needs the extension flags: drop --v1".into()
        });
        let plan = args.plan.plan(&mut p);
        for (_, r) in args.plan.rates() {
            check_rate(r, &mut p);
        }
        let local = load.targets.is_empty();
        p.check(
            !local && (args.service_time.is_some() || args.service_work),
            || "--service-time and --service-work shape the local mesh's provider: drop --target, or set them on your provider".into(),
        );
        if let Some(Err(e)) = args.service_time.as_deref().map(str::parse::<ServiceTime>) {
            p.check(true, || format!("--service-time {e}"));
        }
        p.check(args.service_work && args.service_time.is_none(), || {
            "--service-work burns the provider's service time on the CPU, and there is none: add --service-time (e.g. 20us), or drop --service-work".into()
        });
        args.load.check_compression_tuning(
            load.compression.is_some() || args.plan.compare_compression,
            "--compress on or --compare-compression",
            &mut p,
        );
        let mut provider_flags = Vec::new();
        if let Some(t) = &args.service_time {
            provider_flags.extend(["--service-time".to_string(), t.clone()]);
        }
        if args.service_work {
            provider_flags.push("--service-work".into());
        }
        let probes = by_role(&args.broker_metrics, &args.provider_metrics);
        let plain = plain_path(args, &load, &probes, &mut p);
        p.into_result(CapacityConfig {
            load,
            compression_on,
            plan,
            probes,
            plain,
            provider_flags,
            outputs: args.outputs.clone(),
        })
    }
}

/// `/metrics` endpoints filed by role: the brokers', then the providers'.
fn by_role(brokers: &[SocketAddr], providers: &[SocketAddr]) -> Vec<(String, SocketAddr)> {
    let of = |role: &'static str, addrs: &[SocketAddr]| {
        addrs
            .iter()
            .map(|a| (role.to_string(), *a))
            .collect::<Vec<_>>()
    };
    let mut all = of("broker", brokers);
    all.extend(of("provider", providers));
    all
}

/// The plaintext path of `--compare-tls`: against targets, `--plain-target` (read through
/// the `--plain-*-metrics` endpoints, else the same ones as the TLS path); for the local
/// mesh, one the mesh fills in. The flags of one setting are refused with the other.
fn plain_path(
    args: &CapacityArgs,
    load: &DriverConfig,
    probes: &[(String, SocketAddr)],
    p: &mut ConfigProblems,
) -> Option<PlainPath> {
    let local = load.targets.is_empty();
    let plain_flags = !args.plain_targets.is_empty()
        || !args.plain_broker_metrics.is_empty()
        || !args.plain_provider_metrics.is_empty();
    if !args.plan.compare_tls {
        p.check(plain_flags, || {
            "--plain-target and --plain-*-metrics are the plaintext path of --compare-tls: add --compare-tls, or drop them".into()
        });
        p.check(local && load.tls.is_some(), || {
            "the local mesh speaks plaintext (with --compare-tls it makes its own CA for the TLS path): drop --tls-ca, or add --target".into()
        });
        return None;
    }
    if local {
        p.check(load.tls.is_some() || plain_flags, || {
            "with --compare-tls the local mesh makes its own CA and both paths: drop --tls-* and --plain-*, or add --target".into()
        });
        return Some(PlainPath::default());
    }
    p.check(load.tls.is_none(), || {
        "--compare-tls against --target needs --tls-ca (and --tls-cert and --tls-key for mutual TLS): the targets are the TLS path".into()
    });
    p.check(args.plain_targets.is_empty(), || {
        "--compare-tls against --target needs --plain-target: where the same path is called without TLS (a --listen-plain address)".into()
    });
    for t in &args.plain_targets {
        p.check(!crate::config::is_host_port(t), || {
            format!("--plain-target {t:?}: expected HOST:PORT")
        });
    }
    let pick = |plain: &[SocketAddr], role: &str| -> Vec<SocketAddr> {
        if plain.is_empty() {
            probes
                .iter()
                .filter(|(r, _)| r == role)
                .map(|(_, a)| *a)
                .collect()
        } else {
            plain.to_vec()
        }
    };
    Some(PlainPath {
        targets: args.plain_targets.clone(),
        probes: by_role(
            &pick(&args.plain_broker_metrics, "broker"),
            &pick(&args.plain_provider_metrics, "provider"),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Args, Command};
    use clap::Parser;

    fn config(flags: &[&str]) -> Result<CapacityConfig, ConfigProblems> {
        let argv = ["driver", "capacity"].iter().chain(flags).copied();
        match Args::parse_from(argv).command {
            Some(Command::Capacity(c)) => CapacityConfig::new(&c),
            other => panic!("not driver capacity: {other:?}"),
        }
    }

    #[test]
    fn a_capacity_step_paces_lean_unless_told() {
        let c = config(&[]).unwrap();
        assert_eq!(c.load.pacing, Pacing::Lean);
        assert!(c.load.targets.is_empty() && c.probes.is_empty());
        let c = config(&["--pacer", "exact"]).unwrap();
        assert_eq!(c.load.pacing, Pacing::Exact);
    }

    #[test]
    fn the_planners_and_the_drivers_problems_are_listed_together() {
        let e = config(&[
            "--v1",
            "--compare-compression",
            "--start-rate",
            "1e9",
            "--growth",
            "1",
            "--target",
            "127.0.0.1:7700",
            "--service-time",
            "1ms",
        ])
        .unwrap_err();
        // The comparison without extension flags, a growth of 1, a rate no pacer keeps, a
        // local provider's flag with a target.
        assert_eq!(e.0.len(), 4, "{e}");
    }

    #[test]
    fn a_local_providers_service_time_is_checked_before_the_mesh_starts() {
        assert!(config(&["--service-time", "exp:5ms", "--service-work"]).is_ok());
        let e = config(&["--service-time", "soon"]).unwrap_err();
        assert!(e.to_string().contains("--service-time soon"), "{e}");
        let e = config(&["--service-work"]).unwrap_err();
        assert!(e.to_string().contains("add --service-time"), "{e}");
    }

    #[test]
    fn compression_tuning_needs_something_compressed() {
        assert!(config(&["--compare-compression", "--compress-level", "1"]).is_ok());
        assert!(config(&["--compress", "on", "--compress-level", "1"]).is_ok());
        let e = config(&["--compress-level", "1"]).unwrap_err();
        assert!(e.to_string().contains("--compare-compression"), "{e}");
    }

    #[test]
    fn compare_tls_takes_both_paths_against_targets_and_none_locally() {
        let pki = super::super::pki::LocalPki::new().unwrap();
        let ca = pki.ca.to_str().unwrap();
        // Locally: the mesh makes both.
        let c = config(&["--compare-tls"]).unwrap();
        assert!(c.plain.is_some());
        assert!(config(&["--compare-tls", "--tls-ca", ca]).is_err());
        assert!(config(&["--compare-tls", "--plain-target", "127.0.0.1:1"]).is_err());
        // Against targets: the TLS path is the targets', the plain one --plain-target.
        let e = config(&["--compare-tls", "--target", "127.0.0.1:7700"]).unwrap_err();
        assert!(e.to_string().contains("needs --tls-ca"), "{e}");
        assert!(e.to_string().contains("needs --plain-target"), "{e}");
        let e = config(&[
            "--plain-target",
            "127.0.0.1:7701",
            "--target",
            "127.0.0.1:7700",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("add --compare-tls"), "{e}");
        let e = config(&["--tls-ca", ca]).unwrap_err();
        assert!(
            e.to_string().contains("the local mesh speaks plaintext"),
            "{e}"
        );
        // Both paths given: the plain one is read through the same probes unless told.
        let c = config(&[
            "--compare-tls",
            "--tls-ca",
            ca,
            "--target",
            "127.0.0.1:7700",
            "--plain-target",
            "127.0.0.1:7701",
            "--broker-metrics",
            "127.0.0.1:9770",
            "--plain-provider-metrics",
            "127.0.0.1:9781",
        ])
        .unwrap();
        let plain = c.plain.unwrap();
        assert_eq!(plain.targets, ["127.0.0.1:7701"]);
        let probes: Vec<String> = plain
            .probes
            .iter()
            .map(|(r, a)| format!("{r} {a}"))
            .collect();
        assert_eq!(probes, ["broker 127.0.0.1:9770", "provider 127.0.0.1:9781"]);
    }

    #[test]
    fn probes_are_filed_by_role() {
        let c = config(&[
            "--target",
            "127.0.0.1:7700",
            "--broker-metrics",
            "127.0.0.1:9770",
            "--provider-metrics",
            "127.0.0.2:9780",
        ])
        .unwrap();
        let roles: Vec<&str> = c.probes.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(roles, ["broker", "provider"]);
    }
}
