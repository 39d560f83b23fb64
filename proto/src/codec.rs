//! The gRPC codec every generated client and server uses: prost's, with small first buffers.
//!
//! tonic gives each call's encoder and decoder a buffer of 8 KiB up front. A gateway holds one long-lived Session
//! call per node, whose messages are a few hundred bytes, so those two buffers were 16 KiB of every idle session
//! (measured with heaptrack on `scripts/bench sessions`: 16.6 KiB of about 62 KiB allocated per session). Here they
//! start at [`FIRST_BUFFER`] and grow as a message needs, to its size. The bulk streams (a tunnel's frames, a site's
//! artifact chunks) keep tonic's 8 KiB: their calls are few, and their data path stays as it was measured.

use crate::v1;
use std::any::TypeId;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// A call's first encode and decode buffer: room for the Session's messages (Hello, heartbeats, acks, Welcome).
pub const FIRST_BUFFER: usize = 1024;
/// Bytes the encoder gathers before it hands them on (tonic's default).
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`FIRST_BUFFER`], or tonic's default when `T` is a bulk stream's message.
fn settings<T: 'static>() -> BufferSettings {
    let bulk = [
        TypeId::of::<v1::TunnelFrame>(),
        TypeId::of::<v1::ArtifactChunk>(),
    ];
    if bulk.contains(&TypeId::of::<T>()) {
        BufferSettings::default()
    } else {
        BufferSettings::new(FIRST_BUFFER, YIELD_THRESHOLD)
    }
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
        ProstCodec::<T, U>::raw_encoder(settings::<T>())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings::<U>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::codec::{Decoder as _, Encoder as _};

    // BufferSettings has no accessors: its Debug form names the size.
    fn sizes<T, U>() -> (String, String)
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        let mut c = LeanCodec::<T, U>::default();
        (
            format!("{:?}", c.encoder().buffer_settings()),
            format!("{:?}", c.decoder().buffer_settings()),
        )
    }

    #[test]
    fn a_session_starts_small_and_the_bulk_streams_keep_tonics_buffers() {
        let (enc, dec) = sizes::<v1::GatewayMessage, v1::NodeMessage>();
        assert!(enc.contains("buffer_size: 1024,"), "{enc}");
        assert!(dec.contains("buffer_size: 1024,"), "{dec}");
        let (enc, dec) = sizes::<v1::TunnelFrame, v1::TunnelFrame>();
        assert!(enc.contains("buffer_size: 8192,"), "{enc}");
        assert!(dec.contains("buffer_size: 8192,"), "{dec}");
        // A site's Artifact call: the request is small, the chunks are bulk.
        let (enc, dec) = sizes::<v1::ArtifactChunk, v1::ArtifactRequest>();
        assert!(enc.contains("buffer_size: 8192,"), "{enc}");
        assert!(dec.contains("buffer_size: 1024,"), "{dec}");
    }
}
