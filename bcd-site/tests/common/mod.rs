//! Test BMCs on axum: the DMTF mockup served read-only, and a programmable fake with the vendor quirks the client
//! must survive (409s, exhausted sessions, ETag rules, overrides that are accepted but not applied).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::oneshot;

pub mod corpus;

/// A server on 127.0.0.1:0 that stops when dropped.
pub struct Served {
    pub url: String,
    _stop: oneshot::Sender<()>,
}

pub async fn serve(router: Router) -> anyhow::Result<Served> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
    Ok(Served { url, _stop: stop })
}

/// A server that answers 404 to everything and records each request as `METHOD path authorization x-auth-token`
/// (the authorization and token `-` when absent): where a BMC's foreign link or redirect would lead.
pub async fn elsewhere() -> anyhow::Result<(Served, Arc<Mutex<Vec<String>>>)> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let router = Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap| {
        let log = log.clone();
        async move {
            let h = |n: &str| {
                headers
                    .get(n)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-")
                    .to_owned()
            };
            let line = format!(
                "{method} {} {} {}",
                uri.path(),
                h("authorization"),
                h("x-auth-token")
            );
            log.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            StatusCode::NOT_FOUND
        }
    });
    Ok((serve(router).await?, seen))
}

// === the DMTF mockup, read-only ===

#[derive(Clone)]
struct Mockup {
    dir: PathBuf,
    overlay: Arc<HashMap<String, Value>>,
}

/// Serves `dir` (one `index.json` per resource path under `/redfish/v1`), with `overlay` resources taking
/// precedence. Anything but GET is 405, like a read-only service.
pub async fn mockup(dir: PathBuf, overlay: HashMap<String, Value>) -> anyhow::Result<Served> {
    let state = Mockup {
        dir,
        overlay: Arc::new(overlay),
    };
    serve(Router::new().fallback(mockup_handler).with_state(state)).await
}

async fn mockup_handler(State(m): State<Mockup>, method: Method, uri: Uri) -> Response {
    if method != Method::GET {
        return (StatusCode::METHOD_NOT_ALLOWED, "read-only mockup").into_response();
    }
    let path = uri.path().trim_end_matches('/');
    if let Some(v) = m.overlay.get(path) {
        // `{"$redirect": url}` answers 307 to `url`, as a BMC that redirects elsewhere would.
        if let Some(to) = v.get("$redirect").and_then(Value::as_str) {
            return (
                StatusCode::TEMPORARY_REDIRECT,
                [(header::LOCATION, to.to_owned())],
            )
                .into_response();
        }
        return axum::Json(v.clone()).into_response();
    }
    let Some(rest) = path.strip_prefix("/redfish/v1") else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if rest.split('/').any(|c| c == "..") {
        return StatusCode::NOT_FOUND.into_response();
    }
    let file = m.dir.join(rest.trim_start_matches('/')).join("index.json");
    match tokio::fs::read(&file).await {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => StatusCode::NOT_FOUND.into_response(),
    }
}

// === a programmable fake BMC ===

