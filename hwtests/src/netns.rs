//! Network namespaces the tests create (named after the test's PID) and deleted by name, and running code inside
//! one from the test process itself.

use std::fs::File;
use std::os::fd::AsFd as _;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow};
use rustix::thread::{LinkNameSpaceType, move_into_link_name_space};

use crate::proc::run;

/// `ip ARGS`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args)).map(drop)
}

/// A network namespace, deleted by name when dropped.
pub struct Netns(pub String);

impl Netns {
    pub fn create(name: String) -> Result<Netns> {
        ip(&["netns", "add", &name])?;
        let ns = Netns(name);
        ip(&["-n", &ns.0, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    /// Runs `f` on a thread that has joined this namespace: every socket `f` opens (a Redfish client, a server
    /// bound to 127.0.0.1) lives in it. Only that thread moves; the rest of the process stays where it is.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        in_netns(&self.0, f)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        delete(&self.0);
    }
}

/// `ip netns del NAME`, quietly (it may be gone already).
pub fn delete(name: &str) {
    let _ = Command::new("ip")
        .args(["netns", "del", name])
        .stderr(Stdio::null())
        .status();
}

/// Runs `f` on a scoped thread that joined the network namespace `/run/netns/<name>` (setns(2), CLONE_NEWNET).
pub fn in_netns<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    let path = format!("/run/netns/{name}");
    let ns = File::open(&path).with_context(|| format!("opening {path}"))?;
    std::thread::scope(|s| {
        s.spawn(move || {
            move_into_link_name_space(ns.as_fd(), Some(LinkNameSpaceType::Network))
                .with_context(|| format!("setns into {path}"))?;
            Ok(f())
        })
        .join()
        .map_err(|_| anyhow!("the thread in netns {name} panicked"))?
    })
}
