//! Bearer tokens: join tokens `bcjt_<id>.<secret>`, site tokens `bcst_<id>.<secret>` and API keys
//! `bcak_<id>.<secret>`.
//!
//! The id is public (it names the row); the secret is 32 random bytes, base64url without padding, shown once. The
//! store keeps only [`TokenSecret::hash`], a SHA-256 of the secret: the secret has 256 bits of entropy, so a slow
//! password hash would add nothing.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use std::fmt;
use subtle::ConstantTimeEq as _;

const ID_LEN: usize = 16;
const SECRET_BYTES: usize = 32;
const SECRET_LEN: usize = 43;

/// Which kind of bearer token a string is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    Join,
    Site,
    ApiKey,
}

impl TokenKind {
    pub fn prefix(self) -> &'static str {
        match self {
            TokenKind::Join => "bcjt_",
            TokenKind::Site => "bcst_",
            TokenKind::ApiKey => "bcak_",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("token must start with {expected}")]
    WrongPrefix { expected: &'static str },
    #[error("token must be <prefix><id>.<secret>: the '.' separator is missing")]
    MissingSeparator,
    #[error("token id must be {ID_LEN} lowercase hex characters")]
    BadId,
    #[error("token secret must be {SECRET_LEN} base64url characters")]
    BadSecret,
}

/// A parsed bearer token. `Debug` never prints the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    kind: TokenKind,
    id: String,
    secret: TokenSecret,
}

/// The secret half of a token.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSecret([u8; SECRET_BYTES]);

impl TokenSecret {
    /// SHA-256 of the secret, hex: the only form the store keeps.
    pub fn hash(&self) -> String {
        hex::encode(crate::sha256(&self.0))
    }

    /// Constant-time comparison against a stored hash.
    pub fn matches_hash(&self, stored_hex: &str) -> bool {
        let Ok(stored) = hex::decode(stored_hex) else {
            return false;
        };
        crate::sha256(&self.0).ct_eq(stored.as_slice()).into()
    }

    fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.0)
    }
}

impl Token {
    /// A new random token of `kind`.
    pub fn generate(kind: TokenKind) -> Result<Token, getrandom::Error> {
        let mut id = [0u8; ID_LEN / 2];
        let mut secret = [0u8; SECRET_BYTES];
        getrandom::fill(&mut id)?;
        getrandom::fill(&mut secret)?;
        Ok(Token {
            kind,
            id: hex::encode(id),
            secret: TokenSecret(secret),
        })
    }

    /// Parses `s` as a token of `kind`; surrounding whitespace is ignored (tokens get pasted).
    pub fn parse(kind: TokenKind, s: &str) -> Result<Token, TokenError> {
        let s = s.trim();
        let rest = s
            .strip_prefix(kind.prefix())
            .ok_or(TokenError::WrongPrefix {
                expected: kind.prefix(),
            })?;
        let (id, secret) = rest.split_once('.').ok_or(TokenError::MissingSeparator)?;
        if id.len() != ID_LEN
            || !id
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(TokenError::BadId);
        }
        if secret.len() != SECRET_LEN {
            return Err(TokenError::BadSecret);
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(secret)
            .map_err(|_| TokenError::BadSecret)?;
        let secret: [u8; SECRET_BYTES] = bytes.try_into().map_err(|_| TokenError::BadSecret)?;
        Ok(Token {
            kind,
            id: id.to_string(),
            secret: TokenSecret(secret),
        })
    }

    pub fn kind(&self) -> TokenKind {
        self.kind
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn secret(&self) -> &TokenSecret {
        &self.secret
    }

    /// The full token string, to be shown once to the operator.
    pub fn reveal(&self) -> String {
        format!("{}{}.{}", self.kind.prefix(), self.id, self.secret.encode())
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}.<redacted>", self.kind.prefix(), self.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_hash() -> Result<(), Box<dyn std::error::Error>> {
        let t = Token::generate(TokenKind::Join)?;
        let s = t.reveal();
        assert!(s.starts_with("bcjt_"));
        let p = Token::parse(TokenKind::Join, &format!("  {s}\n"))?;
        assert_eq!(p, t);
        assert!(p.secret().matches_hash(&t.secret().hash()));
        let other = Token::generate(TokenKind::Join)?;
        assert!(!other.secret().matches_hash(&t.secret().hash()));
        assert!(!format!("{t:?}").contains(&s[22..]));
        Ok(())
    }

    #[test]
    fn rejections_name_the_problem() {
        assert_eq!(
            Token::parse(TokenKind::Join, "bcst_0123456789abcdef.x"),
            Err(TokenError::WrongPrefix { expected: "bcjt_" })
        );
        assert_eq!(
            Token::parse(TokenKind::Join, "bcjt_abc"),
            Err(TokenError::MissingSeparator)
        );
        assert_eq!(
            Token::parse(TokenKind::Join, "bcjt_ABC.x"),
            Err(TokenError::BadId)
        );
        assert_eq!(
            Token::parse(TokenKind::Join, "bcjt_0123456789abcdef.short"),
            Err(TokenError::BadSecret)
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in ".{0,80}") {
            let _ = Token::parse(TokenKind::Join, &s);
        }
    }
}
