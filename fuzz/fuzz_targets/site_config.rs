#![no_main]
//! `site.toml` parsing and validation (`bcd site serve`): no input may panic, and every machine a valid config
//! accepts renders an iPXE script (validation and rendering agree).
use bcd_site::serve::SiteConfig;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = SiteConfig::from_toml(text, Path::new("fuzz.toml")) else {
        return;
    };
    let catalog = config.netboot.catalog();
    for mac in config.netboot.dhcp_table_macs() {
        let boot = catalog.get(&mac).expect("table and catalog agree");
        bcd_site::http::render_script(&mac, boot).expect("a validated boot renders");
    }
});
