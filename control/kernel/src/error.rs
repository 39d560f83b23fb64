//! Error codes and the errors the kernel answers with: [`ApiCode`] (stable codes), [`ApiError`] (`{code,
//! message}` on the wire, the cause kept for the log) and [`InvalidConfig`] (what `build()` refuses).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
pub use bc_core::api::{ApiCode, Coded};
use std::fmt;

/// The HTTP status a code answers with (unless the error names a more precise one).
pub fn http_status(code: ApiCode) -> StatusCode {
    match code {
        ApiCode::InvalidArgument | ApiCode::InvalidConfig => StatusCode::BAD_REQUEST,
        ApiCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ApiCode::AccessDenied => StatusCode::FORBIDDEN,
        ApiCode::NotFound => StatusCode::NOT_FOUND,
        ApiCode::Conflict | ApiCode::FailedPrecondition => StatusCode::CONFLICT,
        ApiCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// An error the API answers with: a stable [`ApiCode`] and a message that tells the caller what to do next. The
/// cause, when there is one, stays on this side (it is logged, never sent).
#[derive(Debug)]
pub struct ApiError {
    code: ApiCode,
    message: String,
    /// A more precise HTTP status than the code's own (405, 413, 415).
    status: Option<StatusCode>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ApiError {
    pub fn new(code: ApiCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
            status: None,
            source: None,
        }
    }

    pub fn code(&self) -> ApiCode {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// Answers with `status` instead of the code's own.
    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = Some(status);
        self
    }

    /// Keeps `source` as the cause (logged with the error, never sent).
    pub fn with_source(
        mut self,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> ApiError {
        self.source = Some(Box::new(source));
        self
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiCode::InvalidArgument, message)
    }

    pub fn denied(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiCode::AccessDenied, message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiCode::NotFound, message)
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiCode::Conflict, message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiCode::Unavailable, message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> ApiError {
        ApiError::new(ApiCode::Unauthenticated, message)
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ApiError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A library error that names its code ([`Coded`]: the store's errors do) becomes the API's error with `?`: the
/// caller reads its public message; the cause of an UNAVAILABLE one is kept for the log.
impl<E> From<E> for ApiError
where
    E: Coded + std::error::Error + Send + Sync + 'static,
{
    fn from(e: E) -> ApiError {
        let code = e.api_code();
        let error = ApiError::new(code, e.public_message());
        if code == ApiCode::Unavailable {
            error.with_source(e)
        } else {
            error
        }
    }
}

#[derive(serde::Serialize)]
struct Wire<'a> {
    code: ApiCode,
    message: &'a str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status.unwrap_or_else(|| http_status(self.code));
        if let Some(source) = &self.source {
            let source: &(dyn std::error::Error + 'static) = source.as_ref();
            tracing::error!(code = %self.code, message = self.message, source = %bc_error_chain::InlineErrorChain::new(source), "request failed");
        }
        (
            status,
            axum::Json(Wire {
                code: self.code,
                message: &self.message,
            }),
        )
            .into_response()
    }
}

/// What `ControlPlane::builder(..).build()` refuses: the option (or the module and item) and why. Its code is
/// INVALID_CONFIG.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("INVALID_CONFIG: {field}: {reason}")]
pub struct InvalidConfig {
    /// The option (`shard_lease`, `capacity.placer`) or the registration (`module nodes`, `plugin demo`).
    pub field: String,
    pub reason: String,
}

impl InvalidConfig {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> InvalidConfig {
        InvalidConfig {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn code(&self) -> ApiCode {
        ApiCode::InvalidConfig
    }
}

impl Coded for InvalidConfig {
    fn api_code(&self) -> ApiCode {
        ApiCode::InvalidConfig
    }

    fn public_message(&self) -> String {
        format!("{}: {}", self.field, self.reason)
    }
}
