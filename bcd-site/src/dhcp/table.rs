//! Which MACs may netboot: exact addresses and prefixes (load generators and whole vendor OUIs).

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

/// An Ethernet hardware address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MacAddr(pub [u8; 6]);

/// A MAC or MAC prefix that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid MAC {input:?}: expected hex bytes separated by ':' or '-' ({why})")]
pub struct MacParseError {
    pub input: String,
    pub why: &'static str,
}

impl fmt::Display for MacAddr {
    /// Lowercase, colon separated: the form iPXE's `${mac}` expands to and the one used in `/boot/<mac>.ipxe`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl FromStr for MacAddr {
    type Err = MacParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = parse_hex_bytes(s)?;
        let arr: [u8; 6] = bytes.as_slice().try_into().map_err(|_| MacParseError {
            input: s.to_owned(),
            why: "a MAC has 6 bytes",
        })?;
        Ok(MacAddr(arr))
    }
}

fn parse_hex_bytes(s: &str) -> Result<Vec<u8>, MacParseError> {
    let err = |why| MacParseError {
        input: s.to_owned(),
        why,
    };
    let trimmed = s.trim().trim_end_matches([':', '-']);
    if trimmed.is_empty() {
        return Err(err("empty"));
    }
    trimmed
        .split([':', '-'])
        .map(|part| {
            if part.len() != 2 {
                return Err(err("each byte is two hex digits"));
            }
            u8::from_str_radix(part, 16).map_err(|_| err("not a hex digit"))
        })
        .collect()
}

/// One netboot rule: a whole MAC or the first bytes of one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NetbootRule {
    Mac(MacAddr),
    /// 1 to 5 leading bytes; `02:0b:` covers the MACs of the `pxegen.py` load generator.
    Prefix(Vec<u8>),
}

impl FromStr for NetbootRule {
    type Err = MacParseError;
    /// `aa:bb:cc:dd:ee:ff` is a MAC; fewer bytes (`02:0b`, `02:0b:`) are a prefix.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = parse_hex_bytes(s)?;
        match bytes.len() {
            6 => Ok(NetbootRule::Mac(MacAddr(
                bytes.as_slice().try_into().map_err(|_| MacParseError {
                    input: s.to_owned(),
                    why: "a MAC has 6 bytes",
                })?,
            ))),
            1..=5 => Ok(NetbootRule::Prefix(bytes)),
            _ => Err(MacParseError {
                input: s.to_owned(),
                why: "more than 6 bytes",
            }),
        }
    }
}

impl fmt::Display for NetbootRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetbootRule::Mac(mac) => mac.fmt(f),
            NetbootRule::Prefix(bytes) => {
                for b in bytes {
                    write!(f, "{b:02x}:")?;
                }
                Ok(())
            }
        }
    }
}

/// The MACs the control plane marked for netboot. Lookups of exact MACs are O(1); prefixes are few and scanned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetbootTable {
    macs: HashSet<MacAddr>,
    prefixes: Vec<Vec<u8>>,
}

impl NetbootTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, rule: NetbootRule) {
        match rule {
            NetbootRule::Mac(mac) => {
                self.macs.insert(mac);
            }
            NetbootRule::Prefix(prefix) => {
                if !self.prefixes.contains(&prefix) {
                    self.prefixes.push(prefix);
                }
            }
        }
    }

    pub fn contains(&self, mac: &MacAddr) -> bool {
        self.macs.contains(mac) || self.prefixes.iter().any(|p| mac.0.starts_with(p))
    }

    pub fn is_empty(&self) -> bool {
        self.macs.is_empty() && self.prefixes.is_empty()
    }
}

impl FromIterator<NetbootRule> for NetbootTable {
    fn from_iter<I: IntoIterator<Item = NetbootRule>>(iter: I) -> Self {
        let mut table = NetbootTable::new();
        for rule in iter {
            table.insert(rule);
        }
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_macs() -> Result<(), MacParseError> {
        let mac: MacAddr = "52:54:00:AB:cd:01".parse()?;
        assert_eq!(mac.to_string(), "52:54:00:ab:cd:01");
        assert_eq!("52-54-00-ab-cd-01".parse::<MacAddr>()?, mac);
        assert!("52:54:00:ab:cd".parse::<MacAddr>().is_err());
        assert!("52:54:00:ab:cd:zz".parse::<MacAddr>().is_err());
        assert!("525:4:00:ab:cd:01".parse::<MacAddr>().is_err());
        assert!("".parse::<MacAddr>().is_err());
        Ok(())
    }

    #[test]
    fn prefixes_cover_load_generator_macs() -> Result<(), MacParseError> {
        let table: NetbootTable = ["02:0b:".parse()?, "52:54:00:00:00:01".parse()?]
            .into_iter()
            .collect();
        assert!(table.contains(&"02:0b:12:34:56:78".parse()?));
        assert!(table.contains(&"52:54:00:00:00:01".parse()?));
        assert!(!table.contains(&"52:54:00:00:00:02".parse()?));
        assert!(!table.contains(&"02:0c:12:34:56:78".parse()?));
        assert_eq!("02:0b".parse::<NetbootRule>()?.to_string(), "02:0b:");
        assert!("01:02:03:04:05:06:07".parse::<NetbootRule>().is_err());
        Ok(())
    }
}
