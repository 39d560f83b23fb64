//! The rules of `diag.nvml`, one function per check. Each takes one GPU's health and the policy and returns a
//! [`CheckResult`] with the observed value and the threshold. A reading that is absent (not supported, not
//! collected) makes the check skip with that reason; a reading whose query failed makes it fail.

use super::{Check, CheckResult, DiagPolicy, GpuRef, MigExpectation, Status};
use crate::gpu::health::{GpuHealth, Reading, throttle, throttle_reason_names};

/// Every check, node-level first, then per GPU in index order.
pub fn all(gpus: &[GpuHealth], policy: &DiagPolicy) -> Vec<CheckResult> {
    let mut out = Vec::with_capacity(1 + gpus.len() * 14);
    out.push(device_count(gpus.len(), policy));
    let mut sorted: Vec<&GpuHealth> = gpus.iter().collect();
    sorted.sort_by_key(|g| g.index);
    for g in sorted {
        out.extend([
            retired_pages_pending(g),
            row_remap_pending(g),
            row_remap_failure(g),
            volatile_dbe(g),
            retired_pages(g, policy),
            pcie_gen(g, policy),
            pcie_width(g, policy),
            throttle_reasons(g, policy),
            xid(g, policy),
            persistence_mode(g, policy),
            mig(g, policy),
            nvlink(g, policy),
            temperature(g, policy),
            power(g, policy),
        ]);
    }
    out
}

/// Builds results for one GPU and one check.
struct Judge<'a> {
    gpu: &'a GpuHealth,
    check: Check,
    threshold: String,
}

impl Judge<'_> {
    fn new(gpu: &GpuHealth, check: Check, threshold: impl Into<String>) -> Judge<'_> {
        Judge {
            gpu,
            check,
            threshold: threshold.into(),
        }
    }

    fn result(self, status: Status, observed: String, detail: Option<String>) -> CheckResult {
        let reason = detail.map(|d| {
            format!(
                "GPU {} ({}): {}: {d} (threshold: {})",
                self.gpu.index, self.gpu.uuid, self.check, self.threshold
            )
        });
        CheckResult {
            check: self.check,
            gpu: Some(GpuRef {
                index: self.gpu.index,
                uuid: self.gpu.uuid.clone(),
            }),
            status,
            observed,
            threshold: self.threshold,
            reason,
        }
    }

    fn pass(self, observed: String) -> CheckResult {
        self.result(Status::Pass, observed, None)
    }

    fn fail(self, observed: String) -> CheckResult {
        let detail = observed.clone();
        self.result(Status::Fail, observed, Some(detail))
    }

    fn skip(self, observed: String, why: String) -> CheckResult {
        self.result(Status::Skip, observed, Some(why))
    }

    /// Skip (absent) or fail (query error) for a reading without a value.
    fn absent<T>(self, r: &Reading<T>) -> CheckResult {
        let why = r.absence().unwrap_or_default();
        match r {
            Reading::Error(_) => self.result(Status::Fail, why.clone(), Some(why)),
            _ => self.skip(why.clone(), why),
        }
    }

    /// Pass when `ok(value)`, else fail; `show` renders the observed value.
    fn judge<T>(
        self,
        r: &Reading<T>,
        ok: impl FnOnce(&T) -> bool,
        show: impl FnOnce(&T) -> String,
    ) -> CheckResult {
        match r.value() {
            Some(v) if ok(v) => self.pass(show(v)),
            Some(v) => self.fail(show(v)),
            None => self.absent(r),
        }
    }
}

pub fn device_count(observed: usize, policy: &DiagPolicy) -> CheckResult {
    let expected = policy.expected_gpu_count as usize;
    let ok = observed == expected;
    CheckResult {
        check: Check::DeviceCount,
        gpu: None,
        status: if ok { Status::Pass } else { Status::Fail },
        observed: format!("{observed} GPUs"),
        threshold: format!("{expected} GPUs"),
        reason: (!ok)
            .then(|| format!("device_count: {observed} GPUs visible, {expected} expected")),
    }
}

fn retired_pages_pending(g: &GpuHealth) -> CheckResult {
    Judge::new(g, Check::RetiredPagesPending, "no page pending retirement").judge(
        &g.retired_pages_pending,
        |p| !p,
        |p| {
            if *p {
                "pages pending retirement".into()
            } else {
                "none pending".into()
            }
        },
    )
}

