#![no_main]
//! Telemetry's parsers: the procfs texts the host sampler reads (stat, meminfo, loadavg, diskstats, net/dev,
//! mounts), the `[telemetry]` table, and the remote-write and OTLP decoders (a receiver's view of our bodies).
//! No input may panic; a remote-write body that decodes re-encodes to one that decodes to the same request.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        use bcd::telemetry::host;
        let _ = host::parse_stat(text);
        let _ = host::parse_meminfo(text);
        let _ = host::parse_loadavg(text);
        let _ = host::parse_diskstats(text);
        let _ = host::parse_netdev(text);
        let _ = host::parse_mounts(text);
        if let Ok(w) = toml::from_str::<bc_telemetry::TelemetryWire>(text) {
            let _ = w.validate("fuzz.toml", std::path::PathBuf::from("/tmp/q"));
        }
    }
    if let Ok(req) = bc_telemetry::remote_write::decode(data) {
        let again = bc_telemetry::remote_write::decode(&bc_telemetry::remote_write::encode(&req))
            .expect("our own encoding decodes");
        assert_eq!(again.timeseries.len(), req.timeseries.len());
    }
    let _ = bc_telemetry::otlp::decode(data);
});
