#![no_main]
use bc_proto::token::{Token, TokenKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        for kind in [TokenKind::Join, TokenKind::Site, TokenKind::ApiKey] {
            if let Ok(t) = Token::parse(kind, s) {
                assert_eq!(Token::parse(kind, &t.reveal()).ok(), Some(t));
            }
        }
    }
});