fn row_remap_pending(g: &GpuHealth) -> CheckResult {
    Judge::new(g, Check::RowRemapPending, "no row remap pending").judge(
        &g.row_remap,
        |r| !r.pending,
        |r| {
            if r.pending {
                format!(
                    "row remap pending (reset needed; {} uncorrectable rows)",
                    r.uncorrectable
                )
            } else {
                "none pending".into()
            }
        },
    )
}

fn row_remap_failure(g: &GpuHealth) -> CheckResult {
    Judge::new(g, Check::RowRemapFailure, "no failed row remap").judge(
        &g.row_remap,
        |r| !r.failure,
        |r| {
            if r.failure {
                "row remap failed".into()
            } else {
                "no failure".into()
            }
        },
    )
}

fn volatile_dbe(g: &GpuHealth) -> CheckResult {
    let aggregate = match &g.ecc_dbe_aggregate {
        Reading::Value(a) => format!(" ({a} aggregate)"),
        _ => String::new(),
    };
    Judge::new(g, Check::VolatileDbe, "0 volatile double-bit ECC errors").judge(
        &g.ecc_dbe_volatile,
        |n| *n == 0,
        |n| format!("{n} volatile double-bit ECC errors{aggregate}"),
    )
}

fn retired_pages(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let limit = policy.retired_pages_fail_at;
    Judge::new(
        g,
        Check::RetiredPages,
        format!("fewer than {limit} retired pages"),
    )
    .judge(
        &g.retired_pages,
        |r| r.total() < limit,
        |r| {
            format!(
                "{} retired pages ({} single-bit, {} double-bit)",
                r.total(),
                r.sbe,
                r.dbe
            )
        },
    )
}

fn pcie_gen(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let threshold = match policy.pcie_min_gen {
        Some(min) => format!("gen current = max, max >= {min}"),
        None => "gen current = max".to_string(),
    };
    let j = Judge::new(g, Check::PcieGen, threshold);
    let Some(p) = g.pcie.value() else {
        return j.absent(&g.pcie);
    };
    let observed = format!("gen {} of max {}", p.gen_current, p.gen_max);
    if policy.pcie_min_gen.is_some_and(|min| p.gen_max < min) {
        return j.fail(observed);
    }
    if p.gen_current >= p.gen_max {
        return j.pass(observed);
    }
    // An idle GPU lowers its link generation to save power; the width does not change.
    match g.throttle_reasons.value() {
        Some(bits) if bits & throttle::GPU_IDLE != 0 => {
            let why = format!(
                "{observed} while the GPU is idle (power-saving downshift); re-check under load"
            );
            j.skip(observed, why)
        }
        _ => j.fail(observed),
    }
}

fn pcie_width(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let threshold = match policy.pcie_min_width {
        Some(min) => format!("width current = max, max >= x{min}"),
        None => "width current = max".to_string(),
    };
    Judge::new(g, Check::PcieWidth, threshold).judge(
        &g.pcie,
        |p| {
            p.width_current >= p.width_max
                && policy.pcie_min_width.is_none_or(|min| p.width_max >= min)
        },
        |p| format!("x{} of max x{}", p.width_current, p.width_max),
    )
}

fn throttle_reasons(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let ignored = throttle::GPU_IDLE | policy.throttle_ignore_mask;
    let mut allowed = throttle_reason_names(ignored).join(", ");
    if allowed.is_empty() {
        allowed = "none".into();
    }
    Judge::new(
        g,
        Check::Throttle,
        format!("no throttle reason but {allowed}"),
    )
    .judge(
        &g.throttle_reasons,
        |bits| bits & !ignored == 0,
        |bits| {
            let names = throttle_reason_names(*bits);
            if names.is_empty() {
                "none".into()
            } else {
                format!("{} ({bits:#x})", names.join(", "))
            }
        },
    )
}

fn xid(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let list: Vec<String> = policy.fail_xids.iter().map(u64::to_string).collect();
    Judge::new(g, Check::Xid, format!("no XID of {}", list.join(", "))).judge(
        &g.xid_errors,
        |xids| !xids.iter().any(|x| policy.fail_xids.contains(x)),
        |xids| {
            if xids.is_empty() {
                "no XID errors".into()
            } else {
                let seen: Vec<String> = xids.iter().map(u64::to_string).collect();
                format!("XID {}", seen.join(", "))
            }
        },
    )
}

