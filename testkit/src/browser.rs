//! Debian's chromium, headless, driven over the W3C WebDriver protocol by Debian's chromedriver (feature `browser`):
//! started on a free loopback port with a new empty profile, every background network feature off, ended by
//! [`Browser::close`] or, failing that, killed on drop with every process it started.
//! Enough of the protocol for a page test: open a URL, type, click, run a script, take a screenshot.

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where scripts/setup's Debian packages put them.
pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// The W3C name of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one browser session. [`Browser::close`] ends the session (chromium quits) and the
/// driver; dropping it without that kills the driver's whole process group, chromium's processes included.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Killing chromedriver alone leaves its chromium running (reparented to init, ~450 MiB and some CPU after
        // every test run, as found on 2026-12-04). The driver leads its own process group, which chromium and its
        // zygotes inherit: kill the group. (DELETE of the session, `close`, needs a runtime a drop does not have.)
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Why a browser test cannot run here, if it cannot.
pub fn missing() -> Option<String> {
    [CHROMIUM, CHROMEDRIVER]
        .iter()
        .find(|p| !Path::new(p).exists())
        .map(|p| format!("no {p} (scripts/setup installs Debian's chromium and chromium-driver)"))
}

impl Browser {
    /// Starts chromedriver and a headless chromium `width`×`height`.
    pub async fn start(width: u32, height: u32) -> Result<Browser> {
        let port = crate::free_port()?;
        let profile = tempfile::tempdir()?;
        // Before the driver starts: nothing between its spawn and `Browser`'s drop may fail or panic.
        let http = reqwest::Client::new();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            // Its own process group, inherited by the chromium it starts: the drop kills them together.
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting chromedriver")?;
        let mut b = Browser {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            session: String::new(),
            http,
            _profile: profile,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = b.http.get(format!("{}/status", b.base)).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == true
            {
                break;
            }
            if Instant::now() > deadline {
                bail!("chromedriver not ready after 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let args = [
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            "--hide-scrollbars".into(),
            format!("--window-size={width},{height}"),
            format!("--user-data-dir={}", b._profile.path().display()),
        ];
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": { "binary": CHROMIUM, "args": args },
        }}});
        let v = b.send("POST", "/session", Some(caps)).await?;
        b.session = v["sessionId"]
            .as_str()
            .context("no sessionId in the new session's answer")?
            .to_string();
        Ok(b)
    }

    async fn send(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let url = format!("{}{path}", self.base);
        let req = match method {
            "GET" => self.http.get(url),
            "DELETE" => self.http.delete(url),
            _ => self.http.post(url).json(&body.unwrap_or_else(|| json!({}))),
        };
        let v: Value = req
            .timeout(Duration::from_secs(60))
            .send()
            .await?
            .json()
            .await?;
        if let Some(e) = v["value"]["error"].as_str() {
            bail!("WebDriver {method} {path}: {e}: {}", v["value"]["message"]);
        }
        Ok(v["value"].clone())
    }

    fn at(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Ends the session (chromium quits, its profile released) and then the driver (on drop).
    pub async fn close(self) -> Result<()> {
        self.send("DELETE", &self.at(""), None).await.map(drop)
    }

    pub async fn open(&self, url: &str) -> Result<()> {
        self.send("POST", &self.at("/url"), Some(json!({ "url": url })))
            .await
            .map(drop)
    }

    async fn element(&self, css: &str) -> Result<String> {
        let v = self
            .send(
                "POST",
                &self.at("/element"),
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await?;
        match v[ELEMENT].as_str() {
            Some(id) => Ok(id.to_string()),
            None => bail!("no element {css:?} (WebDriver answered {v})"),
        }
    }

    pub async fn type_into(&self, css: &str, text: &str) -> Result<()> {
        let e = self.element(css).await?;
        self.send(
            "POST",
            &self.at(&format!("/element/{e}/value")),
            Some(json!({ "text": text })),
        )
        .await
        .map(drop)
    }

    pub async fn click(&self, css: &str) -> Result<()> {
        let e = self.element(css).await?;
        self.send("POST", &self.at(&format!("/element/{e}/click")), None)
            .await
            .map(drop)
    }

    /// Runs `script` (a function body; `return` gives the answer) in the page.
    pub async fn eval(&self, script: &str) -> Result<Value> {
        self.send(
            "POST",
            &self.at("/execute/sync"),
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// Polls `script` until it returns something other than null or false, or fails after `secs`.
    pub async fn wait_for(&self, script: &str, secs: u64) -> Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.eval(script).await?;
            if !v.is_null() && v != false {
                return Ok(v);
            }
            if Instant::now() > deadline {
                bail!("after {secs} s the page still answers {v} to: {script}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The viewport as PNG.
    pub async fn screenshot(&self) -> Result<Vec<u8>> {
        use base64::Engine as _;
        let v = self.send("GET", &self.at("/screenshot"), None).await?;
        Ok(base64::engine::general_purpose::STANDARD
            .decode(v.as_str().context("no screenshot")?)?)
    }
}
