//! `driver capacity`: the capacity planner ([`rpcmesh_capacity`]) run on the driver's load
//! engine. The planner decides every step and judges it; this module runs them: each step
//! is a driver run whose measured window is bracketed by readings of each program's CPU
//! ([`step`], [`probe`]), and with no target the provider and broker run as child
//! processes ([`mesh`]) so that each has its own CPU; `--compare-tls` runs a second,
//! TLS-speaking pair with a throwaway CA ([`pki`]). The flags are validated in
//! [`config`].

pub mod config;
pub mod mesh;
pub mod pki;
pub mod probe;
pub mod step;

use std::path::Path;

use rpcmesh_capacity::report::ProbeSetup;
use rpcmesh_capacity::{CapacityReport, LoadSetup, Setting};
use rpcmesh_common::cli::ConfigProblems;
use rpcmesh_common::cli::security::ClientTlsArgs;
use rpcmesh_common::net::shutdown::CancellationToken;

use self::config::{CapacityConfig, PlainPath};
use self::mesh::LocalMesh;
use self::pki::LocalPki;
use self::step::Runner;
use crate::config::WorkloadKind;
use crate::progress::say;

/// Runs the experiment on `rt`. `exe` is the driver binary, run again as the local mesh's
/// provider and broker when `config` has no target. `stop` (Ctrl-C) ends it early; what
/// was measured is reported.
pub fn run(
    mut config: CapacityConfig,
    exe: &Path,
    rt: &tokio::runtime::Runtime,
    stop: CancellationToken,
) -> anyhow::Result<CapacityReport> {
    let local = config.load.targets.is_empty();
    let meshes = if local {
        Some(start_meshes(&mut config, exe, rt)?)
    } else {
        None
    };
    let load = load_setup(&config, local);
    let mut runner = Runner {
        rt,
        load: config.load,
        compression_on: config.compression_on,
        step: config.plan.step,
        warmup: config.plan.warmup,
        probes: config.probes,
        plain: config.plain,
        stop,
    };
    let report = rpcmesh_capacity::run(&config.plan, load, &mut runner);
    drop(meshes);
    Ok(report)
}

/// The local meshes, running; dropped, they stop (the TLS one first) and the CA goes.
struct Meshes {
    _tls: Option<(LocalMesh, LocalPki)>,
    _plain: LocalMesh,
}

/// Starts the local mesh, and with `--compare-tls` a second one speaking mutual TLS on
/// both hops with a CA of its own; points the load and the probes at them.
fn start_meshes(
    config: &mut CapacityConfig,
    exe: &Path,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<Meshes> {
    let pki = match config.plain {
        Some(_) => Some(LocalPki::new()?),
        None => None,
    };
    let exe = exe.to_path_buf();
    let flags = config.provider_flags.clone();
    // On the runtime, so that a Ctrl-C during the start is taken as the stop.
    let (plain, pki, tls) = rt.block_on(async {
        tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let plain = LocalMesh::start(&exe, &flags, None)?;
            let tls = match &pki {
                Some(pki) => Some(LocalMesh::start(&exe, &flags, Some(pki))?),
                None => None,
            };
            Ok((plain, pki, tls))
        })
        .await
    })??;
    let probes = |m: &LocalMesh| {
        vec![
            ("broker".to_string(), m.broker.metrics),
            ("provider".to_string(), m.provider.metrics),
        ]
    };
    let describe = |what: &str, m: &LocalMesh| {
        say!(
            "capacity: local mesh{what}: broker {} (metrics {}), provider {} (metrics {})",
            m.broker.rpc,
            m.broker.metrics,
            m.provider.rpc,
            m.provider.metrics
        );
    };
    let tls = match (tls, pki) {
        (Some(mesh), Some(pki)) => {
            describe(" with mutual TLS", &mesh);
            describe(", plaintext", &plain);
            let path = |p: &std::path::Path| Some(p.to_path_buf());
            let mut p = ConfigProblems::default();
            config.load.tls = ClientTlsArgs {
                tls_ca: path(&pki.ca),
                tls_cert: path(&pki.driver.cert),
                tls_key: path(&pki.driver.key),
                tls_server_name: None,
            }
            .client(&mut p);
            p.into_result(())
                .map_err(|e| anyhow::anyhow!("the local mesh's certificates: {e}"))?;
            config.load.targets = vec![mesh.broker.rpc.to_string()];
            config.probes = probes(&mesh);
            config.plain = Some(PlainPath {
                targets: vec![plain.broker.rpc.to_string()],
                probes: probes(&plain),
            });
            Some((mesh, pki))
        }
        _ => {
            describe("", &plain);
            config.load.targets = vec![plain.broker.rpc.to_string()];
            config.probes = probes(&plain);
            None
        }
    };
    Ok(Meshes {
        _tls: tls,
        _plain: plain,
    })
}

/// The load of every step, as the report describes it.
fn load_setup(c: &CapacityConfig, local: bool) -> LoadSetup {
    LoadSetup {
        workload: match c.load.workload {
            WorkloadKind::Platform => "platform".into(),
            WorkloadKind::Echo => "echo".into(),
        },
        payload_size: c.load.payload_size,
        fanout: c.load.fanout,
        parallel: c.load.parallel,
        concurrency: c.load.concurrency,
        connections: c.load.connections,
        targets: c
            .load
            .targets
            .iter()
            .chain(c.plain.iter().flat_map(|p| &p.targets))
            .cloned()
            .collect(),
        local_mesh: local,
        service_work: (!c.provider_flags.is_empty()).then(|| c.provider_flags.join(" ")),
        probes: c
            .probes
            .iter()
            .chain(c.plain.iter().flat_map(|p| &p.probes))
            .map(|(role, a)| ProbeSetup {
                role: role.clone(),
                address: a.to_string(),
            })
            .collect(),
        setting: Setting {
            compression: c.load.compression.is_some(),
            tls: c.load.tls.is_some(),
        },
    }
}
