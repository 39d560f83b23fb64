#![no_main]
use bc_proto::v1;
use jwt_simple::prelude::{EcdhEsA256KWDecryptionKey, EcdhEsA256KWEncryptionKey};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use std::path::Path;
use std::sync::OnceLock;

fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp dir"))
        .path()
}

fn cache() -> &'static bcd::site::cache::ArtifactCache {
    static CACHE: OnceLock<bcd::site::cache::ArtifactCache> = OnceLock::new();
    CACHE.get_or_init(|| bcd::site::cache::ArtifactCache::new(cache_dir(), 1))
}

/// A runtime like the site agent's: with the timer, since `write_verified` bounds every wait for the next chunk
/// (`tokio::time::timeout`). Without `enable_time` every input that reached the chunk parser panicked in the
/// harness ("timers are disabled") and the parser itself was never fuzzed (issue 10, item 21).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    })
}

// The site agent's parsers of what reaches it through the gateway (the netboot table with its artifact references,
// a secret JWE, an artifact's chunk stream), and the control plane's parser of a SecretRequest's recipient key (a
// JWK from the site). First byte picks the parser.
fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => {
            if let Ok(r) = v1::NetbootResponse::decode(rest) {
                let table = bcd::site::netboot_table(&r);
                assert!(table.len() <= r.machines.len());
                let (ready, missing) = cache().split(&r);
                assert!(ready.machines.len() <= r.machines.len());
                assert!(
                    missing
                        .iter()
                        .all(|a| bcd::site::cache::is_sha256_hex(&a.sha256))
                );
            }
        }
        3 => {
            // Length-delimited ArtifactChunks, verified against a fixed reference: never accepted unless the
            // bytes hash to it, never a panic.
            let mut chunks = Vec::new();
            let mut buf = rest;
            while let Ok(c) = v1::ArtifactChunk::decode_length_delimited(&mut buf) {
                chunks.push(Ok(c));
                if buf.is_empty() {
                    break;
                }
            }
            let sha = "8a0b4d1e6a8f3c2b5e7d9f1a3c5e7b9d1f3a5c7e9b1d3f5a7c9e1b3d5f7a9c1e";
            let size = chunks
                .iter()
                .map(|c| {
                    c.as_ref()
                        .map_or(0, |c: &v1::ArtifactChunk| c.data.len() as u64)
                })
                .sum();
            let r = runtime().block_on(bcd::site::cache::write_verified(
                cache_dir(),
                sha,
                size,
                tokio_stream::iter(chunks),
            ));
            assert!(
                r.is_err(),
                "content hashing to a made-up reference accepted"
            );
        }
        1 => {
            static KEY: OnceLock<EcdhEsA256KWDecryptionKey> = OnceLock::new();
            let key = KEY.get_or_init(EcdhEsA256KWDecryptionKey::generate);
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = bcd::site::open_secret(key, s, "bmc/x", "rack-1");
            }
        }
        2 => {
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = EcdhEsA256KWEncryptionKey::from_jwk(s);
            }
        }
        _ => {}
    }
});
