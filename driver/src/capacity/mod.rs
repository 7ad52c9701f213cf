//! `driver capacity`: the capacity planner ([`rpcmesh_capacity`]) run on the driver's load
//! engine. The planner decides every step and judges it; this module runs them: each step
//! is a driver run whose measured window is bracketed by readings of each program's CPU
//! ([`step`], [`probe`]), and with no target the provider and broker run as child
//! processes ([`mesh`]) so that each has its own CPU. The flags are validated in
//! [`config`].

pub mod config;
pub mod mesh;
pub mod probe;
pub mod step;

use std::path::Path;

use rpcmesh_capacity::report::ProbeSetup;
use rpcmesh_capacity::{CapacityReport, Compression, LoadSetup};
use rpcmesh_common::net::shutdown::CancellationToken;

use self::config::CapacityConfig;
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
    let mesh = if local {
        let exe = exe.to_path_buf();
        let flags = config.provider_flags.clone();
        // On the runtime, so that a Ctrl-C during the start is taken as the stop.
        let mesh = rt.block_on(async {
            tokio::task::spawn_blocking(move || mesh::LocalMesh::start(&exe, &flags)).await
        })??;
        config.load.targets = vec![mesh.broker.rpc.to_string()];
        config.probes = vec![
            ("broker".into(), mesh.broker.metrics),
            ("provider".into(), mesh.provider.metrics),
        ];
        say!(
            "capacity: local mesh: broker {} (metrics {}), provider {} (metrics {})",
            mesh.broker.rpc,
            mesh.broker.metrics,
            mesh.provider.rpc,
            mesh.provider.metrics
        );
        Some(mesh)
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
        stop,
    };
    let report = rpcmesh_capacity::run(&config.plan, load, &mut runner);
    drop(mesh);
    Ok(report)
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
        targets: c.load.targets.clone(),
        local_mesh: local,
        service_work: (!c.provider_flags.is_empty()).then(|| c.provider_flags.join(" ")),
        probes: c
            .probes
            .iter()
            .map(|(role, a)| ProbeSetup {
                role: role.clone(),
                address: a.to_string(),
            })
            .collect(),
        compression: Compression::from(c.load.compression.is_some()),
    }
}
