#![no_main]
//! A site agent's `SiteReport` (protobuf from the agent, issue 13): decoded as the gateway decodes it, then checked
//! by `bc_core::metal::site_report::check` before anything is stored. Nothing panics; a report that passes has only
//! canonical MACs, times no later than now, lowercase SHA-256 digests and an http(s) boot URL, and checking it again
//! in its canonical form gives the same result.
use bc_core::metal::site_report::{self, MAX_SIGHTINGS};
use bc_proto::v1;
use libfuzzer_sys::fuzz_target;
use prost::Message;

const NOW: i64 = 1_800_000_000_000;

fuzz_target!(|data: &[u8]| {
    let Ok(report) = v1::SiteReport::decode(data) else {
        return;
    };
    let dhcp: Vec<(&str, i64)> = report
        .dhcp
        .iter()
        .map(|d| (d.mac.as_str(), d.at_unix_ms))
        .collect();
    let Ok(checked) = site_report::check(&report.boot_url, &dhcp, &report.cached, NOW) else {
        return;
    };
    assert!(checked.macs.len() <= MAX_SIGHTINGS && checked.macs.len() == checked.seen_ms.len());
    for (mac, at) in checked.macs.iter().zip(&checked.seen_ms) {
        assert_eq!(
            site_report::canonical_mac(mac).as_deref(),
            Some(mac.as_str())
        );
        assert!(*at <= NOW);
    }
    if let Some(url) = &checked.boot_url {
        assert!(url.starts_with("http://") || url.starts_with("https://"));
    }
    let again: Vec<(&str, i64)> = checked
        .macs
        .iter()
        .map(String::as_str)
        .zip(checked.seen_ms.iter().copied())
        .collect();
    let url = checked.boot_url.clone().unwrap_or_default();
    assert_eq!(
        site_report::check(&url, &again, &checked.cached, NOW),
        Ok(checked.clone())
    );
});
