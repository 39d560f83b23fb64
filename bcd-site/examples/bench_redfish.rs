//! Redfish benchmark: requests and wall time per `inspect` for each tree of the corpus (tests/redfish-corpus/),
//! served by the corpus test server on loopback, read by our client without and with `$expand` (where the tree's
//! service root advertises it), and by sushy (the peer: OpenStack Ironic's Redfish library, in a venv; see
//! scripts/bench-redfish) reading the same tree in the same run. Requests are counted by the server, login and
//! logout attempts included. Wall time is the median of `--rounds` runs. Ends with
//! `redfish: <n> requests per inspect median` (ours, with `$expand` where offered, median over the trees).
//!
//! usage: bench_redfish [--rounds N] [--sushy-python PATH]   (without --sushy-python the peer column is empty)

#[path = "../tests/common/corpus.rs"]
mod corpus;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bcd_site::redfish::{Bmc, BmcOptions, Credentials};
use corpus::{CorpusOptions, serve_corpus};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

async fn ours(url: &str, expand: bool) -> Result<(Duration, bool)> {
    let opts = BmcOptions {
        use_expand: expand,
        ..BmcOptions::default()
    };
    let t = Instant::now();
    let bmc = Bmc::connect(
        url,
        Credentials {
            username: "admin".into(),
            password: "secret".into(),
        },
        opts,
    )
    .await?;
    let used = bmc.expand().is_some();
    let inv = bmc.inventory().await?;
    bmc.close().await?;
    std::hint::black_box(inv);
    Ok((t.elapsed(), used))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let rounds: usize = arg("--rounds")
        .map_or(Ok(5), |r| r.parse())
        .context("--rounds")?;
    let sushy = arg("--sushy-python");
    let peer_script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/bench_redfish_sushy.py");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/redfish-corpus");
    let mut trees: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("expected.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    trees.sort();
    println!(
        "{:<24} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}",
        "tree", "req", "ms", "req $exp", "ms $exp", "sushy req", "sushy ms"
    );
    let mut per_inspect = Vec::new();
    let mut ratios = Vec::new();
    for tree in &trees {
        let srv = serve_corpus(
            dir.join(tree),
            CorpusOptions {
                expand: true,
                ..CorpusOptions::default()
            },
        )
        .await?;
        let mut cols = Vec::new();
        let mut ours_expanded_requests = 0;
        for expand in [false, true] {
            let mut times = Vec::new();
            let mut requests = 0;
            let mut used = false;
            for _ in 0..rounds {
                srv.reset_requests();
                let (t, u) = ours(&srv.url, expand).await?;
                used = u;
                times.push(t.as_secs_f64() * 1000.0);
                requests = srv.requests();
            }
            if expand {
                ours_expanded_requests = requests;
            }
            cols.push(if expand && !used {
                ("-".to_owned(), "-".to_owned())
            } else {
                (requests.to_string(), format!("{:.1}", median(times)))
            });
        }
        per_inspect.push(ours_expanded_requests as f64);
        let peer = match &sushy {
            Some(py) => {
                let mut times = Vec::new();
                let mut requests = 0;
                for _ in 0..rounds {
                    srv.reset_requests();
                    let out = tokio::process::Command::new(py)
                        .arg(&peer_script)
                        .arg(&srv.url)
                        .output()
                        .await?;
                    anyhow::ensure!(
                        out.status.success(),
                        "sushy on {tree}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
                    times.push(v["seconds"].as_f64().unwrap_or(0.0) * 1000.0);
                    requests = srv.requests();
                }
                ratios.push(requests as f64 / ours_expanded_requests.max(1) as f64);
                (requests.to_string(), format!("{:.1}", median(times)))
            }
            None => ("-".to_owned(), "-".to_owned()),
        };
        println!(
            "{:<24} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9}",
            tree, cols[0].0, cols[0].1, cols[1].0, cols[1].1, peer.0, peer.1
        );
    }
    if !ratios.is_empty() {
        println!(
            "sushy requests / ours (with $expand where offered), median over trees: {:.2}",
            median(ratios)
        );
    }
    println!(
        "redfish: {} requests per inspect median",
        median(per_inspect)
    );
    Ok(())
}
