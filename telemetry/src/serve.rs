//! The optional loopback `/metrics` endpoint: the latest admitted snapshot in the Prometheus text format, so a
//! local scraper (or an operator with curl) sees exactly what the exporters send.

use crate::Latest;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use std::future::Future;

async fn metrics(latest: Latest) -> impl IntoResponse {
    let snap = latest.get();
    let mut body = String::with_capacity(snap.series_count() * 96);
    crate::exposition::render(&snap.families, &mut body);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, crate::exposition::CONTENT_TYPE)],
        body,
    )
}

/// Serves until `shutdown` resolves.
pub async fn run(
    listener: tokio::net::TcpListener,
    latest: Latest,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || metrics(latest.clone())),
    );
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::warn!(error = %bc_error_chain::InlineErrorChain::new(&e), "/metrics server stopped");
    }
}
