//! What a lab created, written down as it is created, so that it can be torn down by name and PID even when the
//! process that made it is gone (killed, crashed): `metal-lab reap` and every new lab look for such leftovers.
//!
//! `<lab dir>/manifest` holds one line per thing: `owner <pid> <start>`, `netns <name>`, `proc <name> <pid>
//! <start>`. A PID is signalled only while `/proc/<pid>/stat` still shows the recorded start time, so a reused PID
//! is never touched. QEMU processes are libvirt's, not ours: their PIDs come from libvirt's own pid files under
//! the lab's `libvirt/run/qemu/`, and are signalled only while their command line names that domain.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::netns;
use crate::proc::{signal, start_time};

/// The folder under which every lab of this machine lives: `<tmp>/bcd-metal-lab/<pid>.<n>`.
pub fn labs_root() -> PathBuf {
    std::env::temp_dir().join("bcd-metal-lab")
}

/// Creates a lab's folder under [`labs_root`]. A lab torn down meanwhile may remove the root, once empty, between
/// `create_dir_all`'s creating it and creating the lab's folder in it: that NotFound is tried again.
pub fn create_lab_dir(dir: &Path) -> Result<()> {
    let mut tries = 0;
    loop {
        match fs::create_dir_all(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 3 => tries += 1,
            r => return r.with_context(|| format!("creating {}", dir.display())),
        }
    }
}

/// Appends lines to a lab's manifest.
pub struct Manifest {
    path: PathBuf,
}

impl Manifest {
    pub fn create(dir: &Path) -> Result<Manifest> {
        let m = Manifest {
            path: dir.join("manifest"),
        };
        let pid = std::process::id();
        m.line(&format!("owner {pid} {}", start_time(pid).unwrap_or(0)))?;
        Ok(m)
    }

    fn line(&self, line: &str) -> Result<()> {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("writing {}", self.path.display()))?;
        writeln!(f, "{line}")?;
        f.sync_data()?;
        Ok(())
    }

    pub fn netns(&self, name: &str) -> Result<()> {
        self.line(&format!("netns {name}"))
    }

    pub fn process(&self, name: &str, pid: u32) -> Result<()> {
        let name = name.replace(char::is_whitespace, "-");
        self.line(&format!(
            "proc {name} {pid} {}",
            start_time(pid).unwrap_or(0)
        ))
    }
}

enum Entry {
    Owner { pid: u32, start: u64 },
    Netns(String),
    Proc { name: String, pid: u32, start: u64 },
}

fn entries(dir: &Path) -> Vec<Entry> {
    let text = fs::read_to_string(dir.join("manifest")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                ["owner", pid, start] => Some(Entry::Owner {
                    pid: pid.parse().ok()?,
                    start: start.parse().ok()?,
                }),
                ["netns", name] => Some(Entry::Netns((*name).to_owned())),
                ["proc", name, pid, start] => Some(Entry::Proc {
                    name: (*name).to_owned(),
                    pid: pid.parse().ok()?,
                    start: start.parse().ok()?,
                }),
                _ => None,
            }
        })
        .collect()
}

fn alive(pid: u32, start: u64) -> bool {
    start_time(pid).is_some_and(|s| s == start)
}

/// Kills the QEMU processes libvirt started for this lab (by the PIDs in its pid files, checked against the
/// domain name on their command line). Returns how many were killed.
pub fn kill_guests(dir: &Path) -> usize {
    let mut killed = 0;
    let Ok(files) = fs::read_dir(dir.join("libvirt/run/qemu")) else {
        return 0;
    };
    for f in files.flatten() {
        let path = f.path();
        if path.extension().is_none_or(|e| e != "pid") {
            continue;
        }
        let Some(domain) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let Some(pid) = fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.trim().parse::<u32>().ok())
        else {
            continue;
        };
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("qemu-system") && cmdline.contains(&format!("guest={domain},")) {
            signal(pid, "KILL");
            killed += 1;
        }
    }
    killed
}

/// Tears down what the manifest in `dir` lists, newest first: processes (SIGTERM, SIGKILL after 3 s), the guests,
/// the namespaces; then removes `dir` unless `keep`. Safe to run twice.
pub fn tear_down(dir: &Path, keep: bool) {
    let entries = entries(dir);
    kill_guests(dir);
    for e in entries.iter().rev() {
        if let Entry::Proc { pid, start, .. } = e
            && alive(*pid, *start)
        {
            signal(*pid, "TERM");
        }
    }
    let end = Instant::now() + Duration::from_secs(3);
    for e in entries.iter().rev() {
        if let Entry::Proc { pid, start, .. } = e {
            while alive(*pid, *start) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(50));
            }
            if alive(*pid, *start) {
                signal(*pid, "KILL");
            }
        }
    }
    for e in entries.iter().rev() {
        if let Entry::Netns(name) = e {
            netns::delete(name);
        }
    }
    if !keep {
        let _ = fs::remove_dir_all(dir);
        // The root too, once no lab is left in it (fails while one is: another test's, or a kept one).
        let _ = fs::remove_dir(labs_root());
    }
}

/// What [`reap`] found.
#[derive(Debug, Default)]
pub struct Reaped {
    pub labs: Vec<PathBuf>,
    pub processes: Vec<String>,
    pub namespaces: Vec<String>,
}

/// Tears down every lab under [`labs_root`] whose owner process is gone.
pub fn reap() -> Reaped {
    let mut reaped = Reaped::default();
    let Ok(dirs) = fs::read_dir(labs_root()) else {
        return reaped;
    };
    for d in dirs.flatten() {
        let dir = d.path();
        let entries = entries(&dir);
        let owner_alive = entries.iter().any(|e| match e {
            Entry::Owner { pid, start } => alive(*pid, *start),
            _ => false,
        });
        if owner_alive {
            continue;
        }
        for e in &entries {
            match e {
                Entry::Proc { name, pid, start } if alive(*pid, *start) => {
                    reaped.processes.push(format!("{name} (pid {pid})"));
                }
                Entry::Netns(n) if Path::new("/run/netns").join(n).exists() => {
                    reaped.namespaces.push(n.clone());
                }
                _ => {}
            }
        }
        tear_down(&dir, false);
        reaped.labs.push(dir);
    }
    reaped
}