#[derive(Debug, Clone)]
pub struct FakeState {
    pub vendor: Option<String>,
    pub session_service: bool,
    pub sessions_max: usize,
    pub sessions: Vec<String>,
    pub basic_ok: bool,
    pub power: String,
    /// What GET reports (a stale BMC may report Off while the host is on).
    pub reported_power: Option<String>,
    pub allowed_resets: Vec<String>,
    /// Reset answers 409 this many times first.
    pub reset_conflicts_left: u32,
    /// GET of the system answers 500 this many times first (sushy's libvirt driver does when the domain stops
    /// between two of its libvirt calls).
    pub system_get_errors_left: u32,
    /// Reset answers 500 this many times first.
    pub reset_errors_left: u32,
    /// Reset On answers 409 with iDRAC's PSU501 ("already powered on").
    pub psu501: bool,
    /// Apply accepted resets (false: 204 and PowerState never changes).
    pub apply_power: bool,
    pub boot_target: String,
    pub boot_enabled: String,
    pub boot_mode: String,
    /// Accept the boot PATCH and apply it (false: 204 and nothing changes).
    pub apply_boot: bool,
    pub require_if_match: bool,
    /// Send ETags on GET.
    pub send_etag: bool,
    pub etag: u64,
    /// PATCHes answered 412 although the ETag matched (someone else changed the resource meanwhile).
    pub stale_patches_left: u32,
    /// Delay for every GET of the system, to observe concurrency.
    pub get_delay: Duration,
    /// A wrong password at login is answered 400 (as some BMCs do) rather than 401.
    pub bad_login_400: bool,
    /// `BootSourceOverrideMode` is read-only: a PATCH carrying it is refused with 400.
    pub mode_read_only: bool,
    /// The system has no `Boot` object.
    pub no_boot: bool,
    /// The system advertises no `#ComputerSystem.Reset`.
    pub no_reset: bool,
    pub in_flight: usize,
    pub max_in_flight: usize,
    /// `METHOD path [If-Match] [body]` per request.
    pub log: Vec<String>,
}

impl Default for FakeState {
    fn default() -> Self {
        FakeState {
            vendor: None,
            session_service: true,
            sessions_max: 4,
            sessions: Vec::new(),
            basic_ok: true,
            power: "Off".into(),
            reported_power: None,
            allowed_resets: ["On", "ForceOff", "GracefulShutdown", "ForceRestart"]
                .map(String::from)
                .to_vec(),
            reset_conflicts_left: 0,
            system_get_errors_left: 0,
            reset_errors_left: 0,
            psu501: false,
            apply_power: true,
            boot_target: "Hdd".into(),
            boot_enabled: "Disabled".into(),
            boot_mode: "UEFI".into(),
            apply_boot: true,
            require_if_match: false,
            send_etag: true,
            etag: 1,
            stale_patches_left: 0,
            get_delay: Duration::ZERO,
            bad_login_400: false,
            mode_read_only: false,
            no_boot: false,
            no_reset: false,
            in_flight: 0,
            max_in_flight: 0,
            log: Vec::new(),
        }
    }
}

pub type Shared = Arc<Mutex<FakeState>>;

pub async fn fake_bmc(state: FakeState) -> anyhow::Result<(Served, Shared)> {
    let shared: Shared = Arc::new(Mutex::new(state));
    let served = serve(
        Router::new()
            .fallback(fake_handler)
            .with_state(shared.clone()),
    )
    .await?;
    Ok((served, shared))
}

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, FakeState> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

fn error(status: StatusCode, id: &str, message: &str) -> Response {
    let body = json!({"error": {"code": "Base.1.8.GeneralError", "message": "see ExtendedInfo",
        "@Message.ExtendedInfo": [{"MessageId": id, "Message": message, "Severity": "Critical"}]}});
    (status, axum::Json(body)).into_response()
}

const USER: &str = "admin";
const PASS: &str = "secret";

fn basic_ok(headers: &HeaderMap) -> bool {
    use base64::Engine as _;
    let want = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASS}"));
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == format!("Basic {want}"))
}

