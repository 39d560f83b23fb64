//! The vendor quirk table: what differs between BMCs, kept as data. Each entry says what it works around and where
//! that behaviour is publicly documented or reported; the client consults [`Quirks`] and has no vendor `if`s.
//!
//! The vendor is identified from every mark a BMC leaves: the service root's `Vendor` and `Product`, the keys of its
//! `Oem` object (BMCs that predate `Vendor`, such as Supermicro's Redfish 1.0-1.9 firmware), its UUID (Supermicro
//! writes `00000000-0000-0000-0000-<BMC MAC>` there, so the MAC's IEEE OUI names the maker), and the first manager's
//! `Manufacturer`, `Model` and `Oem` keys; the first entry whose needle occurs (case-insensitive, whole words) wins,
//! and [`GENERIC`] applies when none does. Entries were written from vendor documentation and public bug
//! reports, not verified here on the hardware; correct them when a real BMC disagrees.

use std::time::Duration;

/// How `BootSourceOverrideMode` is treated in a boot-override PATCH.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverrideMode {
    /// Leave it out (the standard's way: PATCH only what changes).
    Omit,
    /// Always send it (`UEFI` unless the system reports `Legacy`).
    Send,
    /// Never send it, even for UEFI HTTP boot: the property is read-only there and a PATCH carrying it fails.
    Forbidden,
}

/// When a PATCH carries `If-Match`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfMatch {
    /// When the resource had an ETag (header or `@odata.etag`).
    WhenKnown,
    /// Always; without an ETag from the BMC, `*`.
    Always,
}

/// Behaviour that differs per BMC family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quirks {
    /// Short name for logs and the inventory summary.
    pub name: &'static str,
    /// The vendor as an operator names it, for the inventory's vendor line when the BMC states none.
    pub vendor: &'static str,
    pub override_mode: OverrideMode,
    pub if_match: IfMatch,
    /// Message ids (substring match) on a 4xx/5xx that mean "busy, try again later", in addition to 409/503/429 and
    /// the Base registry's [`BASE_BUSY_IDS`].
    pub busy_message_ids: &'static [&'static str],
    /// Message ids on a failed Reset that mean "the system is already in that power state" (success).
    pub already_in_state_ids: &'static [&'static str],
    /// Time to wait after a power change before the next action is accepted.
    pub settle_after_power: Duration,
    /// How long a PowerState change may take to show after a Reset was accepted.
    pub power_apply_time: Duration,
}

/// Base registry message ids that mean "try again later" on any BMC.
pub const BASE_BUSY_IDS: &[&str] = &[
    "ResourceInUse",
    "ServiceTemporarilyUnavailable",
    "ServiceInUnknownState",
];

/// The standard behaviour, for BMCs not in the table (and OpenBMC, sushy-tools, the DMTF mockups).
pub const GENERIC: Quirks = Quirks {
    name: "generic",
    vendor: "not stated",
    override_mode: OverrideMode::Omit,
    if_match: IfMatch::WhenKnown,
    busy_message_ids: &[],
    already_in_state_ids: &[],
    settle_after_power: Duration::ZERO,
    power_apply_time: Duration::from_secs(30),
};

/// One row: needles matched against the BMC's identity, and the quirks they select.
#[derive(Debug)]
pub struct QuirkEntry {
    pub needles: &'static [&'static str],
    pub quirks: Quirks,
}

