//! The ramdisk's DHCP client keeps its lease against a real DHCP server: dnsmasq in one network namespace, the real
//! `bcd-ramdisk dhcp --keep` in another, joined by a veth pair. dnsmasq's shortest lease is 2 minutes, and it
//! sends T1 = 8 s (options 58 and 59 set), so the client, keeping the server's T1, renews after 8 s rather than the
//! default 60 s; the test waits for it and checks dnsmasq saw the REQUEST from the bound address and extended the
//! lease. Skips with a printed reason without root, `ip` or dnsmasq. Both namespaces and dnsmasq
//! are removed by name and PID even when the test fails.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces (`<base>-s` with dnsmasq on 10.98.0.1/24, `<base>-c` with the client's end), removed on drop.
struct Lab {
    server_ns: String,
    client_ns: String,
    dnsmasq: Option<Child>,
    dir: tempfile::TempDir,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let Some(mut d) = self.dnsmasq.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        let _ = ip(&["netns", "del", &self.client_ns]);
        let _ = ip(&["netns", "del", &self.server_ns]);
    }
}

fn lab() -> Result<Lab, String> {
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|e| format!("no /proc: {e}"))?;
    if uid != 0 {
        return Err(format!("not root (uid {uid})"));
    }
    for tool in ["ip", "dnsmasq"] {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()));
        if !found {
            return Err(format!("{tool} not installed"));
        }
    }
    let base = format!("bcdr{}", std::process::id());
    let mut lab = Lab {
        server_ns: format!("{base}-s"),
        client_ns: format!("{base}-c"),
        dnsmasq: None,
        dir: tempfile::tempdir().map_err(|e| e.to_string())?,
    };
    ip(&["netns", "add", &lab.server_ns])?;
    ip(&["netns", "add", &lab.client_ns])?;
    ip(&[
        "link",
        "add",
        "veth-s",
        "netns",
        &lab.server_ns,
        "type",
        "veth",
        "peer",
        "name",
        "veth-c",
        "netns",
        &lab.client_ns,
    ])?;
    ip(&[
        "-n",
        &lab.server_ns,
        "addr",
        "add",
        "10.98.0.1/24",
        "dev",
        "veth-s",
    ])?;
    ip(&["-n", &lab.server_ns, "link", "set", "veth-s", "up"])?;
    ip(&["-n", &lab.server_ns, "link", "set", "lo", "up"])?;
    ip(&["-n", &lab.client_ns, "link", "set", "lo", "up"])?;
    let log = lab.dir.path().join("dnsmasq.log");
    let dnsmasq = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.server_ns,
            "dnsmasq",
            "--keep-in-foreground",
        ])
        .args([
            "--conf-file=/dev/null",
            "--port=0",
            "--interface=veth-s",
            "--bind-interfaces",
            "--log-dhcp",
            "--user=root",
            // dnsmasq's shortest lease (2 minutes), with the server's own T1 and T2 (options 58 and 59), which the
            // client keeps (RFC 2131 §4.4.5): the renewal comes at 8 s instead of the default 60 s.
            "--dhcp-range=10.98.0.50,10.98.0.99,255.255.255.0,2m",
            "--dhcp-option=option:T1,8",
            "--dhcp-option=option:T2,100",
        ])
        .arg(format!(
            "--dhcp-leasefile={}",
            lab.dir.path().join("leases").display()
        ))
        .arg(format!("--log-facility={}", log.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("dnsmasq: {e}"))?;
    lab.dnsmasq = Some(dnsmasq);
    Ok(lab)
}

#[test]
fn the_client_renews_its_lease_at_t1_with_dnsmasq() {
    let lab = match lab() {
        Ok(l) => l,
        Err(why) => bc_testkit::skip!("DHCP renewal lab: {why}"),
    };
    let started = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &lab.client_ns])
        .arg(env!("CARGO_BIN_EXE_bcd-ramdisk"))
        .args([
            "dhcp",
            "--nic",
            "veth-c",
            "--timeout",
            "30",
            "--keep",
            "--renewals",
            "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bcd-ramdisk dhcp");
    let stdout = child.stdout.take().expect("stdout");
    // The whole run is bounded: a client that never renews is killed after 60 s.
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        let _ = Command::new("kill").arg(pid.to_string()).status();
    });
    let mut events = Vec::new();
    let mut text = String::new();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        text.push_str(&line);
        text.push('\n');
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
            events.push((started.elapsed(), v));
        }
    }
    let status = child.wait().expect("wait");
    drop(watchdog);
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    let dnsmasq_log =
        std::fs::read_to_string(lab.dir.path().join("dnsmasq.log")).unwrap_or_default();
    let context = format!("stdout:\n{text}\nstderr:\n{stderr}\ndnsmasq:\n{dnsmasq_log}");
    assert!(status.success(), "bcd-ramdisk dhcp failed: {context}");
    // The pretty-printed first object spans lines; find the bound address in the text instead.
    assert!(text.contains("\"event\": \"bound\""), "{context}");
    assert!(text.contains("\"lease_secs\": 120"), "{context}");
    let (at, renewed) = events
        .iter()
        .find(|(_, v)| v["event"] == "renewed")
        .unwrap_or_else(|| panic!("no renewal: {context}"));
    println!("renewed after {:.1} s: {renewed}", at.as_secs_f64());
    assert!(
        *at >= Duration::from_secs(7) && *at < Duration::from_secs(40),
        "renewal at the server's T1 (8 s; the default would be 60 s), not {at:?}: {context}"
    );
    assert_eq!(renewed["lease_secs"], 120, "{context}");
    let address = renewed["address"].as_str().unwrap_or_default().to_string();
    assert!(address.starts_with("10.98.0."), "{context}");
    // dnsmasq saw the renewal as a REQUEST from the bound address (ciaddr) and acknowledged it: two ACKs in all.
    let acks = dnsmasq_log
        .lines()
        .filter(|l| l.contains("DHCPACK(veth-s)") && l.contains(&address))
        .count();
    assert_eq!(acks, 2, "the first ACK and the renewal's: {context}");
    assert!(
        dnsmasq_log
            .lines()
            .any(|l| l.contains("DHCPREQUEST(veth-s)") && l.contains(&address)),
        "{context}"
    );
}