async fn fake_handler(
    State(s): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().trim_end_matches('/').to_owned();
    let if_match = headers
        .get(header::IF_MATCH)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body_text = String::from_utf8_lossy(&body).into_owned();
    {
        let mut st = lock(&s);
        st.log.push(
            format!(
                "{method} {path} {} {body_text}",
                if_match.clone().unwrap_or_default()
            )
            .trim_end()
            .to_owned(),
        );
    }
    let json_body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);

    // Unauthenticated: the service root and login.
    if path == "/redfish/v1" && method == Method::GET {
        let st = lock(&s);
        let mut root = json!({"@odata.id": "/redfish/v1", "Id": "RootService", "RedfishVersion": "1.15.0",
            "Systems": {"@odata.id": "/redfish/v1/Systems"}, "Managers": {"@odata.id": "/redfish/v1/Managers"}});
        if let Some(v) = &st.vendor {
            root["Vendor"] = json!(v);
        }
        if st.session_service {
            root["SessionService"] = json!({"@odata.id": "/redfish/v1/SessionService"});
            root["Links"] =
                json!({"Sessions": {"@odata.id": "/redfish/v1/SessionService/Sessions"}});
        }
        return axum::Json(root).into_response();
    }
    if path == "/redfish/v1/SessionService/Sessions" && method == Method::POST {
        let mut st = lock(&s);
        if !st.session_service {
            return StatusCode::NOT_FOUND.into_response();
        }
        if json_body["UserName"] != USER || json_body["Password"] != PASS {
            return error(
                if st.bad_login_400 {
                    StatusCode::BAD_REQUEST
                } else {
                    StatusCode::UNAUTHORIZED
                },
                "Base.1.8.NoValidSession",
                "invalid credentials",
            );
        }
        if st.sessions.len() >= st.sessions_max {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "Base.1.8.SessionLimitExceeded",
                "The session establishment failed due to the number of simultaneous sessions exceeding the limit of the implementation.",
            );
        }
        let id = format!("s{}", st.log.len());
        st.sessions.push(id.clone());
        let location = format!("/redfish/v1/SessionService/Sessions/{id}");
        return (
            StatusCode::CREATED,
            [
                ("X-Auth-Token", format!("token-{id}")),
                ("Location", location.clone()),
            ],
            axum::Json(json!({"@odata.id": location, "Id": id})),
        )
            .into_response();
    }

    // Everything else needs a session token or Basic.
    let authed = {
        let st = lock(&s);
        let token_ok = headers
            .get("x-auth-token")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| st.sessions.iter().any(|id| t == format!("token-{id}")));
        token_ok || (st.basic_ok && basic_ok(&headers))
    };
    if !authed {
        return error(
            StatusCode::UNAUTHORIZED,
            "Base.1.8.NoValidSession",
            "no valid session",
        );
    }

    if let Some(id) = path.strip_prefix("/redfish/v1/SessionService/Sessions/")
        && method == Method::DELETE
    {
        lock(&s).sessions.retain(|s| s != id);
        return StatusCode::NO_CONTENT.into_response();
    }
    match (method.as_str(), path.as_str()) {
        ("GET", "/redfish/v1/Systems") => axum::Json(
            json!({"Members": [{"@odata.id": "/redfish/v1/Systems/1"}], "Members@odata.count": 1}),
        )
        .into_response(),
        ("GET", "/redfish/v1/Managers") => {
            axum::Json(json!({"Members": [{"@odata.id": "/redfish/v1/Managers/1"}]}))
                .into_response()
        }
        ("GET", "/redfish/v1/Managers/1") => {
            let vendor = lock(&s).vendor.clone();
            axum::Json(json!({"Id": "1", "Manufacturer": vendor, "Model": "fake"})).into_response()
        }
        ("GET", "/redfish/v1/Systems/1") => {
            let delay = {
                let mut st = lock(&s);
                st.in_flight += 1;
                st.max_in_flight = st.max_in_flight.max(st.in_flight);
                st.get_delay
            };
            tokio::time::sleep(delay).await;
            let mut st = lock(&s);
            st.in_flight -= 1;
            if st.system_get_errors_left > 0 {
                st.system_get_errors_left -= 1;
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Base.1.0.GeneralError",
                    "Requested operation is not valid: domain is not running",
                );
            }
            let mut body = json!({
                "@odata.id": "/redfish/v1/Systems/1", "Id": "1", "Manufacturer": st.vendor,
                "PowerState": st.reported_power.clone().unwrap_or_else(|| st.power.clone()),
                "Boot": {"BootSourceOverrideTarget": st.boot_target, "BootSourceOverrideEnabled": st.boot_enabled,
                    "BootSourceOverrideMode": st.boot_mode,
                    "BootSourceOverrideTarget@Redfish.AllowableValues": ["None", "Pxe", "Hdd", "UefiHttp"]},
                "Actions": {"#ComputerSystem.Reset": {"target": "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset",
                    "ResetType@Redfish.AllowableValues": st.allowed_resets}}
            });
            if st.no_boot {
                body.as_object_mut().map(|o| o.remove("Boot"));
            }
            if st.no_reset {
                body["Actions"] = json!({});
            }
            let etag = format!("W/\"{}\"", st.etag);
            if st.send_etag {
                ([(header::ETAG, etag)], axum::Json(body)).into_response()
            } else {
                axum::Json(body).into_response()
            }
        }
        ("PATCH", "/redfish/v1/Systems/1") => {
            let mut st = lock(&s);
            let current = format!("W/\"{}\"", st.etag);
            match &if_match {
                None if st.require_if_match => {
                    return error(
                        StatusCode::PRECONDITION_REQUIRED,
                        "Ami.1.0.PreconditionHeaderMissing",
                        "The request did not provide the required precondition, such as an If-Match or If-None-Match header.",
                    );
                }
                Some(tag) if tag != "*" && *tag != current => {
                    return error(
                        StatusCode::PRECONDITION_FAILED,
                        "Base.1.8.PreconditionFailed",
                        "The ETag supplied did not match the ETag required to change this resource.",
                    );
                }
                _ => {}
            }
            if st.mode_read_only && json_body["Boot"].get("BootSourceOverrideMode").is_some() {
                return error(
                    StatusCode::BAD_REQUEST,
                    "Base.1.8.PropertyNotWritable",
                    "The property BootSourceOverrideMode is a read only property and cannot be assigned a value.",
                );
            }
            if st.stale_patches_left > 0 {
                st.stale_patches_left -= 1;
                st.etag += 1;
                return error(
                    StatusCode::PRECONDITION_FAILED,
                    "Base.1.8.PreconditionFailed",
                    "The ETag supplied did not match the ETag required to change this resource.",
                );
            }
            if st.apply_boot {
                let boot = &json_body["Boot"];
                if let Some(t) = boot["BootSourceOverrideTarget"].as_str() {
                    st.boot_target = t.to_owned();
                }
                if let Some(e) = boot["BootSourceOverrideEnabled"].as_str() {
                    st.boot_enabled = e.to_owned();
                }
                if let Some(m) = boot["BootSourceOverrideMode"].as_str() {
                    st.boot_mode = m.to_owned();
                }
                st.etag += 1;
            }
            StatusCode::NO_CONTENT.into_response()
        }
        ("POST", "/redfish/v1/Systems/1/Actions/ComputerSystem.Reset") => {
            let mut st = lock(&s);
            let reset = json_body["ResetType"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if !st.allowed_resets.contains(&reset) {
                return error(
                    StatusCode::BAD_REQUEST,
                    "Base.1.8.ActionParameterValueNotInList",
                    "ResetType not allowed",
                );
            }
            if st.psu501 && reset == "On" && st.power == "On" {
                return error(
                    StatusCode::CONFLICT,
                    "IDRAC.2.8.PSU501",
                    "Unable to perform the operation because the server is already powered ON.",
                );
            }
            if st.reset_errors_left > 0 {
                st.reset_errors_left -= 1;
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Base.1.0.InternalError",
                    "The request failed due to an internal service error.",
                );
            }
            if st.reset_conflicts_left > 0 {
                st.reset_conflicts_left -= 1;
                return error(
                    StatusCode::CONFLICT,
                    "Base.1.8.ResourceInUse",
                    "The change could not be made because the resource was in use or in transition (server still powering off).",
                );
            }
            if st.apply_power {
                match reset.as_str() {
                    "On" | "ForceOn" => st.power = "On".into(),
                    "ForceOff" | "GracefulShutdown" => st.power = "Off".into(),
                    _ => {}
                }
            }
            StatusCode::NO_CONTENT.into_response()
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}
