//! OTLP/HTTP metrics, sans I/O: a snapshot becomes an `ExportMetricsServiceRequest` (protobuf, sent as
//! `application/x-protobuf` to `…/v1/metrics`). The messages are the subset of opentelemetry-proto's
//! `collector/metrics/v1`, `metrics/v1`, `common/v1` and `resource/v1` this exporter fills, written out for prost
//! with the upstream field numbers (opentelemetry-proto's own Rust crate pins another prost than the tree's).
//!
//! Gauges become `Gauge` points; counters become cumulative monotonic `Sum` points whose start time is when the
//! exporter started. A series that ended is sent once with the `NO_RECORDED_VALUE` flag (OTLP's stale marker).

use crate::budget::Admitted;
use crate::model::{Kind, Labels};

pub const CONTENT_TYPE: &str = "application/x-protobuf";
/// `DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK`.
pub const FLAG_NO_RECORDED_VALUE: u32 = 1;
/// `AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE`.
pub const CUMULATIVE: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportMetricsServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_metrics: Vec<ResourceMetrics>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceMetrics {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_metrics: Vec<ScopeMetrics>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ScopeMetrics {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub metrics: Vec<Metric>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub description: String,
    #[prost(string, tag = "3")]
    pub unit: String,
    #[prost(oneof = "MetricData", tags = "5, 7")]
    pub data: Option<MetricData>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum MetricData {
    #[prost(message, tag = "5")]
    Gauge(Gauge),
    #[prost(message, tag = "7")]
    Sum(Sum),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Gauge {
    #[prost(message, repeated, tag = "1")]
    pub data_points: Vec<NumberDataPoint>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sum {
    #[prost(message, repeated, tag = "1")]
    pub data_points: Vec<NumberDataPoint>,
    #[prost(int32, tag = "2")]
    pub aggregation_temporality: i32,
    #[prost(bool, tag = "3")]
    pub is_monotonic: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NumberDataPoint {
    #[prost(message, repeated, tag = "7")]
    pub attributes: Vec<KeyValue>,
    #[prost(fixed64, tag = "2")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "3")]
    pub time_unix_nano: u64,
    #[prost(oneof = "NumberValue", tags = "4, 6")]
    pub value: Option<NumberValue>,
    #[prost(uint32, tag = "8")]
    pub flags: u32,
}

#[derive(Clone, Copy, PartialEq, prost::Oneof)]
pub enum NumberValue {
    #[prost(double, tag = "4")]
    AsDouble(f64),
    #[prost(sfixed64, tag = "6")]
    AsInt(i64),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyValue {
    #[prost(oneof = "AnyValueKind", tags = "1")]
    pub value: Option<AnyValueKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum AnyValueKind {
    #[prost(string, tag = "1")]
    StringValue(String),
}

fn kv(k: &str, v: &str) -> KeyValue {
    KeyValue {
        key: k.to_string(),
        value: Some(AnyValue {
            value: Some(AnyValueKind::StringValue(v.to_string())),
        }),
    }
}

fn attributes(l: &Labels) -> Vec<KeyValue> {
    l.iter().map(|(k, v)| kv(k, v)).collect()
}

/// Who sends: the resource attributes (`service.name`, `host.name`, …) and the exporter's start (counters' start).
#[derive(Debug, Clone)]
pub struct Origin {
    pub resource: Labels,
    pub start_unix_nano: u64,
}

fn metric(name: &str, help: &str, unit: &str, kind: Kind, points: Vec<NumberDataPoint>) -> Metric {
    let data = match kind {
        Kind::Gauge => MetricData::Gauge(Gauge {
            data_points: points,
        }),
        Kind::Counter => MetricData::Sum(Sum {
            data_points: points,
            aggregation_temporality: CUMULATIVE,
            is_monotonic: true,
        }),
    };
    Metric {
        name: name.to_string(),
        description: help.to_string(),
        unit: unit.to_string(),
        data: Some(data),
    }
}

/// The export request for one admitted snapshot.
pub fn request(a: &Admitted, origin: &Origin) -> ExportMetricsServiceRequest {
    let t = u64::try_from(a.snapshot.timestamp_ms)
        .unwrap_or(0)
        .saturating_mul(1_000_000);
    let start = |kind: Kind| {
        if kind == Kind::Counter {
            origin.start_unix_nano.min(t)
        } else {
            0
        }
    };
    let mut metrics: Vec<Metric> = Vec::with_capacity(a.snapshot.families.len());
    for f in &a.snapshot.families {
        if f.series.is_empty() {
            continue;
        }
        let points = f
            .series
            .iter()
            .map(|s| NumberDataPoint {
                attributes: attributes(&s.labels),
                start_time_unix_nano: start(f.kind),
                time_unix_nano: t,
                value: Some(NumberValue::AsDouble(s.value)),
                flags: 0,
            })
            .collect();
        metrics.push(metric(&f.name, &f.help, f.unit, f.kind, points));
    }
    // Ended series, grouped by name, each point flagged as having no recorded value.
    let mut i = 0;
    while i < a.ended.len() {
        let e = &a.ended[i];
        let j = a.ended[i..]
            .iter()
            .position(|x| x.key.name != e.key.name)
            .map_or(a.ended.len(), |p| i + p);
        let points = a.ended[i..j]
            .iter()
            .map(|x| NumberDataPoint {
                attributes: attributes(&x.key.labels),
                start_time_unix_nano: start(x.kind),
                time_unix_nano: t,
                value: None,
                flags: FLAG_NO_RECORDED_VALUE,
            })
            .collect();
        metrics.push(metric(&e.key.name, "", e.unit, e.kind, points));
        i = j;
    }
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(Resource {
                attributes: attributes(&origin.resource),
            }),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: "bc-telemetry".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                }),
                metrics,
            }],
        }],
    }
}

