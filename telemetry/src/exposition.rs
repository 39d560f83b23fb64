//! The Prometheus text exposition format (version 0.0.4), sans I/O: what the loopback `/metrics` endpoint serves.

use crate::model::Family;
use std::fmt::Write as _;

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn escape_help(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_value(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// A value as Prometheus writes it (`NaN`, `+Inf`, `-Inf`, else the shortest round-trip decimal).
pub fn format_value(v: f64, out: &mut String) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v == f64::INFINITY {
        out.push_str("+Inf");
    } else if v == f64::NEG_INFINITY {
        out.push_str("-Inf");
    } else {
        let _ = write!(out, "{v}");
    }
}

/// Renders families; families sharing a name are written under one HELP/TYPE header.
pub fn render(families: &[Family], out: &mut String) {
    let mut written: Vec<&str> = Vec::new();
    for (i, f) in families.iter().enumerate() {
        if written.contains(&f.name.as_str()) {
            continue;
        }
        written.push(&f.name);
        out.push_str("# HELP ");
        out.push_str(&f.name);
        out.push(' ');
        escape_help(&f.help, out);
        out.push('\n');
        let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind.as_str());
        for same in families[i..].iter().filter(|g| g.name == f.name) {
            for s in &same.series {
                out.push_str(&f.name);
                if !s.labels.is_empty() {
                    out.push('{');
                    for (j, (n, v)) in s.labels.iter().enumerate() {
                        if j > 0 {
                            out.push(',');
                        }
                        out.push_str(n);
                        out.push_str("=\"");
                        escape_value(v, out);
                        out.push('"');
                    }
                    out.push('}');
                }
                out.push(' ');
                format_value(s.value, out);
                out.push('\n');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Kind, Labels};

    #[test]
    fn renders_help_type_and_escaped_labels() {
        let f = Family::new(
            "DCGM_FI_DEV_GPU_TEMP",
            Kind::Gauge,
            "Cel",
            "GPU temperature (in C).",
        )
        .with(
            Labels::new()
                .with("gpu", "0")
                .with("modelName", "H\"100\"\n"),
            34.0,
        )
        .with(Labels::new().with("gpu", "1"), f64::NAN);
        let mut out = String::new();
        render(&[f], &mut out);
        assert_eq!(
            out,
            "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n\
             DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",modelName=\"H\\\"100\\\"\\n\"} 34\n\
             DCGM_FI_DEV_GPU_TEMP{gpu=\"1\"} NaN\n"
        );
    }
}
