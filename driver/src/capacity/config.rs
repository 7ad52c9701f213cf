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
        let probes = args
            .broker_metrics
            .iter()
            .map(|a| ("broker".to_string(), *a))
            .chain(
                args.provider_metrics
                    .iter()
                    .map(|a| ("provider".to_string(), *a)),
            )
            .collect();
        p.into_result(CapacityConfig {
            load,
            compression_on,
            plan,
            probes,
            provider_flags,
            outputs: args.outputs.clone(),
        })
    }
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
