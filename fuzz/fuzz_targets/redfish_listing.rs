#![no_main]
use libfuzzer_sys::fuzz_target;

// Collection paging as a BMC could drive it: the bytes are pages separated by NUL, each decoded leniently as a
// Collection and fed to the pure Listing (nextLink, loops, the page cap, duplicates, counts). Whatever the pages
// say, the listing ends (never more pages than given or than its cap) and nothing panics.
fuzz_target!(|data: &[u8]| {
    use bcd_site::redfish::{decode, listing::Listing, models::Collection};
    let mut listing = Listing::new("/redfish/v1/Systems");
    let mut page = "/redfish/v1/Systems".to_owned();
    for chunk in data.split(|b| *b == 0) {
        match decode::decode::<Collection>(chunk) {
            Ok(d) => match listing.page(&page, d.value, &d.warnings) {
                Some(next) => page = next,
                None => break,
            },
            Err(e) => {
                listing.failed(&page, &e.to_string());
                break;
            }
        }
    }
    let listed = listing.into_listed();
    assert!(listed.pages <= bcd_site::redfish::listing::MAX_PAGES);
    for w in &listed.warnings {
        let _ = w.len();
    }
});
