#![no_main]
//! Every message either side decodes from the other: the gateway decodes NodeMessage, JoinRequest, RenewRequest,
//! TunnelFrame and SecretRequestMessage; the daemon decodes GatewayMessage, JoinResponse and RenewResponse.
use bc_proto::v1;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let _ = v1::NodeMessage::decode(data);
    let _ = v1::GatewayMessage::decode(data);
    let _ = v1::JoinRequest::decode(data);
    let _ = v1::JoinResponse::decode(data);
    let _ = v1::RenewRequest::decode(data);
    let _ = v1::RenewResponse::decode(data);
    let _ = v1::TunnelFrame::decode(data);
    let _ = v1::SecretRequestMessage::decode(data);
});
