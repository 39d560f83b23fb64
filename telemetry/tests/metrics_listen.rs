//! `/metrics`' listener: a daemon's default address that another process holds leaves the daemon running without
//! `/metrics`; an address the operator chose must bind or the pipeline refuses to start, naming it.

use bc_telemetry::{Origin, Registry, Telemetry, TelemetryError, TelemetryWire};
use std::net::SocketAddr;

fn origin() -> Origin {
    Origin {
        service: "test".into(),
        instance: "here".into(),
    }
}

#[tokio::test]
async fn a_taken_default_port_turns_metrics_off_and_a_taken_chosen_port_fails() -> anyhow::Result<()>
{
    let held = std::net::TcpListener::bind("127.0.0.1:0")?;
    let taken: SocketAddr = held.local_addr()?;
    let dir = tempfile::tempdir()?;

    let default = TelemetryWire::default().validate_with("test", dir.path().into(), Some(taken))?;
    let t = Telemetry::new(default, Registry::new(), origin()).await?;
    assert_eq!(
        t.metrics_addr(),
        None,
        "the default port is taken: no /metrics, no error"
    );

    let chosen: TelemetryWire = toml::from_str(&format!("metrics_listen = \"{taken}\""))?;
    let chosen = chosen.validate_with("test", dir.path().into(), Some(taken))?;
    match Telemetry::new(chosen, Registry::new(), origin()).await {
        Err(TelemetryError::Bind { addr, .. }) => assert_eq!(addr, taken),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("an address the operator chose was taken and the pipeline started anyway"),
    }

    // Free again: the default binds.
    drop(held);
    let default = TelemetryWire::default().validate_with("test", dir.path().into(), Some(taken))?;
    let t = Telemetry::new(default, Registry::new(), origin()).await?;
    assert_eq!(t.metrics_addr(), Some(taken));
    Ok(())
}
