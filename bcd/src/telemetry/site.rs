//! `bcd site` telemetry: the boot services' counters (proxy DHCP, TFTP, boot HTTP) and the BMC operations'
//! outcomes and latencies, read from bcd-site's own counters at each collection (bcd-site knows nothing of the
//! exporter). `bcd site run` exports them when its agent config (bcd.toml) has a `[telemetry]` table.

use bc_telemetry::{Collector, Family, Kind, Labels};
use bcd_site::redfish::metrics as bmc;
use bcd_site::serve::SiteCounters;
use std::sync::atomic::Ordering;

pub struct SiteSampler {
    pub counters: SiteCounters,
}

fn counter(name: &str, help: &str, v: u64) -> Family {
    Family::new(name, Kind::Counter, "1", help).with(Labels::new(), v as f64)
}

impl Collector for SiteSampler {
    fn collect(&self, _at_ms: i64, out: &mut Vec<Family>) {
        let d = self.counters.dhcp.snapshot();
        out.push(counter(
            "bc_site_dhcp_requests_total",
            "DHCP requests received (ports 67 and 4011).",
            d.received,
        ));
        out.push(counter(
            "bc_site_dhcp_replies_total",
            "Proxy DHCP replies sent (both ports).",
            d.replied,
        ));
        out.push(counter(
            "bc_site_dhcp_replies_4011_total",
            "Of the replies, boot-server ACKs on port 4011.",
            d.replied_4011,
        ));
        out.push(counter(
            "bc_site_dhcp_decode_failed_total",
            "DHCP packets that did not decode (dropped).",
            d.decode_failed,
        ));
        out.push(counter(
            "bc_site_dhcp_send_failed_total",
            "DHCP replies the socket refused.",
            d.send_failed,
        ));
        out.push(counter(
            "bc_site_dhcp_rogue_offers_total",
            "PXE offers seen from other servers on the segment.",
            d.rogue_seen,
        ));
        let mut ignored = Family::new(
            "bc_site_dhcp_ignored_total",
            Kind::Counter,
            "1",
            "DHCP requests not answered, by reason.",
        );
        for (reason, n) in &d.ignored {
            ignored.push(Labels::new().with("reason", *reason), *n as f64);
        }
        out.push(ignored);
        let t = &self.counters.tftp;
        let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        out.push(counter(
            "bc_site_tftp_transfers_started_total",
            "TFTP transfers started.",
            get(&t.started),
        ));
        out.push(counter(
            "bc_site_tftp_transfers_completed_total",
            "TFTP transfers completed.",
            get(&t.completed),
        ));
        out.push(counter(
            "bc_site_tftp_transfers_failed_total",
            "TFTP transfers that failed (timeout, error).",
            get(&t.failed),
        ));
        out.push(counter(
            "bc_site_tftp_refused_total",
            "TFTP requests refused (not found, outside the root).",
            get(&t.refused),
        ));
        out.push(counter(
            "bc_site_tftp_malformed_total",
            "TFTP packets that did not decode.",
            get(&t.malformed),
        ));
        let h = self.counters.http.snapshot();
        out.push(counter(
            "bc_site_http_requests_total",
            "Boot HTTP requests.",
            h.requests,
        ));
        out.push(counter(
            "bc_site_http_scripts_total",
            "iPXE scripts served.",
            h.scripts,
        ));
        out.push(counter(
            "bc_site_http_files_total",
            "File responses started (200 or 206).",
            h.files,
        ));
        out.push(counter(
            "bc_site_http_not_found_total",
            "404 answers.",
            h.not_found,
        ));
        out.push(counter(
            "bc_site_http_refused_total",
            "Requests refused (403, 405, 413, 416).",
            h.refused,
        ));
        out.push(counter(
            "bc_site_http_bad_requests_total",
            "Unparseable requests and header timeouts.",
            h.bad_requests,
        ));
        out.push(
            Family::new(
                "bc_site_http_sent_bytes_total",
                Kind::Counter,
                "By",
                "File body bytes sent.",
            )
            .with(Labels::new(), h.bytes_sent as f64),
        );
        out.push(counter(
            "bc_site_http_aborted_total",
            "Responses cut short.",
            h.aborted,
        ));
        let ops = bmc::operations();
        let mut total = Family::new(
            "bc_site_bmc_operations_total",
            Kind::Counter,
            "1",
            "BMC operations by outcome.",
        );
        let mut buckets = Family::new(
            "bc_site_bmc_operation_duration_seconds_bucket",
            Kind::Counter,
            "s",
            "BMC operation latency (connect to logout).",
        );
        let mut sum = Family::new(
            "bc_site_bmc_operation_duration_seconds_sum",
            Kind::Counter,
            "s",
            "BMC operation latency.",
        );
        let mut count = Family::new(
            "bc_site_bmc_operation_duration_seconds_count",
            Kind::Counter,
            "1",
            "BMC operations timed.",
        );
        for op in bmc::OPS {
            let s = ops.snapshot(op);
            total.push(
                Labels::new().with("op", op).with("outcome", "ok"),
                s.ok as f64,
            );
            total.push(
                Labels::new().with("op", op).with("outcome", "failed"),
                s.failed as f64,
            );
            for (i, c) in s.cumulative.iter().enumerate() {
                let le = bmc::BUCKETS
                    .get(i)
                    .map_or_else(|| "+Inf".to_string(), |b| format!("{b:?}"));
                buckets.push(Labels::new().with("op", op).with("le", le), *c as f64);
            }
            sum.push(Labels::new().with("op", op), s.total_micros as f64 / 1e6);
            count.push(Labels::new().with("op", op), (s.ok + s.failed) as f64);
        }
        out.extend([total, buckets, sum, count]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn site_counters_become_families() {
        let counters = SiteCounters::default();
        counters.tftp.started.fetch_add(3, Ordering::Relaxed);
        bmc::operations().record("power", true, std::time::Duration::from_millis(300));
        let s = SiteSampler { counters };
        let mut out = Vec::new();
        s.collect(0, &mut out);
        let snap = bc_telemetry::Snapshot {
            timestamp_ms: 0,
            families: out,
        };
        assert_eq!(
            snap.value("bc_site_tftp_transfers_started_total", &[]),
            Some(3.0)
        );
        assert!(
            snap.value(
                "bc_site_bmc_operations_total",
                &[("op", "power"), ("outcome", "ok")]
            ) >= Some(1.0)
        );
        assert!(
            snap.value(
                "bc_site_bmc_operation_duration_seconds_bucket",
                &[("op", "power"), ("le", "0.5")]
            ) >= Some(1.0)
        );
        assert_eq!(snap.value("bc_site_http_requests_total", &[]), Some(0.0));
    }
}