pub static TABLE: &[QuirkEntry] = &[
    // Dell iDRAC 8/9.
    // - A Reset to the state the server is already in answers 409 with message PSU501 ("already powered on") or
    //   PSU502 ("already powered off") (iDRAC9 Redfish API Guide, "Supported Action — Reset", status codes): the
    //   wanted state holds, so that 409 is success, not busy.
    // - Power actions issued right after a power change are refused until the server settles: wait a little
    //   between them (409s that are not PSU501/PSU502 are retried as busy within the budget).
    QuirkEntry {
        needles: &["dell", "idrac"],
        quirks: Quirks {
            name: "dell-idrac",
            vendor: "Dell",
            override_mode: OverrideMode::Omit,
            if_match: IfMatch::WhenKnown,
            busy_message_ids: &[],
            already_in_state_ids: &["PSU501", "PSU502"],
            settle_after_power: Duration::from_secs(5),
            power_apply_time: Duration::from_secs(60),
        },
    },
    // HPE iLO 4/5/6.
    // - `BootSourceOverrideMode` is read-only on some ProLiant generations: a one-time-boot PATCH that carries it
    //   (even unchanged) fails with 400 (ansible-collections/community.general#3509, fixed in #3581 by not sending
    //   the mode unless asked). Never send it.
    // - A Reset the current power state does not allow answers 400 `InvalidOperationForSystemState` (iLO message
    //   registry: "not successful due to the current power state") rather than 409: for on/off that means the
    //   wanted state already holds (PowerState is checked before the POST too; restarts never read it so).
    QuirkEntry {
        needles: &["hpe", "hewlett", "ilo"],
        quirks: Quirks {
            name: "hpe-ilo",
            vendor: "HPE",
            override_mode: OverrideMode::Forbidden,
            if_match: IfMatch::WhenKnown,
            busy_message_ids: &[],
            already_in_state_ids: &["InvalidOperationForSystemState"],
            settle_after_power: Duration::from_secs(2),
            power_apply_time: Duration::from_secs(60),
        },
    },
    // Supermicro (X11/X12/H12 BMCs; some newer boards are AMI-based and also match the AMI entry's needles but
    // this one comes first).
    // - A boot-override PATCH without `BootSourceOverrideMode` makes the BMC revert the mode to its default
    //   (DMTF/Redfishtool#106, confirmed by Supermicro as by design): always send the mode.
    // - If-Match on every PATCH: AMI-based Supermicro boards refuse PATCH without it (see the AMI entry); sending
    //   the ETag just read is harmless on the others. (Not confirmed here on X11/X12 hardware.)
    // - An accepted override that does not stick (200 OK, read-back shows Enabled=Disabled, Mode=Legacy) is
    //   reported on AMI-based Supermicro boards (bmc-toolbox/bmclib#459): the client's read-back catches it.
    QuirkEntry {
        needles: &["supermicro"],
        quirks: Quirks {
            name: "supermicro",
            vendor: "Supermicro",
            override_mode: OverrideMode::Send,
            if_match: IfMatch::Always,
            busy_message_ids: &[],
            already_in_state_ids: &[],
            settle_after_power: Duration::from_secs(5),
            power_apply_time: Duration::from_secs(60),
        },
    },
    // AMI MegaRAC (Lenovo ThinkSystem AMD "AMI Redfish Server", Gigabyte, ASRock Rack, many ODMs).
    // - PATCH without If-Match fails with `Ami.1.0.PreconditionHeaderMissing` (stmcginnis/gofish#171): always
    //   send If-Match (the ETag from the GET, `*` without one).
    // - A Reset is answered 202 with a Task and applied seconds later (Lenovo TSM docs: "allow 5 seconds and
    //   verify PowerState"): the client polls PowerState instead of trusting the 202.
    // - Boot-override changes while the host is in POST are refused as transient (POST-time lock), with the Base
    //   registry's ResourceInUse / ServiceTemporarilyUnavailable ids (which the client retries for every vendor)
    //   or 409/503; the mode must be sent as for Supermicro (the read-back reports a mode reverted to Legacy).
    QuirkEntry {
        needles: &["ami", "american megatrends", "megarac"],
        quirks: Quirks {
            name: "ami-megarac",
            vendor: "AMI",
            override_mode: OverrideMode::Send,
            if_match: IfMatch::Always,
            busy_message_ids: &[],
            already_in_state_ids: &[],
            settle_after_power: Duration::from_secs(5),
            power_apply_time: Duration::from_secs(60),
        },
    },
];

/// IEEE OUIs of BMC makers that put the BMC's MAC into the service root UUID (`00000000-0000-0000-0000-<MAC>`),
/// with the needle they stand for. Super Micro Computer: 00:25:90, 0C:C4:7A, AC:1F:6B, 3C:EC:EF.
const UUID_OUIS: &[(&str, &str)] = &[
    ("002590", "supermicro"),
    ("0cc47a", "supermicro"),
    ("ac1f6b", "supermicro"),
    ("3cecef", "supermicro"),
];

/// The identity marks a BMC offers: `(where, value)`, e.g. `("Oem key", "Supermicro")`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BmcIdentity {
    marks: Vec<(&'static str, String)>,
}

