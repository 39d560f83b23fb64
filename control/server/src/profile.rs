//! The CLI's named contexts (like kubectl's kubeconfig): which control plane and which API key, so an operator
//! with several fleets or roles does not pass `--api-url` and `--api-key` on every command.
//!
//! ```toml
//! # ~/.config/better-compute/config.toml (or $BC_CONFIG)
//! current = "lab"
//!
//! [contexts.lab]
//! api_url = "http://127.0.0.1:7080"
//! api_key_file = "/root/.config/better-compute/lab.key"   # or api_key = "bcak_…" (the file is safer)
//! ```
//!
//! What wins: the flag, then its environment variable (`BC_API_URL`, `BC_API_KEY`), then the context
//! (`--context`, `BC_CONTEXT`, else `current`), then the default URL `http://127.0.0.1:7080`.

use anyhow::Context as _;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The API URL when nothing names one.
pub const DEFAULT_API_URL: &str = "http://127.0.0.1:7080";

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFile {
    pub current: Option<String>,
    #[serde(default)]
    pub contexts: BTreeMap<String, Context>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Context {
    pub api_url: Option<String>,
    pub api_key: Option<String>,
    pub api_key_file: Option<PathBuf>,
}

/// Where the profile file is: `$BC_CONFIG`, else `$XDG_CONFIG_HOME/better-compute/config.toml`, else
/// `~/.config/better-compute/config.toml`.
pub fn default_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("BC_CONFIG").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    Some(base.join("better-compute/config.toml"))
}

/// The URL and key a command uses.
#[derive(Debug, PartialEq, Eq)]
pub struct Resolved {
    pub api_url: String,
    pub api_key: String,
}

/// Resolves the URL and key from the flags (their environment variables already folded in by clap), the
/// context and the file at `path` (absent is fine unless a context is named).
pub fn resolve(
    api_url: Option<String>,
    api_key: Option<String>,
    context: Option<&str>,
    path: Option<&Path>,
) -> anyhow::Result<Resolved> {
    let file = match path {
        Some(p) if p.exists() => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading the CLI profile {}", p.display()))?;
            toml::from_str::<ProfileFile>(&text).with_context(|| {
                format!(
                    "the CLI profile {} is not valid (see `better-compute --help` for its form)",
                    p.display()
                )
            })?
        }
        _ => ProfileFile::default(),
    };
    let shown = || {
        path.map(|p| p.display().to_string())
            .unwrap_or_else(|| "(no profile path: set BC_CONFIG or HOME)".into())
    };
    let named = context.map(str::to_string).or(file.current.clone());
    let ctx = match &named {
        None => None,
        Some(name) => Some(file.contexts.get(name).with_context(|| {
            let known: Vec<&str> = file.contexts.keys().map(String::as_str).collect();
            format!(
                "no context {name:?} in the CLI profile {} (it has: {})",
                shown(),
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            )
        })?),
    };
    let api_url = api_url
        .or_else(|| ctx.and_then(|c| c.api_url.clone()))
        .unwrap_or_else(|| DEFAULT_API_URL.to_string());
    let from_context = match ctx {
        Some(Context {
            api_key: Some(k), ..
        }) => Some(k.clone()),
        Some(Context {
            api_key_file: Some(f),
            ..
        }) => Some(
            std::fs::read_to_string(f)
                .with_context(|| {
                    format!(
                        "reading the API key file {} of context {:?}",
                        f.display(),
                        named.as_deref().unwrap_or_default()
                    )
                })?
                .trim()
                .to_string(),
        ),
        _ => None,
    };
    let api_key = api_key.or(from_context).with_context(|| {
        format!(
            "no API key: give --api-key, set BC_API_KEY, or use a context with api_key_file in {}",
            shown()
        )
    })?;
    Ok(Resolved { api_url, api_key })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_then_the_context_then_the_default() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = dir.path().join("lab.key");
        std::fs::write(&key, "bcak_lab\n").expect("key");
        let path = dir.path().join("config.toml");
        std::fs::write(
            &path,
            format!(
                "current = \"lab\"\n[contexts.lab]\napi_url = \"http://lab:7080\"\napi_key_file = {key:?}\n\
                 [contexts.prod]\napi_url = \"https://prod\"\napi_key = \"bcak_prod\"\n"
            ),
        )
        .expect("profile");
        let r = |url: Option<&str>, k: Option<&str>, ctx: Option<&str>| {
            resolve(url.map(Into::into), k.map(Into::into), ctx, Some(&path))
        };
        assert_eq!(
            r(None, None, None).expect("current"),
            Resolved {
                api_url: "http://lab:7080".into(),
                api_key: "bcak_lab".into()
            }
        );
        assert_eq!(
            r(None, None, Some("prod")).expect("named").api_key,
            "bcak_prod"
        );
        assert_eq!(
            r(Some("http://x"), Some("bcak_flag"), Some("prod")).expect("flags"),
            Resolved {
                api_url: "http://x".into(),
                api_key: "bcak_flag".into()
            }
        );
        let err = format!("{:#}", r(None, None, Some("staging")).expect_err("unknown"));
        assert!(
            err.contains("no context \"staging\"") && err.contains("lab, prod"),
            "{err}"
        );
        // No file, no flags: the default URL, and the missing key named with its three sources.
        let none = resolve(None, None, None, Some(&dir.path().join("absent.toml")));
        let err = format!("{:#}", none.expect_err("no key"));
        assert!(
            err.contains("--api-key") && err.contains("BC_API_KEY"),
            "{err}"
        );
        std::fs::write(&path, "[contexts.x]\napi_uri = \"typo\"\n").expect("profile");
        let err = format!("{:#}", r(None, None, None).expect_err("typo"));
        assert!(
            err.contains("api_uri") || err.contains("unknown field"),
            "{err}"
        );
    }
}
