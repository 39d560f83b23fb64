#![no_main]
//! Tunnel frame handling: the `bc-tunnel/1` link's framing (length prefix, then a `TunnelFrame`), as the API
//! process and the CLI read it, and the frames it yields fed to bcd's tunnel relay against a loopback socket (what
//! a gateway can make a node do). Neither may panic or hang on any input; the relay must end.
use bc_proto::tunnel as wire;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .enable_io()
            .build()
            .expect("runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    // The link's framing: every frame decodes or is an error; nothing past one frame is buffered.
    let mut frames = Vec::new();
    let mut at = 0;
    while let Ok(Some((f, used))) = wire::decode(&data[at..]) {
        assert!(used >= 4 && used <= data.len() - at);
        frames.push(Ok(f));
        at += used;
        if frames.len() > 64 {
            break;
        }
    }
    // The same bytes through the async reader agree with decode.
    runtime().block_on(async {
        let mut r = wire::FrameReader::new(data);
        for f in frames.iter().flatten() {
            let got = r.next().await;
            assert_eq!(got.ok().flatten().as_ref(), Some(f));
        }
    });
    // bcd's relay with those frames as the gateway's: against a local socket that sends a few bytes and closes.
    runtime().block_on(async {
        // The service connects and closes first, so each run's TIME_WAIT stays on the service's own ephemeral port,
        // which the next connect may take again on loopback (net.ipv4.tcp_tw_reuse). The other way round (the relay
        // on the connecting side) left it on the accepted side, where the kernel does not reuse it: after ~28,000
        // runs every port was held, a SYN met an old TIME_WAIT and was retried for seconds, and libFuzzer reported
        // a 13 s timeout on an input that replays in 0 ms. The setup has its own deadline: a run whose sockets
        // cannot be set up tests nothing here.
        let setup = async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
            let addr = listener.local_addr().ok()?;
            let (peer, accepted) =
                tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
            Some((peer.ok()?, accepted.ok()?.0))
        };
        let Ok(Some((mut peer, local))) = tokio::time::timeout(Duration::from_secs(5), setup).await
        else {
            return;
        };
        let _ = peer.write_all(b"service banner").await;
        drop(peer);
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let inbound = tokio_stream::iter(frames);
        let relay = bcd::tunnel::relay(local, tx, inbound);
        let drain = async { while rx.recv().await.is_some() {} };
        let (out, ()) = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::join!(relay, drain)
        })
        .await
        .expect("the relay ends");
        assert!(out.up <= 14);
    });
});
