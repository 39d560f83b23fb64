//! Control-plane configuration: a serde "wire" struct read from TOML (every field optional; command-line flags
//! override), validated into [`ServeConfig`]. Errors name the file and the field (INVALID_CONFIG).

use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The roles a process can run. Several processes of each share work through the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Roles {
    pub api: bool,
    pub gateway: bool,
    pub controllers: bool,
    pub scheduler: bool,
    pub sinks: bool,
    pub iam: bool,
}

pub const ROLE_NAMES: &[&str] = &["api", "gateway", "controllers", "scheduler", "sinks", "iam"];

impl Roles {
    pub fn all() -> Roles {
        Roles {
            api: true,
            gateway: true,
            controllers: true,
            scheduler: true,
            sinks: true,
            iam: true,
        }
    }

    pub fn parse(list: &str) -> Result<Roles, String> {
        let mut r = Roles::default();
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match name {
                "api" => r.api = true,
                "gateway" => r.gateway = true,
                "controllers" => r.controllers = true,
                "scheduler" => r.scheduler = true,
                "sinks" => r.sinks = true,
                "iam" => r.iam = true,
                "all" => r = Roles::all(),
                other => {
                    return Err(format!(
                        "unknown role {other:?}; roles are {}",
                        ROLE_NAMES.join(", ")
                    ));
                }
            }
        }
        if r == Roles::default() {
            return Err("no roles given".into());
        }
        Ok(r)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfigWire {
    pub state_dir: Option<PathBuf>,
    pub database_url: Option<String>,
    pub trust_domain: Option<String>,
    pub roles: Option<String>,
    pub api_listen: Option<String>,
    pub gateway_listen: Option<String>,
    /// DNS names and IP addresses the gateway certificate covers.
    pub gateway_hosts: Option<Vec<String>>,
    /// The gateway URL nodes are told to use (defaults to https://<first host>:<gateway port>).
    pub gateway_url: Option<String>,
    /// How long a process's role membership and shard leases last without renewal (milliseconds; default
    /// 10000). A dead process's shards move to the others within this, and the nodes of a dead gateway go offline
    /// within three of these (a gateway publishes three as its lease).
    pub shard_lease_ms: Option<u64>,
    /// How often the process re-issues its own certificates from the CA: the gateway role's serving certificate and
    /// the tunnel relay's client certificate, each valid 30 days (seconds; default 86400, at least 1).
    pub certificate_renewal_s: Option<u64>,
    /// The process's own metrics (`bc_telemetry::config`; docs/telemetry.md): API latency per method, sessions per
    /// gateway, placement latency, shard leases held, queue depths.
    pub telemetry: Option<bc_telemetry::TelemetryWire>,
    /// The capacity module (`[capacity]`): which placer books reservations.
    pub capacity: Option<CapacityWire>,
    /// This gateway's id: its certificate's `spiffe://<domain>/gateway/<id>` and the name session rows carry
    /// (default `gw-<hostname>-<port>`). Unique among the gateways sharing a database.
    pub gateway_id: Option<String>,
    /// Where the other control-plane processes reach this gateway directly (never through a balancer), for the
    /// tunnel relay: `https://<host>:<port>`, host among `gateway_hosts` (default: the first of them and the
    /// gateway's port).
    pub gateway_relay_url: Option<String>,
    /// The TCP balancers in front of the gateway that send the PROXY protocol v2 header (HAProxy's
    /// `send-proxy-v2`, a cloud network balancer's proxy protocol option): addresses or networks (`10.0.0.5`,
    /// `10.0.0.0/24`). Their connections must begin with the header and are accounted as the client it names;
    /// nobody else's header is read. Default: none.
    pub gateway_proxy_protocol_from: Option<Vec<String>>,
    /// The tunnels module (`[tunnels]`): the idle limit and the per-principal cap.
    pub tunnels: Option<TunnelsWire>,
    /// The metal module (`[metal]`): deadlines, retry plans, the ramdisk and where deploy images come from.
    pub metal: Option<crate::metal_config::MetalWire>,
}

/// `[tunnels]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunnelsWire {
    /// A tunnel that moves no byte either way for this long is closed (`IDLE`): seconds, 60 to 604800 (a week);
    /// default 3600.
    pub idle_limit_s: Option<u64>,
    /// Tunnels one principal holds open at once through one API process: 1 to 65536; default 256.
    pub per_principal: Option<usize>,
}

