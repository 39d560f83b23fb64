//! The EC2 client: a form of bc-core's [`bc_core::provider::ec2`] POSTed to the pool's endpoint, signed with
//! SigV4 by `aws-sigv4` (the AWS SDK's own signer) with credentials resolved for this one call, over reqwest with
//! rustls; the answer decoded by bc-core. Every call has a deadline; failures are classified for the workflow
//! (transient: unreachable, slow, 5xx, throttled; anything else is the provider's considered refusal).

use bc_core::provider::ec2::{self as codec, Ec2Answer, Form};
use bc_core::provider::workflow::CallError;
use std::time::{Duration, SystemTime};
use zeroize::Zeroizing;

/// A call's deadline (connect, send, answer).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Credentials for one call, wiped when dropped.
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: Zeroizing<String>,
    pub session_token: Option<Zeroizing<String>>,
}

impl Credentials {
    /// Reads the secret's value: `{"access_key_id": "…", "secret_access_key": "…", "session_token": "…"?}`.
    pub fn parse(value: &[u8]) -> Result<Credentials, String> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Wire {
            access_key_id: String,
            secret_access_key: Zeroizing<String>,
            #[serde(default)]
            session_token: Option<Zeroizing<String>>,
        }
        let w: Wire = serde_json::from_slice(value).map_err(|e| {
            format!(
                "the credentials secret must be a JSON object {{\"access_key_id\", \"secret_access_key\"}}: {}",
                // serde's message names the field; it never quotes the value.
                e
            )
        })?;
        if w.access_key_id.is_empty() || w.secret_access_key.is_empty() {
            return Err("the credentials secret has an empty key".into());
        }
        Ok(Credentials {
            access_key_id: w.access_key_id,
            secret_access_key: w.secret_access_key,
            session_token: w.session_token,
        })
    }
}

/// The HTTP side, shared by every call of a process.
#[derive(Clone)]
pub struct Ec2Client {
    http: reqwest::Client,
}

fn err(transient: bool, message: impl Into<String>) -> CallError {
    CallError {
        transient,
        message: message.into(),
    }
}

/// Error codes of EC2 that retrying can fix (throttling and the service's own trouble).
fn transient_code(code: &str) -> bool {
    matches!(
        code,
        "RequestLimitExceeded"
            | "Throttling"
            | "ThrottlingException"
            | "InternalError"
            | "Unavailable"
            | "ServiceUnavailable"
            | "InsufficientInstanceCapacity"
            | "IdempotentParameterMismatch"
    )
}

impl Ec2Client {
    /// A client whose calls wait at most [`CALL_TIMEOUT`].
    pub fn new() -> Result<Ec2Client, String> {
        Ec2Client::with_timeout(CALL_TIMEOUT)
    }

    /// A client whose calls wait at most `timeout`.
    pub fn with_timeout(timeout: Duration) -> Result<Ec2Client, String> {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(c);
        }
        let tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(2))
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|e| format!("building the EC2 HTTP client: {e}"))?;
        Ok(Ec2Client { http })
    }

    /// Signs and sends `form` to `endpoint` in `region`; the decoded answer, an error document made a
    /// [`CallError`].
    pub async fn call(
        &self,
        endpoint: &str,
        region: &str,
        creds: &Credentials,
        form: &Form,
    ) -> Result<Ec2Answer, CallError> {
        let body = form_body(form);
        let host = endpoint
            .split("://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .unwrap_or_default()
            .to_owned();
        let url = format!("{}/", endpoint.trim_end_matches('/'));
        let content_type = "application/x-www-form-urlencoded; charset=utf-8";
        let headers = sign(&url, &host, content_type, body.as_bytes(), region, creds)?;
        let mut req = self
            .http
            .post(&url)
            .header("content-type", content_type)
            .body(body);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        let resp = req.send().await.map_err(|e| {
            err(
                true,
                format!("{}: {}", action(form), bc_error_chain::chain(&e)),
            )
        })?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| err(true, format!("{}: reading the answer: {e}", action(form))))?;
        match codec::decode(&text) {
            Ok(Ec2Answer::Error { code, message }) => Err(err(
                status.is_server_error() || transient_code(&code),
                format!("{}: {code}: {message}", action(form)),
            )),
            Ok(a) if status.is_success() => Ok(a),
            Ok(_) => Err(err(
                status.is_server_error(),
                format!("{}: HTTP {status} without an error document", action(form)),
            )),
            Err(e) => Err(err(
                status.is_server_error() || status.is_success(),
                format!("{}: HTTP {status}, unreadable answer: {e}", action(form)),
            )),
        }
    }
}

