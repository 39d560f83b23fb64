//! Digests checked inline while the image streams.

use sha2::{Digest, Sha256, Sha512};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigestAlgo {
    Sha256,
    Sha512,
}

impl DigestAlgo {
    pub fn output_len(self) -> usize {
        match self {
            Self::Sha256 => 32,
            Self::Sha512 => 64,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Sha512 => "sha512",
        }
    }
}

/// Which bytes the expected digest covers.
///
/// `Compressed`: the bytes exactly as served (what `sha256sum image.raw.zst` prints; what most image publishers
/// list). `Decompressed`: the image as it lands on disk (what `sha256sum image.raw` prints). The pipeline also
/// computes the digest of the decompressed bytes when the request names `Compressed` and read-back is on, because
/// the disk can only be checked against the decompressed bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigestOver {
    Compressed,
    Decompressed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedDigest {
    pub algo: DigestAlgo,
    pub over: DigestOver,
    pub value: Vec<u8>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestParseError {
    #[error("{algo} digest must be {expected} hex characters, got {got}")]
    Length {
        algo: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("digest is not hexadecimal")]
    NotHex,
}

impl ExpectedDigest {
    pub fn from_hex(
        algo: DigestAlgo,
        over: DigestOver,
        hex_value: &str,
    ) -> Result<Self, DigestParseError> {
        let hex_value = hex_value.trim();
        if hex_value.len() != algo.output_len() * 2 {
            return Err(DigestParseError::Length {
                algo: algo.name(),
                expected: algo.output_len() * 2,
                got: hex_value.len(),
            });
        }
        let value = hex::decode(hex_value).map_err(|_| DigestParseError::NotHex)?;
        Ok(Self { algo, over, value })
    }
}

/// An incremental hash of either algorithm.
#[derive(Clone)]
pub enum Hasher {
    Sha256(Sha256),
    Sha512(Sha512),
}

impl Hasher {
    pub fn new(algo: DigestAlgo) -> Self {
        match algo {
            DigestAlgo::Sha256 => Self::Sha256(Sha256::new()),
            DigestAlgo::Sha512 => Self::Sha512(Sha512::new()),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        match self {
            Self::Sha256(h) => h.update(data),
            Self::Sha512(h) => h.update(data),
        }
    }

    pub fn finalize(self) -> Vec<u8> {
        match self {
            Self::Sha256(h) => h.finalize().to_vec(),
            Self::Sha512(h) => h.finalize().to_vec(),
        }
    }
}

/// Digest of a whole byte slice (tests and small inputs).
pub fn digest_of(algo: DigestAlgo, data: &[u8]) -> Vec<u8> {
    let mut h = Hasher::new(algo);
    h.update(data);
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        assert_eq!(
            hex::encode(digest_of(DigestAlgo::Sha256, b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(digest_of(DigestAlgo::Sha512, b"abc").len(), 64);
    }

    #[test]
    fn parse_checks_length_and_hex() {
        let ok = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(ExpectedDigest::from_hex(DigestAlgo::Sha256, DigestOver::Compressed, ok).is_ok());
        assert!(matches!(
            ExpectedDigest::from_hex(DigestAlgo::Sha512, DigestOver::Compressed, ok),
            Err(DigestParseError::Length {
                expected: 128,
                got: 64,
                ..
            })
        ));
        let bad = ok.replace('b', "z");
        assert_eq!(
            ExpectedDigest::from_hex(DigestAlgo::Sha256, DigestOver::Compressed, &bad),
            Err(DigestParseError::NotHex)
        );
    }
}
