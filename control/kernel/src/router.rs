//! The HTTP API: `POST /api/compute/{group}/{method}` with a JSON body and a bearer API key, dispatched to the
//! registered method. The caller is authenticated before the body is read; every refusal, the router's own and the
//! HTTP layer's, is `{code, message}` saying what to send instead.

use crate::backend::{Authenticator, Backend};
use crate::error::ApiError;
use crate::method::{Caller, Cx, MethodDef};
use crate::resources::Resources;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

/// The largest body of an API method the server reads (uploads have their own streamed routes).
pub const MAX_BODY: usize = 2 << 20;
/// A method body must arrive whole within this long.
pub const BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// The paths the kernel serves itself besides the methods: no module route may take one.
pub const KERNEL_PATHS: [&str; 3] = ["/healthz", "/readyz", crate::openapi::OPENAPI_PATH];

/// `/readyz` answers 503 when the database does not answer within this long.
pub const READY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// What the router's handlers (and modules' own routes) share.
#[derive(Clone)]
pub struct RouterState {
    resources: Arc<Resources>,
    auth: Arc<dyn Authenticator>,
    backend: Arc<dyn Backend>,
    methods: Arc<HashMap<&'static str, HashMap<&'static str, MethodDef>>>,
    /// Extra routes and the HTTP method each answers.
    routes: Arc<Vec<(&'static str, &'static str)>>,
}

impl RouterState {
    pub(crate) fn new(
        resources: Arc<Resources>,
        auth: Arc<dyn Authenticator>,
        backend: Arc<dyn Backend>,
        methods: &[MethodDef],
        routes: Vec<(&'static str, &'static str)>,
    ) -> RouterState {
        let mut by_group: HashMap<&'static str, HashMap<&'static str, MethodDef>> = HashMap::new();
        for m in methods {
            by_group
                .entry(m.group)
                .or_default()
                .insert(m.method, m.clone());
        }
        RouterState {
            resources,
            auth,
            backend,
            methods: Arc::new(by_group),
            routes: Arc::new(routes),
        }
    }

    pub fn resources(&self) -> &Arc<Resources> {
        &self.resources
    }

    /// The caller a request's `Authorization: Bearer <api key>` names, or UNAUTHENTICATED saying why.
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Caller>, ApiError> {
        let header = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| ApiError::unauthenticated("missing Authorization: Bearer <api key>"))?;
        let key = header
            .strip_prefix("Bearer ")
            .ok_or_else(|| ApiError::unauthenticated("Authorization must be Bearer <api key>"))?;
        self.auth.authenticate(key).await
    }
}

pub(crate) fn router(
    state: RouterState,
    extra: Vec<(&'static str, axum::routing::MethodRouter<RouterState>)>,
) -> axum::Router {
    let mut router = axum::Router::new()
        .route(
            "/api/compute/{group}/{method}",
            axum::routing::post(dispatch),
        )
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/readyz", axum::routing::get(readyz))
        .route(crate::openapi::OPENAPI_PATH, axum::routing::get(openapi));
    for (path, route) in extra {
        router = router.route(path, route);
    }
    router
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(state)
}

/// Ready when the database answers within [`READY_DEADLINE`]; UNAVAILABLE naming the cause otherwise.
async fn readyz(State(state): State<RouterState>) -> Response {
    let check = tokio::time::timeout(READY_DEADLINE, state.backend.check()).await;
    match check {
        Ok(Ok(())) => axum::Json(serde_json::json!({ "ready": true })).into_response(),
        Ok(Err(e)) => ApiError::unavailable(format!("not ready: {}", e.message())).into_response(),
        Err(_) => ApiError::unavailable(format!(
            "not ready: the database did not answer within {} s",
            READY_DEADLINE.as_secs()
        ))
        .into_response(),
    }
}

async fn openapi(State(state): State<RouterState>) -> Response {
    match state.resources.get::<crate::plane::OpenApiDocument>() {
        Some(doc) => axum::Json(doc.0.as_ref()).into_response(),
        None => ApiError::unavailable("the API document is not built yet").into_response(),
    }
}

async fn unknown_route(State(state): State<RouterState>, uri: axum::http::Uri) -> ApiError {
    let uploads: Vec<String> = state
        .routes
        .iter()
        .map(|(path, method)| format!("{method} {path}"))
        .collect();
    let uploads = if uploads.is_empty() {
        String::new()
    } else {
        format!(", uploads {}", uploads.join(", "))
    };
    ApiError::not_found(format!(
        "no route {}: API methods are POST /api/compute/{{group}}/{{method}}{uploads}",
        uri.path()
    ))
}

async fn wrong_method(
    State(state): State<RouterState>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> ApiError {
    let allowed = match uri.path() {
        p if KERNEL_PATHS.contains(&p) => "GET",
        path => state
            .routes
            .iter()
            .find(|(p, _)| *p == path)
            .map_or("POST", |(_, m)| m),
    };
    ApiError::invalid(format!(
        "{method} is not allowed on {}: use {allowed}",
        uri.path()
    ))
    .with_status(StatusCode::METHOD_NOT_ALLOWED)
}

/// Reads a method's JSON body: at most [`MAX_BODY`] bytes within [`BODY_DEADLINE`]; an empty body is `{}`; any
/// other body must be `Content-Type: application/json` and valid JSON whose strings pass [`check_strings`]. Every
/// rejection is an [`ApiError`] saying what to send instead.
pub async fn read_body(headers: &HeaderMap, body: axum::body::Body) -> Result<Value, ApiError> {
    use tokio_stream::StreamExt as _;
    let too_large = || {
        ApiError::invalid(format!(
            "the request body is larger than {MAX_BODY} bytes; send less (artifacts go to PUT /api/artifacts)"
        ))
        .with_status(StatusCode::PAYLOAD_TOO_LARGE)
    };
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let mut stream = body.into_data_stream();
    let read = async {
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!(
                    "reading the request body failed: {e}; send it again"
                ))
            })?;
            if bytes.len() + chunk.len() > MAX_BODY {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    let bytes = tokio::time::timeout(BODY_DEADLINE, read)
        .await
        .map_err(|_| {
            ApiError::invalid(format!(
                "the request body did not arrive within {} s; send it again",
                BODY_DEADLINE.as_secs()
            ))
        })??;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Object(serde_json::Map::new()));
    }
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let is_json = content_type.as_deref().is_some_and(|ct| {
        let essence = ct.split(';').next().unwrap_or_default().trim();
        essence.eq_ignore_ascii_case("application/json")
            || essence.to_ascii_lowercase().ends_with("+json")
    });
    if !is_json {
        return Err(ApiError::invalid(format!(
            "the request body must be JSON with Content-Type: application/json (got {})",
            content_type.map_or_else(|| "no Content-Type".to_string(), |c| format!("{c:?}"))
        ))
        .with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE));
    }
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    check_strings(&value)?;
    Ok(value)
}