fn action(form: &Form) -> &str {
    form.first().map(|(_, v)| v.as_str()).unwrap_or("?")
}

/// `application/x-www-form-urlencoded` of the form (RFC 3986 unreserved characters kept, as SigV4 expects).
pub fn form_body(form: &Form) -> String {
    const SET: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    form.iter()
        .map(|(k, v)| {
            format!(
                "{}={}",
                percent_encoding::utf8_percent_encode(k, SET),
                percent_encoding::utf8_percent_encode(v, SET)
            )
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The SigV4 headers (`authorization`, `x-amz-date`, `x-amz-security-token`) of a POST of `body` to `url`.
fn sign(
    url: &str,
    host: &str,
    content_type: &str,
    body: &[u8],
    region: &str,
    creds: &Credentials,
) -> Result<Vec<(String, String)>, CallError> {
    use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
    use aws_sigv4::sign::v4;
    let identity = aws_credential_types::Credentials::new(
        creds.access_key_id.clone(),
        creds.secret_access_key.as_str().to_owned(),
        creds.session_token.as_ref().map(|t| t.as_str().to_owned()),
        None,
        "bc-secret",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("ec2")
        .time(SystemTime::now())
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| err(false, format!("signing: {e}")))?
        .into();
    let headers = [("host", host), ("content-type", content_type)];
    let signable =
        SignableRequest::new("POST", url, headers.into_iter(), SignableBody::Bytes(body))
            .map_err(|e| err(false, format!("signing: {e}")))?;
    let (instructions, _) = sign(signable, &params)
        .map_err(|e| err(false, format!("signing: {e}")))?
        .into_parts();
    Ok(instructions
        .headers()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_a_json_object_and_errors_never_echo_the_value() {
        let c = Credentials::parse(br#"{"access_key_id": "AKID", "secret_access_key": "s3cr3t"}"#)
            .expect("parse");
        assert_eq!(c.access_key_id, "AKID");
        let e = Credentials::parse(br#"{"access_key_id": "AKID", "secret": "s3cr3t"}"#)
            .err()
            .expect("unknown field");
        assert!(!e.contains("s3cr3t"), "{e}");
        assert!(Credentials::parse(b"s3cr3t").is_err());
    }

    #[test]
    fn a_signed_request_carries_sigv4_headers() {
        let c = Credentials::parse(br#"{"access_key_id": "AKID", "secret_access_key": "s"}"#)
            .expect("parse");
        let body = form_body(&codec::describe_by_tag("inst-1"));
        assert_eq!(
            body,
            "Action=DescribeInstances&Version=2016-11-15&Filter.1.Name=tag%3Abc-instance-id&Filter.1.Value.1=inst-1"
        );
        let h = sign(
            "http://127.0.0.1:1/",
            "127.0.0.1:1",
            "application/x-www-form-urlencoded",
            body.as_bytes(),
            "us-east-1",
            &c,
        )
        .expect("sign");
        let auth = h
            .iter()
            .find(|(k, _)| k == "authorization")
            .map(|(_, v)| v.clone())
            .expect("authorization");
        assert!(
            auth.starts_with("AWS4-HMAC-SHA256 Credential=AKID/"),
            "{auth}"
        );
        assert!(auth.contains("/us-east-1/ec2/aws4_request"), "{auth}");
        assert!(h.iter().any(|(k, _)| k == "x-amz-date"));
    }
}
