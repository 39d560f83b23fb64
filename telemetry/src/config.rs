//! The `[telemetry]` table (in bcd.toml, and in any daemon's configuration that embeds it): a serde wire struct
//! and its validated form. Errors name the field and say what is expected.
//!
//! ```toml
//! [telemetry]
//! interval = "10s"                      # sample every 10 s (ms, s or m; at least 100ms)
//! max_series = 10000                    # the node's series budget
//! queue_max_bytes = 268435456           # the disk queue of each exporter (default 256 MiB)
//! metrics_listen = "127.0.0.1:9402"     # loopback /metrics (Prometheus text format); "off" turns it off
//! [telemetry.labels]                    # added to every series
//! cluster = "eu-1"
//! [telemetry.remote_write]              # Prometheus remote write 1.0
//! url = "https://tsdb.example:9090/api/v1/write"
//! bearer_token_file = "/etc/bcd/tsdb.token"   # or mTLS: cert_file + key_file; ca_file pins the server's CA
//! [telemetry.otlp]                      # OTLP/HTTP metrics
//! url = "http://collector.example:4318/v1/metrics"
//! ```

use crate::model::{Labels, valid_label_name};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_MAX_SERIES: usize = 10_000;
pub const DEFAULT_QUEUE_MAX_BYTES: u64 = 256 << 20;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
const MIN_INTERVAL: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryWire {
    pub interval: Option<String>,
    pub max_series: Option<usize>,
    pub queue_dir: Option<PathBuf>,
    pub queue_max_bytes: Option<u64>,
    pub metrics_listen: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub remote_write: Option<EndpointWire>,
    pub otlp: Option<EndpointWire>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointWire {
    pub url: Option<String>,
    pub bearer_token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub timeout: Option<String>,
}

/// The validated `[telemetry]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    pub interval: Duration,
    pub max_series: usize,
    pub queue_dir: PathBuf,
    pub queue_max_bytes: u64,
    pub metrics_listen: Option<SocketAddr>,
    /// `metrics_listen` is the daemon's default, not the operator's choice: when the port is taken (another daemon
    /// on the host), `/metrics` is off with a warning instead of failing the start.
    pub metrics_listen_is_default: bool,
    pub labels: Labels,
    pub remote_write: Option<Endpoint>,
    pub otlp: Option<Endpoint>,
}

/// Where one exporter sends, and how it authenticates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub url: String,
    pub bearer_token_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key (PEM) for mTLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{origin}: telemetry.{field}: {message}")]
pub struct TelemetryConfigError {
    pub origin: String,
    pub field: String,
    pub message: String,
}

/// `500ms`, `10s`, `1m` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], s[i..].trim()),
        None => (s, "s"),
    };
    let n: f64 = num.parse().ok()?;
    if !n.is_finite() || n < 0.0 {
        return None;
    }
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return None,
    };
    Duration::try_from_secs_f64(secs).ok()
}

/// The value of `metrics_listen` that turns `/metrics` off.
pub const METRICS_OFF: &str = "off";

impl TelemetryWire {
    /// Validates; `default_queue_dir` is the daemon's (bcd: `<state_dir>/telemetry`). Without `metrics_listen` there
    /// is no `/metrics`.
    pub fn validate(
        self,
        origin: &str,
        default_queue_dir: PathBuf,
    ) -> Result<TelemetryConfig, TelemetryConfigError> {
        self.validate_with(origin, default_queue_dir, None)
    }