/// Refuses a request whose JSON holds a string (or an object key) with a NUL character anywhere: no field of any
/// method accepts one (PostgreSQL cannot store it, and no name, id or secret needs it). The error names the field
/// as a path (`grants[0].scope`).
pub fn check_strings(value: &Value) -> Result<(), ApiError> {
    fn walk(v: &Value, path: &mut String) -> Result<(), ApiError> {
        let nul = |path: &str| {
            ApiError::invalid(format!(
                "field {} contains a NUL character (\\u0000), which no field accepts; remove it",
                if path.is_empty() { "(the body)" } else { path }
            ))
        };
        match v {
            Value::String(s) if s.contains('\0') => Err(nul(path)),
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let len = path.len();
                    path.push_str(&format!("[{i}]"));
                    walk(item, path)?;
                    path.truncate(len);
                }
                Ok(())
            }
            Value::Object(map) => {
                for (key, item) in map {
                    let len = path.len();
                    if !path.is_empty() {
                        path.push('.');
                    }
                    if key.contains('\0') {
                        path.push_str(&key.replace('\0', "\\u0000"));
                        return Err(ApiError::invalid(format!(
                            "field name {path:?} contains a NUL character, which no field accepts; remove it"
                        )));
                    }
                    path.push_str(key);
                    walk(item, path)?;
                    path.truncate(len);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
    walk(value, &mut String::new())
}

async fn dispatch(
    State(state): State<RouterState>,
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
    request: axum::extract::Request,
) -> Response {
    match call(state, path, request).await {
        Ok(body) => (
            [(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn call(
    state: RouterState,
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
    request: axum::extract::Request,
) -> Result<Vec<u8>, ApiError> {
    let Path((group, method)) = path.map_err(|e| {
        ApiError::not_found(format!(
            "no such method ({e}): API methods are POST /api/compute/{{group}}/{{method}}"
        ))
    })?;
    let (parts, body) = request.into_parts();
    // The caller first: an unauthenticated request is answered before its body is read. The key's lookup is a
    // query like any handler's, so it has the methods' deadline too, and is cut short at a move of the database
    // primary as they are: one waiting on a primary gone silent held its pooled connection until the deadline,
    // and with enough of them every later call waited out the pool's acquire timeout (`scripts/bench failover`
    // with a hung primary: the API answered again 10 s after the hang instead of 4.5 s).
    let moved = crate::resources::next_move(&state.resources);
    let looked_up =
        tokio::time::timeout(crate::METHOD_DEADLINE, state.authenticate(&parts.headers));
    let caller = tokio::select! {
        caller = looked_up => caller.map_err(|_| {
            ApiError::unavailable(format!(
                "authenticating the caller took longer than {} s (the database did not answer); retry",
                crate::METHOD_DEADLINE.as_secs()
            ))
        })??,
        () = moved => {
            return Err(ApiError::unavailable(
                "authenticating the caller was cut short: the database primary moved while it ran; retry",
            ));
        }
    };
    let body = read_body(&parts.headers, body).await?;
    let def = state
        .methods
        .get(group.as_str())
        .and_then(|g| g.get(method.as_str()))
        .ok_or_else(|| ApiError::not_found(format!("no method {group}.{method}")))?;
    let (Some(call), Some(permission)) = (&def.call, def.permission) else {
        return Err(ApiError::not_found(format!("no method {group}.{method}")));
    };
    call(Cx::new(state.resources.clone(), caller, permission), body).await
}
