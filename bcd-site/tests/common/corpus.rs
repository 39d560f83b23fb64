//! A read-only Redfish service over a corpus tree (one `index.json` per resource path, as DMTF's mockups and
//! Redfish-Mockup-Creator lay them out): GET only (anything else 405, like a read-only service, so clients fall back
//! to Basic), overlay documents that take precedence, `Members` split into pages with `Members@odata.nextLink`
//! when asked, `$expand=.` / `$expand=*` (one level) when the tree's service root advertises `ExpandQuery`, and a
//! count of the requests served. Used by `tests/redfish_corpus.rs` and by `examples/bench_redfish.rs`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// How the tree is served.
#[derive(Debug, Clone, Default)]
pub struct CorpusOptions {
    /// Documents served instead of (or in addition to) the tree's, by path (`/redfish/v1/Systems`).
    pub overlay: HashMap<String, Value>,
    /// Raw bodies served as they are (malformed JSON), by path.
    pub raw: HashMap<String, Vec<u8>>,
    /// Split every collection into pages of this many members.
    pub page_size: Option<usize>,
    /// Honour `$expand` (only where the root advertises it, unless `force_expand`).
    pub expand: bool,
    /// Answer `$expand` even where the root does not advertise it (the root is rewritten to advertise it).
    pub force_expand: bool,
}

#[derive(Clone)]
struct Corpus {
    dir: PathBuf,
    opts: Arc<CorpusOptions>,
    requests: Arc<AtomicU64>,
    writes: Arc<AtomicU64>,
}

/// A served tree; stops when dropped.
pub struct CorpusServer {
    pub url: String,
    requests: Arc<AtomicU64>,
    writes: Arc<AtomicU64>,
    _stop: oneshot::Sender<()>,
}

impl CorpusServer {
    /// Requests answered so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Requests other than GET (POST, PATCH, DELETE) so far, login attempts aside: an action sent.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    pub fn reset_requests(&self) {
        self.requests.store(0, Ordering::Relaxed);
    }
}

pub async fn serve_corpus(dir: PathBuf, opts: CorpusOptions) -> anyhow::Result<CorpusServer> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let requests = Arc::new(AtomicU64::new(0));
    let writes = Arc::new(AtomicU64::new(0));
    let state = Corpus {
        dir,
        opts: Arc::new(opts),
        requests: requests.clone(),
        writes: writes.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = oneshot::channel::<()>();
    let router = Router::new().fallback(handler).with_state(state);
    tokio::spawn(async move {
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
    Ok(CorpusServer {
        url,
        requests,
        writes,
        _stop: stop,
    })
}

fn strip(path: &str) -> String {
    let p = path.trim_end_matches('/');
    if p.is_empty() {
        "/".into()
    } else {
        p.to_owned()
    }
}

impl Corpus {
    /// The document at `path` (overlay first), without paging or expansion.
    fn document(&self, path: &str) -> Option<Value> {
        let path = strip(path);
        if let Some(v) = self.opts.overlay.get(&path) {
            return Some(v.clone());
        }
        let rest = path.strip_prefix("/redfish/v1")?;
        if rest.split('/').any(|c| c == "..") {
            return None;
        }
        let file = self
            .dir
            .join(rest.trim_start_matches('/'))
            .join("index.json");
        let body = std::fs::read(file).ok()?;
        serde_json::from_slice(&body).ok()
    }

    fn advertises_expand(&self) -> bool {
        self.document("/redfish/v1")
            .and_then(|r| r.pointer("/ProtocolFeaturesSupported/ExpandQuery").cloned())
            .is_some_and(|q| q["NoLinks"] == true || q["ExpandAll"] == true)
    }
}

async fn handler(State(c): State<Corpus>, method: Method, uri: Uri) -> Response {
    c.requests.fetch_add(1, Ordering::Relaxed);
    if method != Method::GET {
        if !uri.path().contains("/SessionService/Sessions") {
            c.writes.fetch_add(1, Ordering::Relaxed);
        }
        return (StatusCode::METHOD_NOT_ALLOWED, "read-only mockup").into_response();
    }
    let path = strip(uri.path());
    if let Some(raw) = c.opts.raw.get(&path) {
        return ([(header::CONTENT_TYPE, "application/json")], raw.clone()).into_response();
    }
    let Some(mut doc) = c.document(&path) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {"code": "Base.1.8.ResourceMissingAtURI",
                "message": format!("no resource at {path}")}})),
        )
            .into_response();
    };
    let query = uri.query().unwrap_or_default().to_owned();
    let decoded = percent_encoding::percent_decode_str(&query)
        .decode_utf8_lossy()
        .into_owned();
    if path == "/redfish/v1" && c.opts.force_expand {
        doc["ProtocolFeaturesSupported"]["ExpandQuery"] = json!({"ExpandAll": true, "Levels": true, "Links": true, "NoLinks": true, "MaxLevels": 1});
    }
    let expand = (c.opts.expand && (c.opts.force_expand || c.advertises_expand()))
        && decoded.split('&').any(|p| p.starts_with("$expand="));
    if let Some(Value::Array(members)) = doc.get("Members").cloned() {
        let skip = decoded
            .split('&')
            .find_map(|p| p.strip_prefix("$skip="))
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(0);
        let mut page: Vec<Value> = members.clone();
        if let Some(size) = c.opts.page_size {
            page = members.iter().skip(skip).take(size).cloned().collect();
            if skip + size < members.len() {
                let mut next = format!("{path}?$skip={}", skip + size);
                if expand {
                    next.push_str("&$expand=.($levels=1)");
                }
                doc["Members@odata.nextLink"] = Value::String(next);
            }
        }
        if expand {
            page = page
                .into_iter()
                .map(|m| {
                    m.get("@odata.id")
                        .and_then(Value::as_str)
                        .and_then(|id| c.document(id))
                        .unwrap_or(m)
                })
                .collect();
        }
        doc["Members"] = Value::Array(page);
    }
    axum::Json(doc).into_response()
}
