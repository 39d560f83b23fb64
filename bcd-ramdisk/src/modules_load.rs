//! Which modules of the initramfs to load on this machine. The image build writes `/lib/modules/load-order`, one
//! module per line, dependencies first: `<path>\t<deps, comma-separated>\t<device aliases, space-separated>` (a
//! line with only a path is loaded unconditionally). At boot, [`select`] picks the drivers whose device aliases
//! match a present device's `modalias` (PCI, virtio), every module that is nobody's dependency and has
//! no device alias (file systems, crypto), and the dependencies of those. Loading a bus driver (virtio_pci, ahci)
//! makes new devices appear, so the caller repeats until nothing new is picked.

use std::collections::{BTreeMap, BTreeSet};

use super::{ModInfo, normalize};

/// One line of the load list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadEntry {
    pub path: String,
    pub name: String,
    pub deps: Vec<String>,
    /// Device aliases only; empty means "not tied to a device".
    pub aliases: Vec<String>,
}

/// Aliases that make a module conditional: PCI and virtio devices, which exist as soon as their bus driver's probe
/// returns. SCSI disks are scanned asynchronously (they may appear after the last pass), so `sd_mod` and the like
/// stay unconditional.
pub fn is_device_alias(alias: &str) -> bool {
    ["pci:", "virtio:"].iter().any(|p| alias.starts_with(p))
}

/// Render one load-list line for a module file.
pub fn render_line(path: &str, info: &ModInfo) -> String {
    let mut deps: Vec<&str> = info.depends.iter().map(String::as_str).collect();
    deps.extend(info.soft_pre.iter().map(String::as_str));
    let aliases: Vec<&str> = info
        .aliases
        .iter()
        .map(String::as_str)
        .filter(|a| is_device_alias(a) && !a.contains(char::is_whitespace))
        .collect();
    format!("{path}\t{}\t{}", deps.join(","), aliases.join(" "))
}

/// Parse the load list; blank lines and `#` comments are skipped. The module name is the file name's.
pub fn parse(text: &str) -> Vec<LoadEntry> {
    text.lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(|line| {
            let mut fields = line.split('\t');
            let path = fields.next().unwrap_or_default().trim().to_string();
            let file = path.rsplit('/').next().unwrap_or_default();
            let name = super::module_name_of(file).unwrap_or_else(|| normalize(file));
            let deps = fields
                .next()
                .map(|d| {
                    d.split(',')
                        .map(normalize)
                        .filter(|s| !s.is_empty())
                        .collect()
                })
                .unwrap_or_default();
            let aliases = fields
                .next()
                .map(|a| a.split_whitespace().map(str::to_string).collect())
                .unwrap_or_default();
            LoadEntry {
                path,
                name,
                deps,
                aliases,
            }
        })
        .collect()
}

/// Indices of `entries` to load now, in list order: not yet `attempted`, and needed given the `present` device
/// modaliases (see the module docs).
pub fn select(
    entries: &[LoadEntry],
    attempted: &BTreeSet<String>,
    present: &[String],
) -> Vec<usize> {
    let depended: BTreeSet<&str> = entries
        .iter()
        .flat_map(|e| e.deps.iter().map(String::as_str))
        .collect();
    let by_name: BTreeMap<&str, &LoadEntry> =
        entries.iter().map(|e| (e.name.as_str(), e)).collect();
    let mut need: BTreeSet<&str> = BTreeSet::new();
    let mut stack: Vec<&str> = entries
        .iter()
        .filter(|e| {
            if e.aliases.is_empty() {
                !depended.contains(e.name.as_str())
            } else {
                e.aliases
                    .iter()
                    .any(|a| present.iter().any(|m| glob_match(a, m)))
            }
        })
        .map(|e| e.name.as_str())
        .collect();
    while let Some(n) = stack.pop() {
        if need.insert(n)
            && let Some(e) = by_name.get(n)
        {
            stack.extend(e.deps.iter().map(String::as_str));
        }
    }
    entries
        .iter()
        .enumerate()
        .filter(|(_, e)| need.contains(e.name.as_str()) && !attempted.contains(&e.name))
        .map(|(i, _)| i)
        .collect()
}

