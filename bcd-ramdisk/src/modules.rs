//! Kernel module load order. Debian's kernel package ships no `modules.dep`, so the order comes from each module's
//! own `depends=` in its `.modinfo` ELF section: [`ModInfo::from_ko`] reads it (also from `.ko.xz`, `.ko.zst` and
//! `.ko.gz`), [`load_order`] sorts the closure of the wanted modules topologically, dependencies first.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::stream::{Decoder, detect};

/// Refuse to decompress a module beyond this (a kernel module is a few MiB at most).
const MAX_KO_BYTES: u64 = 64 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModuleError {
    #[error("not an ELF64 little-endian object: {0}")]
    NotElf(&'static str),
    #[error("ELF section table is out of bounds")]
    BadSections,
    #[error("no .modinfo section")]
    NoModinfo,
    #[error("decompressing the module failed: {0}")]
    Decompress(String),
    #[error("module is larger than {MAX_KO_BYTES} bytes once decompressed")]
    TooLarge,
    #[error("module {module} is neither available nor built in{}", needed_by.as_ref().map(|n| format!(" (needed by {n})")).unwrap_or_default())]
    Missing {
        module: String,
        needed_by: Option<String>,
    },
    #[error("dependency cycle: {}", path.join(" -> "))]
    Cycle { path: Vec<String> },
}

/// What the loader needs from a module's `.modinfo`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModInfo {
    pub name: String,
    /// Hard dependencies (`depends=`), which must be loaded first.
    pub depends: Vec<String>,
    /// `softdep=pre:` modules, loaded first when available.
    pub soft_pre: Vec<String>,
    /// `alias=` patterns (device modaliases such as `pci:v00008086d*…`, and others such as `fs-ext4`).
    pub aliases: Vec<String>,
}

/// Module names compare with `-` and `_` equal, as the kernel does.
pub fn normalize(name: &str) -> String {
    name.trim().replace('-', "_")
}

impl ModInfo {
    /// Parse a module file, decompressing xz, zstd or gzip by magic. `fallback_name` is used when the module has no
    /// `name=` field (kernels before 5.x).
    pub fn from_ko(file: &[u8], fallback_name: &str) -> Result<Self, ModuleError> {
        let compression = detect(file);
        if compression == crate::stream::Compression::Raw {
            return Self::from_elf(file, fallback_name);
        }
        let decoder =
            Decoder::new(compression, file).map_err(|e| ModuleError::Decompress(e.to_string()))?;
        let mut elf = Vec::new();
        decoder
            .take(MAX_KO_BYTES + 1)
            .read_to_end(&mut elf)
            .map_err(|e| ModuleError::Decompress(e.to_string()))?;
        if elf.len() as u64 > MAX_KO_BYTES {
            return Err(ModuleError::TooLarge);
        }
        Self::from_elf(&elf, fallback_name)
    }

    /// Parse an uncompressed ELF64 little-endian module.
    pub fn from_elf(elf: &[u8], fallback_name: &str) -> Result<Self, ModuleError> {
        Ok(Self::from_modinfo(modinfo_section(elf)?, fallback_name))
    }