pub fn encode(req: &ExportMetricsServiceRequest) -> Vec<u8> {
    prost::Message::encode_to_vec(req)
}

pub fn decode(body: &[u8]) -> Result<ExportMetricsServiceRequest, prost::DecodeError> {
    <ExportMetricsServiceRequest as prost::Message>::decode(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::SeriesBook;
    use crate::model::{Family, Snapshot};

    #[test]
    fn gauges_counters_and_ended_series() {
        let mut book = SeriesBook::new(10);
        let g = Family::new("DCGM_FI_DEV_GPU_TEMP", Kind::Gauge, "Cel", "temp")
            .with(Labels::new().with("gpu", "0"), 34.0)
            .with(Labels::new().with("gpu", "1"), 35.0);
        let c = Family::new(
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            Kind::Counter,
            "mJ",
            "energy",
        )
        .with(Labels::new().with("gpu", "0"), 1e9);
        book.admit(
            Snapshot {
                timestamp_ms: 1_000,
                families: vec![g, c.clone()],
            },
            &[],
        );
        let a = book.admit(
            Snapshot {
                timestamp_ms: 2_000,
                families: vec![c],
            },
            &[],
        );
        let origin = Origin {
            resource: Labels::new().with("service.name", "bcd"),
            start_unix_nano: 500_000_000,
        };
        let req = decode(&encode(&request(&a, &origin))).unwrap_or_else(|e| panic!("{e}"));
        let m = &req.resource_metrics[0].scope_metrics[0].metrics;
        assert_eq!(m.len(), 2);
        match &m[0].data {
            Some(MetricData::Sum(s)) => {
                assert!(s.is_monotonic);
                assert_eq!(s.aggregation_temporality, CUMULATIVE);
                assert_eq!(s.data_points[0].value, Some(NumberValue::AsDouble(1e9)));
                assert_eq!(s.data_points[0].start_time_unix_nano, 500_000_000);
                assert_eq!(s.data_points[0].time_unix_nano, 2_000_000_000);
            }
            other => panic!("{other:?}"),
        }
        match &m[1].data {
            Some(MetricData::Gauge(g)) => {
                assert_eq!(g.data_points.len(), 2);
                assert!(
                    g.data_points
                        .iter()
                        .all(|p| p.flags == FLAG_NO_RECORDED_VALUE && p.value.is_none())
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
