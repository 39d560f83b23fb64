//! Prometheus remote write 1.0, sans I/O: a snapshot becomes a `prometheus.WriteRequest` (protobuf), snappy
//! block-compressed. The messages are the spec's `prompb` types written out for prost (field numbers as in
//! prometheus/prompb/remote.proto and types.proto); [`decode`] reads a body back (tests, the fuzz target).
//!
//! Every series carries `__name__` and its labels sorted by name (the spec requires it); a series that ended is
//! sent once with Prometheus's stale marker, a NaN with the bit pattern [`STALE_NAN_BITS`].

use crate::budget::Admitted;

/// The stale-marker NaN Prometheus uses (`value.StaleNaN`).
pub const STALE_NAN_BITS: u64 = 0x7ff0_0000_0000_0002;
pub const CONTENT_TYPE: &str = "application/x-protobuf";
pub const CONTENT_ENCODING: &str = "snappy";
pub const VERSION_HEADER: &str = "X-Prometheus-Remote-Write-Version";
pub const VERSION: &str = "0.1.0";
/// A body that decompresses past this is refused by [`decode`].
pub const MAX_DECODED_BYTES: usize = 64 << 20;

#[derive(Clone, PartialEq, prost::Message)]
pub struct WriteRequest {
    #[prost(message, repeated, tag = "1")]
    pub timeseries: Vec<TimeSeries>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TimeSeries {
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<Label>,
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<Sample>,
}

#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, prost::Message)]
pub struct Label {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    #[prost(double, tag = "1")]
    pub value: f64,
    #[prost(int64, tag = "2")]
    pub timestamp: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("the body is not snappy block-compressed data")]
    Snappy(#[source] snap::Error),
    #[error("the body decompresses to {0} bytes, more than the {MAX_DECODED_BYTES} accepted")]
    TooLarge(usize),
    #[error("the body is not a prometheus.WriteRequest")]
    Protobuf(#[source] prost::DecodeError),
}

fn series_labels(name: &str, labels: &crate::model::Labels) -> Vec<Label> {
    let mut out: Vec<Label> = Vec::with_capacity(labels.len() + 1);
    out.push(Label {
        name: "__name__".into(),
        value: name.to_string(),
    });
    out.extend(labels.iter().map(|(n, v)| Label {
        name: n.to_string(),
        value: v.to_string(),
    }));
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The WriteRequest for one admitted snapshot: one sample per series, a stale marker per ended series.
pub fn request(a: &Admitted) -> WriteRequest {
    let ts = a.snapshot.timestamp_ms;
    let mut timeseries = Vec::with_capacity(a.sample_count());
    for f in &a.snapshot.families {
        for s in &f.series {
            timeseries.push(TimeSeries {
                labels: series_labels(&f.name, &s.labels),
                samples: vec![Sample {
                    value: s.value,
                    timestamp: ts,
                }],
            });
        }
    }
    for e in &a.ended {
        timeseries.push(TimeSeries {
            labels: series_labels(&e.key.name, &e.key.labels),
            samples: vec![Sample {
                value: f64::from_bits(STALE_NAN_BITS),
                timestamp: ts,
            }],
        });
    }
    WriteRequest { timeseries }
}

/// The HTTP body: the request's protobuf encoding, snappy block-compressed.
pub fn encode(req: &WriteRequest) -> Vec<u8> {
    let raw = prost::Message::encode_to_vec(req);
    // Compressing bytes we just made cannot fail (only an input over snappy's ~4 GiB limit would).
    snap::raw::Encoder::new()
        .compress_vec(&raw)
        .unwrap_or_default()
}

/// Reads a body back (what a receiver does).
pub fn decode(body: &[u8]) -> Result<WriteRequest, DecodeError> {
    let len = snap::raw::decompress_len(body).map_err(DecodeError::Snappy)?;
    if len > MAX_DECODED_BYTES {
        return Err(DecodeError::TooLarge(len));
    }
    let raw = snap::raw::Decoder::new()
        .decompress_vec(body)
        .map_err(DecodeError::Snappy)?;
    <WriteRequest as prost::Message>::decode(raw.as_slice()).map_err(DecodeError::Protobuf)
}

/// True when `v` is Prometheus's stale marker.
pub fn is_stale(v: f64) -> bool {
    v.to_bits() == STALE_NAN_BITS
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::SeriesBook;
    use crate::model::{Family, Kind, Labels, Snapshot};

    #[test]
    fn round_trips_with_sorted_labels_and_stale_markers() {
        let mut book = SeriesBook::new(100);
        let f = |n: usize| {
            let mut fam = Family::new("DCGM_FI_DEV_GPU_TEMP", Kind::Gauge, "Cel", "t");
            for i in 0..n {
                fam.push(
                    Labels::new()
                        .with("gpu", i.to_string())
                        .with("UUID", format!("GPU-{i}")),
                    30.0 + i as f64,
                );
            }
            fam
        };
        book.admit(
            Snapshot {
                timestamp_ms: 1000,
                families: vec![f(2)],
            },
            &[],
        );
        let a = book.admit(
            Snapshot {
                timestamp_ms: 2000,
                families: vec![f(1)],
            },
            &[],
        );
        let req = decode(&encode(&request(&a))).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(req.timeseries.len(), 2);
        let names: Vec<&str> = req.timeseries[0]
            .labels
            .iter()
            .map(|l| l.name.as_str())
            .collect();
        assert_eq!(names, vec!["UUID", "__name__", "gpu"]);
        assert_eq!(req.timeseries[0].samples[0].value, 30.0);
        assert_eq!(req.timeseries[0].samples[0].timestamp, 2000);
        assert!(is_stale(req.timeseries[1].samples[0].value));
        assert_eq!(req.timeseries[1].labels[2].value, "1");
    }

    #[test]
    fn garbage_is_refused_not_panicked_on() {
        assert!(decode(b"\xff\xff\xff\xff\xff").is_err());
        assert!(
            decode(
                &snap::raw::Encoder::new()
                    .compress_vec(b"\x0a\xff")
                    .unwrap_or_default()
            )
            .is_err()
        );
    }
}