/// `fnmatch`-style matching as the kernel's module aliases use it: `*`, `?` and `[...]` classes (with ranges and
/// `!`/`^` negation). An unterminated `[` matches itself.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
            continue;
        }
        if pi < p.len()
            && let Some(next) = match_one(p, pi, t[ti])
        {
            pi = next;
            ti += 1;
            continue;
        }
        match star {
            Some((sp, st)) => {
                pi = sp + 1;
                ti = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    while pi < p.len() && p[pi] == b'*' {
        pi += 1;
    }
    pi == p.len()
}

/// If the pattern element at `pi` matches `c`, the index after it.
fn match_one(p: &[u8], pi: usize, c: u8) -> Option<usize> {
    match p[pi] {
        b'?' => Some(pi + 1),
        b'[' => {
            let mut i = pi + 1;
            let negate = matches!(p.get(i), Some(b'!' | b'^'));
            if negate {
                i += 1;
            }
            let start = i;
            let mut matched = false;
            while i < p.len() && (p[i] != b']' || i == start) {
                if i + 2 < p.len() && p[i + 1] == b'-' && p[i + 2] != b']' {
                    matched |= p[i] <= c && c <= p[i + 2];
                    i += 3;
                } else {
                    matched |= p[i] == c;
                    i += 1;
                }
            }
            if i >= p.len() {
                // Unterminated class: a literal '['.
                return (c == b'[').then_some(pi + 1);
            }
            (matched != negate).then_some(i + 1)
        }
        lit => (lit == c).then_some(pi + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_like_fnmatch() {
        assert!(glob_match(
            "pci:v00001AF4d*sv*sd*bc*sc*i*",
            "pci:v00001AF4d00001001sv00001AF4sd00000002bc01sc00i00"
        ));
        assert!(glob_match(
            "pci:v*d*sv*sd*bc01sc08i02*",
            "pci:v00001B36d00000010sv00001AF4sd00001100bc01sc08i02"
        ));
        assert!(!glob_match(
            "pci:v*d*sv*sd*bc01sc08i02*",
            "pci:v00001B36d00000010sv00001AF4sd00001100bc01sc06i01"
        ));
        assert!(glob_match(
            "virtio:d00000002v*",
            "virtio:d00000002v00001AF4"
        ));
        assert!(!glob_match(
            "virtio:d00000001v*",
            "virtio:d00000002v00001AF4"
        ));
        assert!(glob_match("a?c", "abc"));
        assert!(glob_match("a[b-d]c", "acc"));
        assert!(!glob_match("a[!b-d]c", "acc"));
        assert!(glob_match("a[", "a["));
        assert!(glob_match("*", ""));
        assert!(!glob_match("", "x"));
        assert!(glob_match("*a*a*a", "aaaa"));
    }

    fn list() -> Vec<LoadEntry> {
        parse(
            "/m/virtio_ring.ko\t\t\n/m/virtio.ko\tvirtio_ring\t\n\
             /m/virtio_pci.ko\tvirtio,virtio_ring\tpci:v00001AF4d*sv*sd*bc*sc*i*\n\
             /m/virtio_blk.ko\tvirtio,virtio_ring\tvirtio:d00000002v*\n\
             /m/mlxfw.ko\t\t\n/m/mlx5_core.ko\tmlxfw\tpci:v000015B3d00001017sv*sd*bc*sc*i*\n\
             /m/crc32c_generic.ko\n/m/jbd2.ko\t\t\n/m/ext4.ko\tjbd2\t\n",
        )
    }

    fn names(l: &[LoadEntry], idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| l[i].name.clone()).collect()
    }

    #[test]
    fn selects_drivers_for_present_devices_in_passes() {
        let l = list();
        let virtio_pci = "pci:v00001AF4d00001001sv00001AF4sd00000002bc01sc00i00".to_string();
        let mut attempted = BTreeSet::new();
        let first = select(&l, &attempted, std::slice::from_ref(&virtio_pci));
        assert_eq!(
            names(&l, &first),
            [
                "virtio_ring",
                "virtio",
                "virtio_pci",
                "crc32c_generic",
                "jbd2",
                "ext4"
            ]
        );
        attempted.extend(names(&l, &first));
        // virtio_pci made the virtio block device appear.
        let second = select(
            &l,
            &attempted,
            &[virtio_pci, "virtio:d00000002v00001AF4".into()],
        );
        assert_eq!(names(&l, &second), ["virtio_blk"]);
        attempted.extend(names(&l, &second));
        assert!(select(&l, &attempted, &["virtio:d00000002v00001AF4".into()]).is_empty());
    }

    #[test]
    fn renders_what_it_parses() {
        let info = ModInfo {
            name: "virtio_blk".into(),
            depends: vec!["virtio".into(), "virtio_ring".into()],
            soft_pre: vec![],
            aliases: vec!["virtio:d00000002v*".into(), "fs-x".into()],
        };
        let line = render_line("/lib/modules/k/virtio_blk.ko", &info);
        assert_eq!(
            line,
            "/lib/modules/k/virtio_blk.ko\tvirtio,virtio_ring\tvirtio:d00000002v*"
        );
        let e = &parse(&line)[0];
        assert_eq!(e.name, "virtio_blk");
        assert_eq!(e.deps, ["virtio", "virtio_ring"]);
        assert_eq!(e.aliases, ["virtio:d00000002v*"]);
    }
}
