#![no_main]
//! Every message either side decodes from the other: the gateway decodes NodeMessage, JoinRequest, RenewRequest,
//! TunnelFrame and SecretRequestMessage, and from a site agent its SiteService requests; the daemon decodes
//! GatewayMessage, JoinResponse and RenewResponse, and the site agent the SiteService and SecretService answers.
use bc_proto::v1;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    // NodeMessage covers CommandProgress (oneof field 7); the gateway then reads its payload as JSON.
    if let Ok(v1::NodeMessage {
        msg: Some(v1::node_message::Msg::Progress(p)),
    }) = v1::NodeMessage::decode(data)
    {
        let _ = serde_json::from_slice::<serde_json::Value>(&p.payload);
    }
    let _ = v1::CommandProgress::decode(data);
    let _ = v1::GatewayMessage::decode(data);
    let _ = v1::JoinRequest::decode(data);
    let _ = v1::JoinResponse::decode(data);
    let _ = v1::RenewRequest::decode(data);
    let _ = v1::RenewResponse::decode(data);
    let _ = v1::TunnelFrame::decode(data);
    let _ = v1::SecretRequestMessage::decode(data);
    let _ = v1::SecretResponse::decode(data);
    let _ = v1::BootLeaseRequest::decode(data);
    let _ = v1::BootLeaseResponse::decode(data);
    let _ = v1::NetbootRequest::decode(data);
    let _ = v1::NetbootResponse::decode(data);
    let _ = v1::ArtifactRequest::decode(data);
    let _ = v1::ArtifactChunk::decode(data);
    let _ = v1::BmcCommandsRequest::decode(data);
    let _ = v1::BmcCommandsResponse::decode(data);
    let _ = v1::BmcResultRequest::decode(data);
    let _ = v1::BmcResultResponse::decode(data);
    let _ = v1::SiteReportResponse::decode(data);
});