impl TunnelsWire {
    /// The module's options; Err((field, message)) names what is out of range.
    fn validate(self) -> Result<bc_mod_tunnels::Options, (&'static str, String)> {
        let mut o = bc_mod_tunnels::Options::default();
        if let Some(s) = self.idle_limit_s {
            if !(60..=604_800).contains(&s) {
                return Err((
                    "tunnels.idle_limit_s",
                    format!("{s} is out of range: seconds from 60 to 604800 (a week)"),
                ));
            }
            o.idle = std::time::Duration::from_secs(s);
        }
        if let Some(n) = self.per_principal {
            if !(1..=65_536).contains(&n) {
                return Err((
                    "tunnels.per_principal",
                    format!("{n} is out of range: from 1 to 65536"),
                ));
            }
            o.per_principal = n;
        }
        Ok(o)
    }
}

/// `[capacity]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityWire {
    /// `"shard"` (the default: reservations split by shard over the scheduler processes) or `"pool-lease"` (one
    /// scheduler process per pool is its only booking writer; reservations name their pool).
    pub placer: Option<String>,
}

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub state_dir: PathBuf,
    pub database_url: Option<String>,
    pub trust_domain: String,
    pub roles: Roles,
    pub api_listen: SocketAddr,
    pub gateway_listen: SocketAddr,
    pub gateway_hosts: Vec<String>,
    pub gateway_url: Option<String>,
    /// Session timing overrides (tests and benchmarks); defaults are in bc-gateway.
    pub session_timing: Option<SessionTiming>,
    /// Lifecycle controller timing overrides (tests); defaults in [`crate::lifecycle::LifecycleTiming`].
    pub lifecycle_timing: Option<crate::lifecycle::LifecycleTiming>,
    /// Workload certificate lifetime override (tests of renewal); default 24 h.
    pub leaf_lifetime: Option<std::time::Duration>,
    /// How often the process re-issues its own gateway and relay certificates (tests); None means
    /// [`crate::renew::RENEW_EVERY`].
    pub cert_renewal: Option<std::time::Duration>,
    /// Role membership and shard lease lifetime; None means [`DEFAULT_SHARD_LEASE`].
    pub shard_lease: Option<std::time::Duration>,
    /// How often the scheduler rereads all free capacity (tests); None means [`bc_mod_capacity::FULL_RELOAD`].
    pub capacity_reload: Option<std::time::Duration>,
    /// Which placer books reservations (`[capacity] placer`).
    pub placer: bc_mod_capacity::Placer,
    /// The instances module's timing overrides (tests); None means [`bc_mod_instances::Config::default`].
    pub instances: Option<bc_mod_instances::Config>,
    /// Where the process's own metrics go ([`crate::telemetry`]) and where `/metrics` is served; None exports and
    /// serves nothing (tests). A configuration file without a `[telemetry]` table serves `/metrics` on
    /// [`crate::telemetry::DEFAULT_METRICS_LISTEN`].
    pub telemetry: Option<bc_telemetry::TelemetryConfig>,
    /// This gateway's id; None means `gw-<hostname>-<port>`.
    pub gateway_id: Option<String>,
    /// Where other control-plane processes reach this gateway (the tunnel relay); None means
    /// `https://<first gateway host>:<gateway port>`.
    pub gateway_relay_url: Option<String>,
    /// The balancers whose connections begin with a PROXY protocol header (`gateway_proxy_protocol_from`).
    pub gateway_proxy_protocol_from: bc_proto::proxy_protocol::Trusted,
    /// The tunnels module's limits (`[tunnels]`).
    pub tunnels: bc_mod_tunnels::Options,
    /// The metal module's configuration (`[metal]`); the ramdisk's command line gets this control plane's gateway
    /// URL, CA pin and JoinService key appended at start.
    pub metal: bc_mod_metal::Config,
}

