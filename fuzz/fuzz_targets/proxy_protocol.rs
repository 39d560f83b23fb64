#![no_main]
//! The PROXY protocol v2 header a trusted balancer sends before a gateway connection's TLS bytes, and the
//! networks `gateway_proxy_protocol_from` names: no input may panic; a header is never longer than the bytes given
//! or MAX_HEADER, parses the same from exactly its own bytes, asks for more when cut short, and the client it
//! names encodes back to itself.
use bc_proto::proxy_protocol::{MAX_HEADER, Parsed, Prefix, encode, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(p) = text.parse::<Prefix>()
    {
        assert_eq!(p.to_string().parse::<Prefix>(), Ok(p));
    }
    match parse(data) {
        Ok(Parsed::Header { len, source }) => {
            assert!(len <= data.len() && len <= MAX_HEADER);
            assert_eq!(parse(&data[..len]), Ok(Parsed::Header { len, source }));
            assert!(
                matches!(parse(&data[..len - 1]), Ok(Parsed::Incomplete { need }) if need <= len)
            );
            if let Some(src) = source {
                let h = encode(Some((src, src)));
                assert_eq!(
                    parse(&h),
                    Ok(Parsed::Header {
                        len: h.len(),
                        source: Some(src)
                    })
                );
            }
        }
        Ok(Parsed::Incomplete { need }) => assert!(need > data.len() && need <= MAX_HEADER),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
