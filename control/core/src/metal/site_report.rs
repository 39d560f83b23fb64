//! What a site agent reports about its segment (`SiteReport`, issue 13): its boot HTTP URL, the DHCP requests it saw
//! from machines (MAC and time) and the artifacts it caches. Outside input: checked here, before anything is
//! stored, so a report is either taken whole or refused with the field named.

/// Sightings (and cached digests) in one report, at most.
pub const MAX_SIGHTINGS: usize = 4096;

/// A report that passed [`check`]: MACs canonical (`aa:bb:cc:dd:ee:ff`), times never later than `now`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedReport {
    /// `None`: the report named no boot URL (the stored one is kept).
    pub boot_url: Option<String>,
    pub macs: Vec<String>,
    /// One per MAC, in the same order: when the agent saw it (clamped to `now`).
    pub seen_ms: Vec<i64>,
    pub cached: Vec<String>,
}

/// `aa:bb:cc:dd:ee:ff` from a MAC written with `:`, `-`, `.` or no separators, any case; `None` if it is not one.
pub fn canonical_mac(mac: &str) -> Option<String> {
    let hex: String = mac
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() != 12 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let parts: Vec<&str> = (0..6).map(|i| &hex[i * 2..i * 2 + 2]).collect();
    Some(parts.join(":"))
}

/// A lowercase hex SHA-256 digest.
fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// An `http://` or `https://` base URL with a host and nothing else odd, at most 256 characters.
pub fn check_boot_url(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"));
    let ok = url.len() <= 256
        && rest.is_some_and(|r| {
            let host = r.split('/').next().unwrap_or_default();
            !host.is_empty() && !host.contains('@')
        })
        && url
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\\' | b'<' | b'>'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "boot_url {:?}: expected http(s)://host[:port] (at most 256 characters)",
            url.chars().take(64).collect::<String>()
        ))
    }
}

/// Checks one report: `dhcp` as (MAC, seen at, Unix ms), `cached` digests, `boot_url` (empty: none), at `now_ms`.
/// Err says which field is wrong and how.
pub fn check(
    boot_url: &str,
    dhcp: &[(&str, i64)],
    cached: &[String],
    now_ms: i64,
) -> Result<CheckedReport, String> {
    if dhcp.len() > MAX_SIGHTINGS {
        return Err(format!(
            "dhcp: {} sightings; at most {MAX_SIGHTINGS} per report",
            dhcp.len()
        ));
    }
    let mut macs = Vec::with_capacity(dhcp.len());
    let mut seen_ms = Vec::with_capacity(dhcp.len());
    for (i, (mac, at)) in dhcp.iter().enumerate() {
        let mac = canonical_mac(mac).ok_or_else(|| {
            format!(
                "dhcp[{i}]: mac {:?} is not a MAC address: use aa:bb:cc:dd:ee:ff",
                mac.chars().take(32).collect::<String>()
            )
        })?;
        macs.push(mac);
        // The agent's clock: never later than ours.
        seen_ms.push((*at).min(now_ms));
    }
    if cached.len() > MAX_SIGHTINGS || cached.iter().any(|h| !is_sha256_hex(h)) {
        return Err(format!(
            "cached: at most {MAX_SIGHTINGS} lowercase hex SHA-256 digests"
        ));
    }
    let boot_url = match boot_url {
        "" => None,
        url => {
            check_boot_url(url)?;
            Some(url.to_string())
        }
    };
    Ok(CheckedReport {
        boot_url,
        macs,
        seen_ms,
        cached: cached.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_good_report_is_taken_with_macs_canonical_and_times_clamped() {
        let digest = "a".repeat(64);
        let r = check(
            "http://10.0.0.1:8080",
            &[("AA-BB-CC-DD-EE-FF", 5), ("aabb.ccdd.ee01", 99)],
            std::slice::from_ref(&digest),
            50,
        )
        .expect("a good report");
        assert_eq!(r.macs, ["aa:bb:cc:dd:ee:ff", "aa:bb:cc:dd:ee:01"]);
        assert_eq!(r.seen_ms, [5, 50]);
        assert_eq!(r.boot_url.as_deref(), Some("http://10.0.0.1:8080"));
        assert_eq!(check("", &[], &[], 0).expect("empty").boot_url, None);
    }

    #[test]
    fn each_bad_field_is_refused_and_named() {
        let e = check("", &[("aa:bb", 1)], &[], 0).expect_err("refused");
        assert!(e.starts_with("dhcp[0]: mac"), "{e}");
        let e = check("", &[], &["A".repeat(64)], 0).expect_err("refused");
        assert!(e.starts_with("cached:"), "{e}");
        for url in [
            "ftp://x",
            "http://",
            "http://u@h/",
            "http://h/\"",
            &format!("http://{}", "h".repeat(300)),
        ] {
            let e = check(url, &[], &[], 0).expect_err("refused");
            assert!(e.starts_with("boot_url"), "{url}: {e}");
        }
        let many: Vec<(&str, i64)> = vec![("aa:bb:cc:dd:ee:ff", 0); MAX_SIGHTINGS + 1];
        assert!(
            check("", &many, &[], 0)
                .expect_err("refused")
                .starts_with("dhcp: 4097")
        );
        // A multi-byte character where a hex digit should be is refused, not sliced through.
        assert!(check("", &[("aa:bb:cc:dd:ee:é", 0)], &[], 0).is_err());
    }
}
