//! The tunnel bench's shaped link (`bc_bench::peers::Wan`: netem, or the user-space delay line where the kernel has
//! no netem) really adds its round trip and holds its rate: a TCP connect into the namespace takes at least the RTT,
//! and a download takes at least its bits at the rate. Needs root (a network namespace, TUN devices).

use bc_bench::peers::{Kill, Wan, wait_listening};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn the_shaped_link_adds_its_round_trip_and_holds_its_rate() {
    if !is_root() {
        println!(
            "SKIP: the_shaped_link_adds_its_round_trip_and_holds_its_rate: needs root (network namespaces)"
        );
        return;
    }
    let (rtt, rate) = (Duration::from_millis(40), 100_000_000u64);
    let wan = match Wan::create(rtt, rate) {
        Ok(wan) => wan,
        // Neither netem nor a TUN driver: nothing here can shape a link.
        Err(e) if !std::path::Path::new("/dev/net/tun").exists() => {
            println!(
                "SKIP: the_shaped_link_adds_its_round_trip_and_holds_its_rate: no /dev/net/tun and no netem: {e:#}"
            );
            return;
        }
        Err(e) => panic!("the shaped link: {e:#}"),
    };
    println!("link: {}", wan.shaper);
    let port = 15101;
    let _service = Kill(
        Command::new("ip")
            .args(["netns", "exec", &wan.name])
            .arg(env!("CARGO_BIN_EXE_tunnel"))
            .args(["--serve", &format!("0.0.0.0:{port}")])
            .spawn()
            .expect("the service in the namespace"),
    );
    let addr = SocketAddr::new(wan.there.into(), port);
    wait_listening(addr, Duration::from_secs(10)).expect("the service listens");

    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    let connect = t0.elapsed();
    assert!(
        connect >= rtt,
        "a connect took {connect:?}, less than the {rtt:?} round trip"
    );
    assert!(
        connect < rtt * 3,
        "a connect took {connect:?}, far more than the {rtt:?} round trip"
    );

    let n: u64 = 8 << 20;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("a read timeout");
    let t0 = Instant::now();
    s.write_all(&[&b"S"[..], &n.to_be_bytes()].concat())
        .expect("the request");
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        let k = s.read(&mut buf).expect("read");
        if k == 0 {
            break;
        }
        got += k as u64;
    }
    let took = t0.elapsed();
    assert_eq!(got, n);
    // The payload's bits at the rate, less 10% for the bytes already in flight when the clock is read.
    let floor = Duration::from_secs_f64(n as f64 * 8.0 / rate as f64 * 0.9);
    let mbit = n as f64 * 8.0 / took.as_secs_f64() / 1e6;
    println!("connect {connect:?}; {n} bytes in {took:?} ({mbit:.1} Mbit/s)");
    assert!(
        took >= floor,
        "{n} bytes took {took:?}: faster than the {rate} bit/s rate allows ({floor:?})"
    );
    // Slow start at a 40 ms RTT costs a few round trips; more than twice the floor means the line is the bottleneck
    // for another reason (its own CPU).
    assert!(
        took < floor * 3,
        "{n} bytes took {took:?}: the link is much slower than its rate"
    );
    if let Some(line) = &wan.line {
        let dropped = line.counters[0]
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed);
        println!("the delay line dropped {dropped} packets");
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
