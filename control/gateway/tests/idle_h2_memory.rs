//! An idle HTTP/2 connection holds none of h2's frame buffers: the write buffer, the read buffer and the HPACK
//! Huffman scratch are released while the connection waits (`third_party/h2/PATCHED.md`, issue 18). Unpatched,
//! they are 28 KiB on each side of every connection for its whole life, which is most of a gateway's memory per
//! idle session.
//!
//! The test counts the heap's live bytes with a counting allocator, opens connections over real loopback TCP,
//! completes one request on each (so every buffer has been used), lets them go idle and measures what stays.
#![allow(unsafe_code)] // the counting allocator below; nothing else

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

/// Live heap bytes of the whole test process.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const CONNECTIONS: usize = 100;

/// Both ends of one connection together (client and server, each with h2's connection state, streams, HPACK
/// tables and the tasks that drive them) after it went idle. Unpatched, the three buffers alone are 2 × 28 KiB.
const MAX_IDLE_BYTES_PER_CONNECTION: isize = 24 * 1024;

type Error = Box<dyn std::error::Error + Send + Sync>;

const REPLY: &[u8] = b"a reply of a few bytes";

async fn serve(socket: tokio::net::TcpStream) -> Result<(), Error> {
    let mut conn = h2::server::handshake(socket).await?;
    while let Some(request) = conn.accept().await {
        let (_request, mut respond) = request?;
        let response = http::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-accept-encoding", "identity")
            .body(())?;
        let mut send = respond.send_response(response, false)?;
        send.send_data(Bytes::from_static(REPLY), true)?;
    }
    Ok(())
}

/// Opens a connection, completes one request and returns the handle that keeps the connection open.
async fn one_request(addr: std::net::SocketAddr) -> Result<h2::client::SendRequest<Bytes>, Error> {
    let socket = tokio::net::TcpStream::connect(addr).await?;
    let (client, conn) = h2::client::handshake(socket).await?;
    tokio::spawn(conn);
    let mut client = client.ready().await?;
    let request = http::Request::builder()
        .method("POST")
        .uri("https://gateway.bc.test/bc.v1.Session/Open")
        .header("content-type", "application/grpc")
        .header(
            "user-agent",
            "bcd/0.1 tonic/0.14 a header long enough to be Huffman-coded",
        )
        .body(())?;
    let (response, _) = client.send_request(request, true)?;
    let mut body = response.await?.into_body();
    let mut got = 0;
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        got += chunk.len();
        body.flow_control().release_capacity(chunk.len())?;
    }
    assert_eq!(got, REPLY.len(), "the reply's body");
    Ok(client)
}

#[tokio::test]
async fn an_idle_connection_holds_no_frame_buffers() -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve(socket));
        }
    });
    // One connection first, so that what every connection shares (the runtime's and tracing's lazily built parts)
    // is not counted against the others.
    let mut open = vec![one_request(addr).await?];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 1..CONNECTIONS {
        open.push(one_request(addr).await?);
    }
    // Every connection's tasks run until they wait on their sockets.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let per_connection = (LIVE.load(Ordering::Relaxed) - before) / (CONNECTIONS as isize - 1);
    println!("idle HTTP/2 connection, both ends: {per_connection} bytes");
    assert!(
        per_connection <= MAX_IDLE_BYTES_PER_CONNECTION,
        "an idle connection holds {per_connection} bytes (both ends), over {MAX_IDLE_BYTES_PER_CONNECTION}: are h2's \
         idle buffers released (third_party/h2, [patch.crates-io] in Cargo.toml)?"
    );
    drop(open);
    Ok(())
}