    /// Parse the NUL-separated `key=value` strings of a `.modinfo` section.
    pub fn from_modinfo(section: &[u8], fallback_name: &str) -> Self {
        let mut info = ModInfo {
            name: normalize(fallback_name),
            ..Default::default()
        };
        for entry in section.split(|&b| b == 0) {
            let Ok(entry) = std::str::from_utf8(entry) else {
                continue;
            };
            let Some((key, value)) = entry.split_once('=') else {
                continue;
            };
            match key {
                "name" if !value.trim().is_empty() => info.name = normalize(value),
                "depends" => info.depends.extend(list(value, ',')),
                "alias" if !value.trim().is_empty() => info.aliases.push(value.trim().to_string()),
                "softdep" => {
                    // "pre: a b post: c"
                    let mut pre = false;
                    for word in value.split_whitespace() {
                        match word {
                            "pre:" => pre = true,
                            "post:" => pre = false,
                            m if pre => info.soft_pre.push(normalize(m)),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        info
    }
}

fn list(value: &str, sep: char) -> impl Iterator<Item = String> + '_ {
    value.split(sep).map(normalize).filter(|s| !s.is_empty())
}

fn modinfo_section(elf: &[u8]) -> Result<&[u8], ModuleError> {
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" {
        return Err(ModuleError::NotElf("bad magic or short header"));
    }
    if elf[4] != 2 {
        return Err(ModuleError::NotElf("not 64-bit"));
    }
    if elf[5] != 1 {
        return Err(ModuleError::NotElf("not little-endian"));
    }
    // Offsets come from the file: every addition is checked (a wrapped offset must not read elsewhere).
    let bytes_at = |o: usize, n: usize| elf.get(o..o.checked_add(n)?);
    let u16_at = |o: usize| bytes_at(o, 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        bytes_at(o, 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |o: usize| {
        bytes_at(o, 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let shoff = u64_at(0x28).ok_or(ModuleError::BadSections)?;
    let shentsize = u16_at(0x3a).ok_or(ModuleError::BadSections)? as usize;
    let shnum = u16_at(0x3c).ok_or(ModuleError::BadSections)? as usize;
    let shstrndx = u16_at(0x3e).ok_or(ModuleError::BadSections)? as usize;
    if shentsize < 64 || shstrndx >= shnum {
        return Err(ModuleError::BadSections);
    }
    let section = |i: usize| -> Result<(u32, &[u8]), ModuleError> {
        let base = usize::try_from(shoff)
            .ok()
            .and_then(|o| o.checked_add(i.checked_mul(shentsize)?))
            .ok_or(ModuleError::BadSections)?;
        let name = u32_at(base).ok_or(ModuleError::BadSections)?;
        let field = |off: usize| base.checked_add(off).and_then(u64_at);
        let offset = field(0x18).ok_or(ModuleError::BadSections)?;
        let size = field(0x20).ok_or(ModuleError::BadSections)?;
        let start = usize::try_from(offset).map_err(|_| ModuleError::BadSections)?;
        let end = usize::try_from(size)
            .ok()
            .and_then(|s| start.checked_add(s))
            .ok_or(ModuleError::BadSections)?;
        Ok((name, elf.get(start..end).ok_or(ModuleError::BadSections)?))
    };
    let (_, names) = section(shstrndx)?;
    for i in 0..shnum {
        let (name_off, data) = section(i)?;
        let name = names
            .get(name_off as usize..)
            .and_then(|n| n.split(|&b| b == 0).next())
            .unwrap_or_default();
        if name == b".modinfo" {
            return Ok(data);
        }
    }
    Err(ModuleError::NoModinfo)
}

/// The modules to load, dependencies first, for `wanted` (in the order given, each after everything it needs).
/// `available` maps normalized names to their info; `builtin` names modules compiled into the kernel, which satisfy
/// dependencies without being loaded. A missing hard dependency or a cycle is an error; a missing soft dependency is
/// ignored.
pub fn load_order(
    wanted: &[&str],
    available: &BTreeMap<String, ModInfo>,
    builtin: &BTreeSet<String>,
) -> Result<Vec<String>, ModuleError> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    struct Walk<'a> {
        available: &'a BTreeMap<String, ModInfo>,
        builtin: &'a BTreeSet<String>,
        marks: BTreeMap<String, Mark>,
        stack: Vec<String>,
        order: Vec<String>,
    }
    impl Walk<'_> {
        fn visit(
            &mut self,
            name: &str,
            needed_by: Option<&str>,
            soft: bool,
        ) -> Result<(), ModuleError> {
            match self.marks.get(name) {
                Some(Mark::Done) => return Ok(()),
                Some(Mark::Visiting) => {
                    let from = self.stack.iter().position(|n| n == name).unwrap_or(0);
                    let mut path = self.stack[from..].to_vec();
                    path.push(name.to_string());
                    return Err(ModuleError::Cycle { path });
                }
                None => {}
            }
            let Some(info) = self.available.get(name) else {
                if self.builtin.contains(name) || soft {
                    return Ok(());
                }
                return Err(ModuleError::Missing {
                    module: name.to_string(),
                    needed_by: needed_by.map(str::to_string),
                });
            };
            self.marks.insert(name.to_string(), Mark::Visiting);
            self.stack.push(name.to_string());
            for dep in &info.soft_pre {
                self.visit(dep, Some(name), true)?;
            }
            for dep in &info.depends {
                self.visit(dep, Some(name), false)?;
            }
            self.stack.pop();
            self.marks.insert(name.to_string(), Mark::Done);
            self.order.push(name.to_string());
            Ok(())
        }
    }
    let mut walk = Walk {
        available,
        builtin,
        marks: BTreeMap::new(),
        stack: Vec::new(),
        order: Vec::new(),
    };
    for name in wanted {
        walk.visit(&normalize(name), None, false)?;
    }
    Ok(walk.order)
}

/// Build the `available` map of [`load_order`] from `name -> depends` pairs (e.g. parsed from `modinfo` output).
pub fn from_depends_map<'a>(
    deps: impl IntoIterator<Item = (&'a str, &'a [&'a str])>,
) -> BTreeMap<String, ModInfo> {
    deps.into_iter()
        .map(|(name, depends)| {
            let name = normalize(name);
            let info = ModInfo {
                name: name.clone(),
                depends: depends.iter().map(|d| normalize(d)).collect(),
                ..Default::default()
            };
            (name, info)
        })
        .collect()
}

/// Module name of a file name (`virtio_net.ko.xz` → `virtio_net`), or `None` if it is not a module.
pub fn module_name_of(file_name: &str) -> Option<String> {
    let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .find_map(|ext| file_name.strip_suffix(ext))?;
    Some(normalize(stem))
}

/// Every module file under `dir` (a `lib/modules/<version>` tree), by normalized name.
pub fn index_tree(dir: &Path) -> std::io::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let ty = entry.file_type()?;
            if ty.is_dir() {
                stack.push(entry.path());
            } else if let Some(name) = module_name_of(&entry.file_name().to_string_lossy()) {
                out.entry(name).or_insert_with(|| entry.path());
            }
        }
    }
    Ok(out)
}

/// Names listed in a `modules.builtin` file (`kernel/drivers/x/y.ko` per line).
pub fn parse_builtin(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.rsplit('/').next())
        .filter_map(module_name_of)
        .collect()
}

/// The resolved load order of a module tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeOrder {
    /// Module files to load, dependencies first.
    pub files: Vec<PathBuf>,
    /// Their `.modinfo`, in the same order.
    pub infos: Vec<ModInfo>,
    /// Wanted names that are neither in the tree nor built in (not an error: an initramfs lists drivers for
    /// hardware a kernel build may leave out).
    pub absent: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("reading the module tree {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("module {path}")]
    Module {
        path: PathBuf,
        #[source]
        source: ModuleError,
    },
    #[error(transparent)]
    Order(ModuleError),
}

/// Resolve the load order of `wanted` in the module tree `dir`: reads `.modinfo` of the wanted modules and of
/// their dependencies only (not the whole tree), treats `modules.builtin` entries as present.
pub fn order_tree(dir: &Path, wanted: &[&str]) -> Result<TreeOrder, TreeError> {
    let index = index_tree(dir).map_err(|source| TreeError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let builtin = std::fs::read_to_string(dir.join("modules.builtin"))
        .map(|t| parse_builtin(&t))
        .unwrap_or_default();
    let mut available = BTreeMap::new();
    let mut absent = Vec::new();
    let mut present_wanted = Vec::new();
    let mut queue: Vec<String> = Vec::new();
    for w in wanted {
        let n = normalize(w);
        if index.contains_key(&n) {
            present_wanted.push(n.clone());
            queue.push(n);
        } else if !builtin.contains(&n) {
            absent.push(n);
        }
    }
    while let Some(name) = queue.pop() {
        if available.contains_key(&name) {
            continue;
        }
        let Some(path) = index.get(&name) else {
            continue; // missing dependency: load_order names it
        };
        let bytes = std::fs::read(path).map_err(|source| TreeError::Read {
            path: path.clone(),
            source,
        })?;
        let info = ModInfo::from_ko(&bytes, &name).map_err(|source| TreeError::Module {
            path: path.clone(),
            source,
        })?;
        queue.extend(info.depends.iter().cloned());
        queue.extend(info.soft_pre.iter().cloned());
        available.insert(name, info);
    }
    let wanted_refs: Vec<&str> = present_wanted.iter().map(String::as_str).collect();
    let order = load_order(&wanted_refs, &available, &builtin).map_err(TreeError::Order)?;
    let mut files = Vec::new();
    let mut infos = Vec::new();
    for n in &order {
        if let (Some(path), Some(info)) = (index.get(n), available.get(n)) {
            files.push(path.clone());
            infos.push(info.clone());
        }
    }
    Ok(TreeOrder {
        files,
        infos,
        absent,
    })
}

#[path = "modules_load.rs"]
pub mod load;

#[cfg(test)]
#[path = "modules_tests.rs"]
mod tests;