fn persistence_mode(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let j = Judge::new(g, Check::PersistenceMode, "enabled");
    if !policy.require_persistence_mode {
        let observed = match g.persistence_mode.value() {
            Some(on) => on_off(*on),
            None => g.persistence_mode.absence().unwrap_or_default(),
        };
        return j.skip(
            observed,
            "the policy does not require persistence mode".into(),
        );
    }
    j.judge(&g.persistence_mode, |on| *on, |on| on_off(*on))
}

fn on_off(on: bool) -> String {
    if on {
        "enabled".into()
    } else {
        "disabled".into()
    }
}

fn mig(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let threshold = match &policy.mig {
        MigExpectation::Disabled => "MIG disabled".to_string(),
        MigExpectation::Enabled { layout } if layout.is_empty() => {
            "MIG enabled, any layout".to_string()
        }
        MigExpectation::Enabled { layout } => {
            format!("MIG enabled with [{}]", sorted(layout).join(", "))
        }
        MigExpectation::Any => "any MIG mode".to_string(),
    };
    Judge::new(g, Check::Mig, threshold).judge(
        &g.mig,
        |m| {
            let settled = m.enabled == m.pending_enabled;
            match &policy.mig {
                MigExpectation::Disabled => !m.enabled && settled,
                MigExpectation::Enabled { layout } => {
                    m.enabled
                        && settled
                        && (layout.is_empty() || sorted(layout) == sorted(&m.layout))
                }
                MigExpectation::Any => true,
            }
        },
        |m| {
            let mut s = if m.enabled {
                format!("MIG enabled with [{}]", sorted(&m.layout).join(", "))
            } else {
                "MIG disabled".to_string()
            };
            if m.enabled != m.pending_enabled {
                s.push_str(&format!(
                    ", {} after reset",
                    if m.pending_enabled {
                        "enabled"
                    } else {
                        "disabled"
                    }
                ));
            }
            s
        },
    )
}

fn sorted(v: &[String]) -> Vec<String> {
    let mut v = v.to_vec();
    v.sort();
    v
}

fn nvlink(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let j = Judge::new(g, Check::Nvlink, "all links active");
    if !policy.require_nvlink_up {
        return j.skip(
            "not judged".into(),
            "the policy does not require NVLink".into(),
        );
    }
    j.judge(
        &g.nvlink,
        |links| links.iter().all(|l| l.active),
        |links| {
            let up = links.iter().filter(|l| l.active).count();
            let down: Vec<String> = links
                .iter()
                .filter(|l| !l.active)
                .map(|l| l.link.to_string())
                .collect();
            if down.is_empty() {
                format!("{up}/{} links active", links.len())
            } else {
                format!(
                    "{up}/{} links active; down: {}",
                    links.len(),
                    down.join(", ")
                )
            }
        },
    )
}

fn temperature(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let margin = policy.temperature_margin_c;
    let slowdown = g.temperature_slowdown_c.value().copied();
    let threshold = match (slowdown, margin) {
        (Some(s), 0) => format!("below slowdown {s} °C"),
        (Some(s), m) => format!("below slowdown {s} °C - {m} °C"),
        (None, _) => "below slowdown".to_string(),
    };
    let j = Judge::new(g, Check::Temperature, threshold);
    let Some(limit) = slowdown else {
        return j.absent(&g.temperature_slowdown_c);
    };
    j.judge(
        &g.temperature_c,
        |t| t.saturating_add(margin) < limit,
        |t| format!("{t} °C"),
    )
}

fn power(g: &GpuHealth, policy: &DiagPolicy) -> CheckResult {
    let tol = policy.power_tolerance_pct;
    let limit = g.power_limit_mw.value().copied();
    let allowed = limit.map(|l| u64::from(l) * (100 + u64::from(tol)) / 100);
    let threshold = match limit {
        Some(l) => format!("at most limit {:.1} W + {tol}%", f64::from(l) / 1000.0),
        None => "within the enforced limit".to_string(),
    };
    let j = Judge::new(g, Check::Power, threshold);
    let Some(allowed) = allowed else {
        return j.absent(&g.power_limit_mw);
    };
    j.judge(
        &g.power_draw_mw,
        |d| u64::from(*d) <= allowed,
        |d| format!("{:.1} W", f64::from(*d) / 1000.0),
    )
}