    /// Like [`TelemetryWire::validate`], with the daemon's default `/metrics` address: used when `metrics_listen`
    /// is absent (`"off"` turns it off).
    pub fn validate_with(
        self,
        origin: &str,
        default_queue_dir: PathBuf,
        default_metrics: Option<SocketAddr>,
    ) -> Result<TelemetryConfig, TelemetryConfigError> {
        let err = |field: &str, message: String| TelemetryConfigError {
            origin: origin.to_string(),
            field: field.to_string(),
            message,
        };
        let interval = match &self.interval {
            None => DEFAULT_INTERVAL,
            Some(s) => parse_duration(s)
                .filter(|d| *d >= MIN_INTERVAL)
                .ok_or_else(|| {
                    err(
                        "interval",
                        format!(
                            "{s:?} is not a duration of at least 100ms (e.g. \"10s\", \"500ms\")"
                        ),
                    )
                })?,
        };
        let max_series = self.max_series.unwrap_or(DEFAULT_MAX_SERIES);
        if max_series == 0 {
            return Err(err("max_series", "must be at least 1".into()));
        }
        let queue_max_bytes = self.queue_max_bytes.unwrap_or(DEFAULT_QUEUE_MAX_BYTES);
        if queue_max_bytes < 4096 {
            return Err(err("queue_max_bytes", "must be at least 4096".into()));
        }
        let metrics_listen_is_default = self.metrics_listen.is_none() && default_metrics.is_some();
        let metrics_listen = match &self.metrics_listen {
            None => default_metrics,
            Some(s) if s == METRICS_OFF => None,
            Some(s) => {
                let a: SocketAddr = s.parse().map_err(|_| {
                    err(
                        "metrics_listen",
                        format!(
                            "{s:?} is not an address:port (e.g. \"127.0.0.1:9402\") or \"{METRICS_OFF}\""
                        ),
                    )
                })?;
                if !a.ip().is_loopback() {
                    return Err(err(
                        "metrics_listen",
                        format!(
                            "{a} is not a loopback address: /metrics is served on loopback only (127.0.0.1 or [::1])"
                        ),
                    ));
                }
                Some(a)
            }
        };
        let mut labels = Labels::new();
        for (n, v) in self.labels {
            if !valid_label_name(&n) {
                return Err(err(
                    &format!("labels.{n}"),
                    "is not a valid label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)"
                        .into(),
                ));
            }
            labels.set(n, v);
        }
        let endpoint = |name: &str,
                        w: Option<EndpointWire>|
         -> Result<Option<Endpoint>, TelemetryConfigError> {
            let Some(w) = w else { return Ok(None) };
            let url = w
                .url
                .ok_or_else(|| err(&format!("{name}.url"), "is required".into()))?;
            let https = url.starts_with("https://");
            if !https && !url.starts_with("http://") {
                return Err(err(
                    &format!("{name}.url"),
                    format!("{url:?} must start with http:// or https://"),
                ));
            }
            let client_cert = match (w.cert_file, w.key_file) {
                (Some(c), Some(k)) => Some((c, k)),
                (None, None) => None,
                _ => {
                    return Err(err(
                        &format!("{name}.cert_file"),
                        "mTLS needs both cert_file and key_file".into(),
                    ));
                }
            };
            if !https && (client_cert.is_some() || w.ca_file.is_some()) {
                return Err(err(
                    &format!("{name}.url"),
                    "ca_file, cert_file and key_file need an https:// url".into(),
                ));
            }
            let timeout = match &w.timeout {
                None => DEFAULT_TIMEOUT,
                Some(s) => parse_duration(s).filter(|d| !d.is_zero()).ok_or_else(|| {
                    err(
                        &format!("{name}.timeout"),
                        format!("{s:?} is not a duration"),
                    )
                })?,
            };
            Ok(Some(Endpoint {
                url,
                bearer_token_file: w.bearer_token_file,
                ca_file: w.ca_file,
                client_cert,
                timeout,
            }))
        };
        Ok(TelemetryConfig {
            interval,
            max_series,
            queue_dir: self.queue_dir.unwrap_or(default_queue_dir),
            queue_max_bytes,
            metrics_listen,
            metrics_listen_is_default,
            labels,
            remote_write: endpoint("remote_write", self.remote_write)?,
            otlp: endpoint("otlp", self.otlp)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<TelemetryConfig, TelemetryConfigError> {
        let w: TelemetryWire = toml::from_str(t).unwrap_or_else(|e| panic!("{e}"));
        w.validate("bcd.toml", PathBuf::from("/var/lib/bcd/telemetry"))
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_duration("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), None);
        assert_eq!(parse_duration("-1s"), None);
    }

    #[test]
    fn a_full_table_validates() -> Result<(), TelemetryConfigError> {
        let c = parse(
            r#"
            interval = "1s"
            metrics_listen = "127.0.0.1:9402"
            [labels]
            cluster = "eu-1"
            [remote_write]
            url = "https://tsdb:9090/api/v1/write"
            cert_file = "/c.pem"
            key_file = "/k.pem"
            [otlp]
            url = "http://c:4318/v1/metrics"
            "#,
        )?;
        assert_eq!(c.interval, Duration::from_secs(1));
        assert_eq!(c.labels.get("cluster"), Some("eu-1"));
        assert!(c.remote_write.is_some_and(|e| e.client_cert.is_some()));
        assert_eq!(c.queue_dir, PathBuf::from("/var/lib/bcd/telemetry"));
        Ok(())
    }

    #[test]
    fn metrics_listen_defaults_to_the_daemons_address_and_off_turns_it_off() {
        let default = Some(SocketAddr::from(([127, 0, 0, 1], 9402)));
        let with = |t: &str| {
            let w: TelemetryWire = toml::from_str(t).unwrap_or_else(|e| panic!("{e}"));
            w.validate_with("bcd.toml", PathBuf::from("/q"), default)
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let c = with("");
        assert_eq!(
            (c.metrics_listen, c.metrics_listen_is_default),
            (default, true)
        );
        let c = with(r#"metrics_listen = "off""#);
        assert_eq!(
            (c.metrics_listen, c.metrics_listen_is_default),
            (None, false)
        );
        let c = with(r#"metrics_listen = "127.0.0.1:9500""#);
        assert_eq!(
            c.metrics_listen,
            Some(SocketAddr::from(([127, 0, 0, 1], 9500)))
        );
        assert!(
            !c.metrics_listen_is_default,
            "an address the operator chose must bind or fail"
        );
        // Without a daemon default (the old entry point) an absent metrics_listen stays off.
        let w: TelemetryWire = toml::from_str("").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            w.validate("x", PathBuf::from("/q"))
                .map(|c| c.metrics_listen),
            Ok(None)
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let e = |t: &str| parse(t).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e(r#"metrics_listen = "0.0.0.0:9402""#).contains("telemetry.metrics_listen"));
        assert!(e(r#"interval = "10ms""#).contains("telemetry.interval"));
        assert!(e("[labels]\n__x = \"1\"").contains("telemetry.labels.__x"));
        assert!(e("[remote_write]\nurl = \"ftp://x\"").contains("telemetry.remote_write.url"));
        assert!(e("[otlp]\nurl = \"https://x\"\ncert_file = \"/c\"").contains("cert_file"));
        assert!(e("[otlp]\nurl = \"http://x\"\nca_file = \"/c\"").contains("https"));
    }
}
