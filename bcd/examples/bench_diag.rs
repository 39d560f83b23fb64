//! diag.nvml benchmark: the whole acceptance check on an 8-GPU fixture (re-read the JSON file, build the health of
//! every GPU, run every check, encode the report as JSON), many times; prints min/median/p90/max of each phase and
//! ends with `diag-nvml: <median ms> ms` (goal: under 1 s on the fixture; DESIGN.md allows 5 s on a real 8-GPU
//! node). `--backend nvml` measures the real NVML path instead where a driver is present.
//!
//! Usage: bench_diag [--runs N (500)] [--gpus N (8)] [--backend fixture|nvml]

use anyhow::{Context, Result, bail};
use bcd::diag::{self, DiagPolicy};
use bcd::gpu::fault::Fault;
use bcd::gpu::fixture::{self, FixtureBackend};
use bcd::gpu::{GpuBackend, GpuHealth};
use std::time::{Duration, Instant};

struct Args {
    runs: usize,
    gpus: u32,
    backend: String,
}

fn args() -> Result<Args> {
    let mut a = Args {
        runs: 500,
        gpus: 8,
        backend: "fixture".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--runs" => a.runs = value()?.parse().context("--runs")?,
            "--gpus" => a.gpus = value()?.parse().context("--gpus")?,
            "--backend" => a.backend = value()?,
            other => bail!("unknown argument {other:?} (see the header of bench_diag.rs)"),
        }
    }
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    Ok(a)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Prints min/median/p90/max and returns the median.
fn summary(label: &str, samples: &mut [Duration]) -> Duration {
    samples.sort();
    let pick = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    let median = pick(0.5);
    println!(
        "{label:<30} min {:>8.3} ms  median {:>8.3} ms  p90 {:>8.3} ms  max {:>8.3} ms",
        ms(pick(0.0)),
        ms(median),
        ms(pick(0.9)),
        ms(pick(1.0))
    );
    median
}

fn open(a: &Args, dir: &std::path::Path) -> Result<Box<dyn GpuBackend>> {
    match a.backend.as_str() {
        "fixture" => {
            let path = dir.join("gpus.json");
            let mut f = fixture::parse(&fixture::synthetic(a.gpus, "bench"))?;
            // One faulty GPU, so the failure path (reasons) is part of what is measured.
            f.set_faults(
                a.gpus.saturating_sub(1),
                vec![Fault::Dbe(1), Fault::Xid(79)],
            );
            std::fs::write(&path, serde_json::to_vec_pretty(&f)?)?;
            Ok(Box::new(FixtureBackend::load(&path)?))
        }
        #[cfg(feature = "nvml")]
        "nvml" => Ok(Box::new(bcd::gpu::nvml::NvmlBackend::init()?)),
        other => bail!("unknown backend {other:?} (fixture, nvml)"),
    }
}

fn main() -> Result<()> {
    let a = args()?;
    let dir = tempfile::tempdir()?;
    let backend = open(&a, dir.path())?;
    let expected = u32::try_from(backend.gpus()?.len())?;
    let policy = DiagPolicy::new(expected);

    // Warm-up (page cache, allocator).
    for _ in 0..a.runs.min(20) {
        diag::run(backend.as_ref(), &policy).to_json()?;
    }
    let mut query = Vec::with_capacity(a.runs);
    let mut checks = Vec::with_capacity(a.runs);
    let mut end_to_end = Vec::with_capacity(a.runs);
    let mut last_len = 0;
    let mut last_status = diag::Status::Pass;
    for _ in 0..a.runs {
        let t = Instant::now();
        let health: Vec<GpuHealth> = backend.health()?;
        query.push(t.elapsed());
        let t = Instant::now();
        std::hint::black_box(diag::check_with_backend(backend.name(), &health, &policy));
        checks.push(t.elapsed());

        let t = Instant::now();
        let report = diag::run(backend.as_ref(), &policy);
        let json = report.to_json()?;
        end_to_end.push(t.elapsed());
        last_len = json.len();
        last_status = report.status;
    }
    println!(
        "diag.nvml on {} GPUs ({} backend), {} runs; report {} checks, {} bytes of JSON, status {:?}",
        expected,
        backend.name(),
        a.runs,
        1 + expected * 14,
        last_len,
        last_status
    );
    summary("backend query (health)", &mut query);
    summary("checks (pure)", &mut checks);
    let median = summary("end to end (query+check+json)", &mut end_to_end);
    let goal = Duration::from_secs(1);
    println!(
        "goal < {:.0} ms: {:.0}x headroom",
        ms(goal),
        goal.as_secs_f64() / median.as_secs_f64().max(1e-9)
    );
    println!("diag-nvml: {:.3} ms", ms(median));
    Ok(())
}