impl ServeConfig {
    /// `roles` on ephemeral loopback ports (API and gateway on 127.0.0.1:0, the gateway certificate for
    /// `localhost`), the embedded database, default timings: the base of a control plane started in process (tests,
    /// benchmarks), to be adjusted with struct update syntax.
    pub fn loopback(state_dir: PathBuf, trust_domain: &str, roles: Roles) -> ServeConfig {
        let any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        ServeConfig {
            state_dir,
            database_url: None,
            trust_domain: trust_domain.to_string(),
            roles,
            api_listen: any_port,
            gateway_listen: any_port,
            gateway_hosts: vec!["localhost".into()],
            gateway_url: None,
            session_timing: None,
            lifecycle_timing: None,
            leaf_lifetime: None,
            cert_renewal: None,
            shard_lease: None,
            capacity_reload: None,
            placer: bc_mod_capacity::Placer::Shard,
            instances: None,
            telemetry: None,
            gateway_id: None,
            gateway_relay_url: None,
            gateway_proxy_protocol_from: Default::default(),
            tunnels: bc_mod_tunnels::Options::default(),
            metal: bc_mod_metal::Config::default(),
        }
    }
}

pub const DEFAULT_SHARD_LEASE: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, Clone, Copy)]
pub struct SessionTiming {
    pub heartbeat: std::time::Duration,
    pub liveness_interval: std::time::Duration,
    pub pending_interval: std::time::Duration,
    pub idle_timeout: std::time::Duration,
    pub revocation_interval: std::time::Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("INVALID_CONFIG: reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("INVALID_CONFIG: {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("INVALID_CONFIG: {0}")]
    Telemetry(#[from] bc_telemetry::config::TelemetryConfigError),
    #[error("INVALID_CONFIG: {origin}: field {field}: {message}")]
    Field {
        origin: String,
        field: &'static str,
        message: String,
    },
}

impl ServeConfigWire {
    pub fn from_file(path: &Path) -> Result<ServeConfigWire, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Fields set in `over` replace ours.
    pub fn overlay(self, over: ServeConfigWire) -> ServeConfigWire {
        ServeConfigWire {
            state_dir: over.state_dir.or(self.state_dir),
            database_url: over.database_url.or(self.database_url),
            trust_domain: over.trust_domain.or(self.trust_domain),
            roles: over.roles.or(self.roles),
            api_listen: over.api_listen.or(self.api_listen),
            gateway_listen: over.gateway_listen.or(self.gateway_listen),
            gateway_hosts: over.gateway_hosts.or(self.gateway_hosts),
            gateway_url: over.gateway_url.or(self.gateway_url),
            shard_lease_ms: over.shard_lease_ms.or(self.shard_lease_ms),
            certificate_renewal_s: over.certificate_renewal_s.or(self.certificate_renewal_s),
            telemetry: over.telemetry.or(self.telemetry),
            capacity: over.capacity.or(self.capacity),
            gateway_id: over.gateway_id.or(self.gateway_id),
            gateway_relay_url: over.gateway_relay_url.or(self.gateway_relay_url),
            gateway_proxy_protocol_from: over
                .gateway_proxy_protocol_from
                .or(self.gateway_proxy_protocol_from),
            tunnels: over.tunnels.or(self.tunnels),
            metal: over.metal.or(self.metal),
        }
    }

    /// Validates; `origin` names where the values came from (a file path or "command line").
    pub fn validate(self, origin: &str) -> Result<ServeConfig, ConfigError> {
        let field = |field: &'static str, message: String| ConfigError::Field {
            origin: origin.to_string(),
            field,
            message,
        };
        let addr = |name: &'static str,
                    v: Option<String>,
                    default: &str|
         -> Result<SocketAddr, ConfigError> {
            v.as_deref()
                .unwrap_or(default)
                .parse()
                .map_err(|e| field(name, format!("not a socket address ({e})")))
        };
        let trust_domain = self
            .trust_domain
            .unwrap_or_else(|| "bettercompute.local".into());
        if bc_proto::spiffe::SpiffeId::new(&trust_domain, bc_proto::spiffe::Role::Node, "x")
            .is_err()
        {
            return Err(field(
                "trust_domain",
                "must be lowercase letters, digits, '.', '-', '_'".into(),
            ));
        }
        let roles = Roles::parse(self.roles.as_deref().unwrap_or("api,gateway"))
            .map_err(|m| field("roles", m))?;
        if let Some(url) = &self.gateway_url {
            bc_proto::channel::parse_gateway_url(url)
                .map_err(|e| field("gateway_url", e.to_string()))?;
        }
        if let Some(url) = &self.gateway_relay_url {
            bc_proto::channel::parse_gateway_url(url)
                .map_err(|e| field("gateway_relay_url", e.to_string()))?;
        }
        if let Some(id) = &self.gateway_id
            && bc_proto::spiffe::SpiffeId::new(&trust_domain, bc_proto::spiffe::Role::Gateway, id)
                .is_err()
        {
            return Err(field(
                "gateway_id",
                "must be 1 to 128 characters of letters, digits, '.', '-', '_'".into(),
            ));
        }
        let gateway_proxy_protocol_from = bc_proto::proxy_protocol::Trusted(
            self.gateway_proxy_protocol_from
                .unwrap_or_default()
                .iter()
                .map(|p| p.parse())
                .collect::<Result<_, String>>()
                .map_err(|m| field("gateway_proxy_protocol_from", m))?,
        );
        let tunnels = self
            .tunnels
            .unwrap_or_default()
            .validate()
            .map_err(|(name, m)| field(name, m))?;
        let state_dir = self
            .state_dir
            .unwrap_or_else(|| PathBuf::from("/var/lib/better-compute"));
        let placer = match self.capacity.and_then(|c| c.placer) {
            None => bc_mod_capacity::Placer::Shard,
            Some(p) => bc_mod_capacity::Placer::parse(&p)
                .map_err(|e| field("capacity.placer", e.reason))?,
        };
        // Without a table: no exporter, and /metrics on its default loopback address.
        let telemetry = Some(self.telemetry.unwrap_or_default().validate_with(
            origin,
            state_dir.join("telemetry"),
            Some(crate::telemetry::DEFAULT_METRICS_LISTEN),
        )?);
        let metal = self.metal.unwrap_or_default().validate(origin)?;
        Ok(ServeConfig {
            state_dir,
            database_url: self.database_url,
            trust_domain,
            roles,
            api_listen: addr("api_listen", self.api_listen, "127.0.0.1:7080")?,
            gateway_listen: addr("gateway_listen", self.gateway_listen, "127.0.0.1:7443")?,
            gateway_hosts: self
                .gateway_hosts
                .unwrap_or_else(|| vec!["localhost".into(), "127.0.0.1".into()]),
            gateway_url: self.gateway_url,
            session_timing: None,
            lifecycle_timing: None,
            leaf_lifetime: None,
            cert_renewal: match self.certificate_renewal_s {
                None => None,
                Some(0) => {
                    return Err(field(
                        "certificate_renewal_s",
                        "must be at least 1 (seconds; the certificates live 30 days)".into(),
                    ));
                }
                Some(s) => Some(std::time::Duration::from_secs(s)),
            },
            shard_lease: match self.shard_lease_ms {
                None => None,
                Some(ms) if (500..=600_000).contains(&ms) => {
                    Some(std::time::Duration::from_millis(ms))
                }
                Some(_) => {
                    return Err(field(
                        "shard_lease_ms",
                        "must be between 500 and 600000".into(),
                    ));
                }
            },
            capacity_reload: None,
            placer,
            instances: None,
            telemetry,
            gateway_id: self.gateway_id,
            gateway_relay_url: self.gateway_relay_url,
            gateway_proxy_protocol_from,
            tunnels,
            metal,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_example_parses() -> Result<(), ConfigError> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples/control.toml");
        let c = ServeConfigWire::from_file(&path)?.validate(&path.display().to_string())?;
        assert!(c.roles.api && c.roles.gateway);
        Ok(())
    }

    /// The package's /etc/better-compute/serve.toml parses and validates (the database URL may come from
    /// BC_DATABASE_URL; `serve` names it when neither gives one).
    #[test]
    fn the_packaged_default_parses() -> Result<(), ConfigError> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/config/serve.toml");
        let c = ServeConfigWire::from_file(&path)?.validate(&path.display().to_string())?;
        assert!(c.roles.api && c.roles.gateway && c.roles.controllers && c.roles.scheduler);
        assert_eq!(c.database_url, None);
        Ok(())
    }

    #[test]
    fn metrics_are_served_on_loopback_by_default_and_off_turns_them_off() -> Result<(), ConfigError>
    {
        let c = ServeConfigWire::default().validate("cli")?;
        let t = c.telemetry.expect("telemetry without a table");
        assert_eq!(
            t.metrics_listen,
            Some(crate::telemetry::DEFAULT_METRICS_LISTEN)
        );
        assert!(t.metrics_listen_is_default);
        assert!(t.remote_write.is_none() && t.otlp.is_none(), "no exporter");
        let wire: ServeConfigWire =
            toml::from_str("[telemetry]\nmetrics_listen = \"off\"\n").expect("toml");
        let t = wire.validate("x.toml")?.telemetry.expect("telemetry");
        assert_eq!(t.metrics_listen, None);
        Ok(())
    }

    #[test]
    fn errors_name_the_field() {
        let wire = ServeConfigWire {
            api_listen: Some("nope".into()),
            ..Default::default()
        };
        let e = wire
            .validate("x.toml")
            .map(|_| ())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("x.toml") && e.contains("api_listen"), "{e}");
        let wire = ServeConfigWire {
            roles: Some("api,wizard".into()),
            ..Default::default()
        };
        assert!(wire.validate("cli").is_err());
    }

    #[test]
    fn tunnel_limits_are_read_and_each_bad_one_is_invalid_config_naming_its_field() {
        let parse = |text: &str| -> Result<ServeConfig, String> {
            let wire: ServeConfigWire = toml::from_str(text).map_err(|e| e.to_string())?;
            wire.validate("x.toml").map_err(|e| e.to_string())
        };
        let c = parse("[tunnels]\nidle_limit_s = 7200\nper_principal = 8\n");
        assert_eq!(
            c.map(|c| (c.tunnels.idle.as_secs(), c.tunnels.per_principal)),
            Ok((7200, 8))
        );
        let defaults = parse("").map(|c| c.tunnels);
        assert_eq!(defaults, Ok(bc_mod_tunnels::Options::default()));
        for (text, field) in [
            ("[tunnels]\nidle_limit_s = 59\n", "tunnels.idle_limit_s"),
            ("[tunnels]\nidle_limit_s = 604801\n", "tunnels.idle_limit_s"),
            ("[tunnels]\nper_principal = 0\n", "tunnels.per_principal"),
            ("gateway_id = \"gw 1\"\n", "gateway_id"),
            (
                "gateway_relay_url = \"http://10.0.0.5:7443\"\n",
                "gateway_relay_url",
            ),
            (
                "gateway_proxy_protocol_from = [\"10.0.0.0/33\"]\n",
                "gateway_proxy_protocol_from",
            ),
            (
                "gateway_proxy_protocol_from = [\"balancer-1\"]\n",
                "gateway_proxy_protocol_from",
            ),
        ] {
            let e = parse(text).map(|_| ()).err().unwrap_or_default();
            assert!(
                e.starts_with("INVALID_CONFIG") && e.contains("x.toml") && e.contains(field),
                "{text}: {e}"
            );
        }
        let proxies = parse("gateway_proxy_protocol_from = [\"10.0.0.5\", \"fd00::/64\"]\n")
            .map(|c| c.gateway_proxy_protocol_from.to_string());
        assert_eq!(proxies.as_deref(), Ok("10.0.0.5/32,fd00::/64"));
        assert!(parse("").is_ok_and(|c| c.gateway_proxy_protocol_from.is_empty()));
        let unknown = parse("[tunnels]\nidle = 5\n").err().unwrap_or_default();
        assert!(unknown.contains("idle"), "{unknown}");
    }

    #[test]
    fn a_bad_placer_is_invalid_config_naming_capacity_placer() {
        let wire: ServeConfigWire =
            toml::from_str("[capacity]\nplacer = \"round-robin\"\n").expect("toml");
        let e = wire
            .validate("x.toml")
            .map(|_| ())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.starts_with("INVALID_CONFIG")
                && e.contains("capacity.placer")
                && e.contains("pool-lease"),
            "{e}"
        );
        let wire: ServeConfigWire =
            toml::from_str("[capacity]\nplacer = \"pool-lease\"\n").expect("toml");
        assert_eq!(
            wire.validate("x.toml").map(|c| c.placer).ok(),
            Some(bc_mod_capacity::Placer::PoolLease)
        );
    }
}
