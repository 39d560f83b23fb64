//! The read-only fleet page: `GET /fleet` (a static page, its script and style: no data, no external resource, a
//! strict Content-Security-Policy) and the one method it calls, `fleet.overview` (`compute:fleet:read` on
//! `fleet`), with the operator's API key in an `Authorization` header. The key is typed into the page, kept in the
//! tab's `sessionStorage` and never put in a URL, a cookie or a log. The page refreshes itself every 5 s.
//!
//! The answer is summed up by bc-core (`bc_core::api::fleet::overview`, pure) from the nodes module's view of the
//! nodes, the store's GPU and reservation counts, and the metal module's machines.

use crate::api::ApiState;
use bc_core::api::fleet::{FleetInput, FleetOverview, FleetRequest, GpuTally};
use bc_kernel::{ApiError, Cx, Method, Scope};
use serde_json::{Value, json};

bc_kernel::api_method!(
    /// `fleet.overview`: the fleet page's data.
    pub FleetMethod = "fleet" / "overview": FleetRequest => FleetOverview
);

/// The permission the page's caller needs (on the scope `fleet`).
pub const READ: &str = "compute:fleet:read";

/// How many failed reservations the page lists (the newest).
const FAILED_RESERVATIONS: i64 = 50;

/// Where the page lives.
pub const PAGE: &str = "/fleet";

/// The page's strict policy: its own script, style and API only; no inline code, no frames, no forms posted.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                       img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const HTML: &str = include_str!("../fleet/fleet.html");
const SCRIPT: &str = include_str!("../fleet/fleet.js");
const STYLE: &str = include_str!("../fleet/fleet.css");

pub(crate) fn method() -> Method<FleetMethod> {
    Method::<FleetMethod>::new()
        .permission(READ)
        .scope(Scope::fixed("fleet"))
        .handler(overview)
}

async fn overview(cx: Cx, _: FleetRequest) -> Result<FleetOverview, ApiError> {
    let state = cx.get::<ApiState>()?;
    let nodes = cx.get::<bc_mod_nodes::Nodes>()?;
    let rows = state.store.list_nodes().await?;
    let shown = bc_mod_nodes::api::shown(nodes, rows).await?;
    let gpus = state
        .store
        .node_gpus()
        .await?
        .into_iter()
        .map(|g| GpuTally {
            node_id: g.node_id,
            total: u64::try_from(g.total).unwrap_or(0),
            booked: u64::try_from(g.booked).unwrap_or(0),
            model: g.model,
        })
        .collect();
    let reservations = state
        .store
        .reservation_counts()
        .await?
        .into_iter()
        .map(|(s, n)| (s, u64::try_from(n).unwrap_or(0)))
        .collect();
    let failed_reservations = state
        .store
        .failed_reservations(FAILED_RESERVATIONS)
        .await?
        .into_iter()
        .map(|r| (r.id, r.error))
        .collect();
    let machines = bc_mod_metal::queries::list(state.store.pool(), None, None, None).await?;
    let input = FleetInput {
        nodes: shown,
        gpus,
        reservations,
        failed_reservations,
        machines,
    };
    Ok(bc_core::api::fleet::overview(input, now_ms()))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The page's three files, each with the headers that keep it self-contained.
pub fn routes() -> axum::Router {
    axum::Router::new()
        .route(
            PAGE,
            axum::routing::get(|| async { asset("text/html; charset=utf-8", HTML) }),
        )
        .route(
            "/fleet/fleet.js",
            axum::routing::get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/fleet/fleet.css",
            axum::routing::get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> axum::response::Response {
    use axum::http::header;
    use axum::response::IntoResponse as _;
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        body,
    )
        .into_response()
}

/// The page's entry in the API document.
pub fn api_path() -> (&'static str, Value) {
    (
        PAGE,
        json!({ "get": {
            "operationId": "fleet-page",
            "summary": "The fleet page",
            "description": "A read-only page (HTML, with /fleet/fleet.js and /fleet/fleet.css) that asks for an API key \
                holding `compute:fleet:read` on `fleet`, then shows `fleet.overview` and refreshes every 5 s. It \
                loads nothing from elsewhere (`Content-Security-Policy: default-src 'none'; script-src 'self'; …`).",
            "security": [],
            "responses": {
                "200": { "description": "The page.", "content": { "text/html": { "schema": { "type": "string" } } } },
            },
        }}),
    )
}
