//! The gRPC codec every generated client and server uses: prost's, with small first buffers.
//!
//! tonic gives each call's encoder and decoder a buffer of 8 KiB up front. A gateway holds one long-lived Session
//! call per node, whose messages are a few hundred bytes, so those two buffers were 16 KiB of every idle session
//! (measured with heaptrack on `scripts/bench sessions`: 16.6 KiB of about 62 KiB allocated per session). Here they
//! start at [`FIRST_BUFFER`] and grow as a message needs, to its size: a tunnel's 128 KiB frames still fit in one
//! allocation each, and the encoder still hands frames on in batches of up to 32 KiB (tonic's yield threshold).

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// A call's first encode and decode buffer: room for the Session's messages (Hello, heartbeats, acks, Welcome).
pub const FIRST_BUFFER: usize = 1024;
/// Bytes the encoder gathers before it hands them on (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

fn settings() -> BufferSettings {
    BufferSettings::new(FIRST_BUFFER, YIELD_THRESHOLD)
}

/// prost's codec with [`FIRST_BUFFER`]-sized first buffers (the generated code's `codec_path`).
#[derive(Debug, Clone)]
pub struct LeanCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for LeanCodec<T, U> {
    fn default() -> Self {
        LeanCodec { _pd: PhantomData }
    }
}

impl<T, U> Codec for LeanCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::codec::{Decoder as _, Encoder as _};

    #[test]
    fn both_halves_start_small() {
        let mut c = LeanCodec::<crate::v1::NodeMessage, crate::v1::GatewayMessage>::default();
        // BufferSettings has no accessors: compare with settings built the same way.
        let want = format!("{:?}", settings());
        assert_eq!(format!("{:?}", c.encoder().buffer_settings()), want);
        assert_eq!(format!("{:?}", c.decoder().buffer_settings()), want);
        assert!(want.contains("buffer_size: 1024"), "{want}");
    }
}