impl BmcIdentity {
    /// Marks without their origin (tests, and callers that only have strings).
    pub fn new<'a>(parts: impl IntoIterator<Item = &'a str>) -> Self {
        BmcIdentity::from_marks(parts.into_iter().map(|p| ("mark", p.to_owned())))
    }

    pub fn from_marks(marks: impl IntoIterator<Item = (&'static str, String)>) -> Self {
        BmcIdentity {
            marks: marks
                .into_iter()
                .filter(|(_, v)| !v.trim().is_empty())
                .collect(),
        }
    }

    /// The marks, lowercased and joined (for logs).
    pub fn as_str(&self) -> String {
        self.marks
            .iter()
            .map(|(_, v)| v.to_ascii_lowercase())
            .collect::<Vec<_>>()
            .join(" | ")
    }

    pub fn marks(&self) -> &[(&'static str, String)] {
        &self.marks
    }
}

/// The needle a UUID of the `00000000-0000-0000-0000-<MAC>` form stands for.
fn uuid_needle(uuid: &str) -> Option<&'static str> {
    let mac = uuid.trim().to_ascii_lowercase();
    let mac = mac.strip_prefix("00000000-0000-0000-0000-")?;
    if mac.len() != 12 || !mac.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    UUID_OUIS
        .iter()
        .find(|(oui, _)| mac.starts_with(oui))
        .map(|(_, needle)| *needle)
}

/// The quirks for a BMC and the mark that selected them (`Oem key "Supermicro"`), or [`GENERIC`] and `None`.
/// Needles match whole words so that `ami` does not match `Dynamic`.
pub fn recognise(identity: &BmcIdentity) -> (&'static Quirks, Option<String>) {
    for entry in TABLE {
        for (origin, value) in &identity.marks {
            let lower = value.to_ascii_lowercase();
            let words: Vec<&str> = lower
                .split(|c: char| !c.is_ascii_alphanumeric())
                .filter(|w| !w.is_empty())
                .collect();
            let from_uuid = (*origin == "UUID").then(|| uuid_needle(value)).flatten();
            let hit = entry.needles.iter().any(|needle| {
                let parts: Vec<&str> = needle.split(' ').collect();
                from_uuid == Some(*needle)
                    || words.windows(parts.len()).any(|w| w == parts.as_slice())
            });
            if hit {
                return (&entry.quirks, Some(format!("{origin} {value:?}")));
            }
        }
    }
    (&GENERIC, None)
}

/// The quirks for a BMC: the first matching table entry, else [`GENERIC`].
pub fn lookup(identity: &BmcIdentity) -> &'static Quirks {
    recognise(identity).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifies_vendors_by_whole_words() {
        let name = |parts: &[&str]| lookup(&BmcIdentity::new(parts.iter().copied())).name;
        assert_eq!(
            name(&["Dell", "Integrated Dell Remote Access Controller"]),
            "dell-idrac"
        );
        assert_eq!(name(&["HPE", "iLO 5"]), "hpe-ilo");
        assert_eq!(name(&["", "Hewlett Packard Enterprise"]), "hpe-ilo");
        assert_eq!(name(&["Supermicro"]), "supermicro");
        assert_eq!(name(&["AMI", "AMI Redfish Server"]), "ami-megarac");
        assert_eq!(name(&["American Megatrends"]), "ami-megarac");
        assert_eq!(name(&["Contoso", "Dynamic BMC"]), "generic");
        assert_eq!(name(&[]), "generic");
    }

    #[test]
    fn identifies_by_oem_key_manager_and_uuid_without_a_vendor() {
        let id = |marks: &[(&'static str, &str)]| {
            recognise(&BmcIdentity::from_marks(
                marks.iter().map(|(o, v)| (*o, (*v).to_owned())),
            ))
        };
        let (q, mark) = id(&[("UUID", "00000000-0000-0000-0000-0CC47A847624")]);
        assert_eq!(q.name, "supermicro");
        assert_eq!(
            mark.as_deref(),
            Some("UUID \"00000000-0000-0000-0000-0CC47A847624\"")
        );
        assert_eq!(id(&[("Oem key", "Supermicro")]).0.name, "supermicro");
        assert_eq!(id(&[("Manager Model", "iLO 5")]).0.name, "hpe-ilo");
        assert_eq!(id(&[("Manager Oem key", "Dell")]).0.name, "dell-idrac");
        // A UUID that is not a MAC, or another maker's MAC, says nothing.
        assert_eq!(
            id(&[("UUID", "0CC47A84-7624-0000-0000-000000000000")])
                .0
                .name,
            "generic"
        );
        assert_eq!(
            id(&[("UUID", "00000000-0000-0000-0000-B42E99BADE15")])
                .0
                .name,
            "generic"
        );
    }
}
