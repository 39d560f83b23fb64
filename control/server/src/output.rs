//! How the CLI prints what it read: `-o table` (the default: a header, aligned columns, times as an AGE),
//! `-o wide` (more columns), `-o json` and `-o yaml` (the API's answer itself, for scripts).
//!
//! In JSON and YAML the API's epoch-millisecond instants (`created_at_ms: 1764614400000`) are printed as RFC 3339
//! (`created_at: "2026-12-01T18:40:00.000Z"`): a key ending in `_ms` whose value is an integer at or after
//! 2000-01-01 is an instant (no duration in the API comes near 30 years), and loses its `_ms`. Everything else is
//! printed as the API sent it.

use serde::Serialize;
use serde_json::Value;

/// `-o`: how a read prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    #[default]
    Table,
    Wide,
    Json,
    Yaml,
}

/// 2000-01-01T00:00:00Z in Unix milliseconds: an `_ms` integer at or after it is an instant.
const INSTANTS_FROM_MS: i64 = 946_684_800_000;

/// A table for `-o table|wide`: columns in order, some only in wide.
#[derive(Default)]
pub struct Table {
    columns: Vec<(&'static str, bool)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these columns, shown in both table and wide.
    pub fn new(columns: &[&'static str]) -> Table {
        Table {
            columns: columns.iter().map(|c| (*c, false)).collect(),
            rows: Vec::new(),
        }
    }

    /// More columns, after the others, shown only with `-o wide`.
    pub fn wide(mut self, columns: &[&'static str]) -> Table {
        self.columns.extend(columns.iter().map(|c| (*c, true)));
        self
    }

    /// One row: a cell per column, in order (an empty cell prints as `-`).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The text: the header, then the rows; columns two spaces apart, no trailing spaces.
    pub fn render(&self, wide: bool) -> String {
        let shown: Vec<usize> = (0..self.columns.len())
            .filter(|&i| wide || !self.columns[i].1)
            .collect();
        let cell = |row: &[String], i: usize| -> String {
            match row.get(i).map(String::as_str) {
                None | Some("") => "-".to_string(),
                Some(s) => s.to_string(),
            }
        };
        let mut widths: Vec<usize> = shown
            .iter()
            .map(|&i| self.columns[i].0.chars().count())
            .collect();
        for row in &self.rows {
            for (w, &i) in widths.iter_mut().zip(&shown) {
                *w = (*w).max(cell(row, i).chars().count());
            }
        }
        let line = |cells: Vec<String>| -> String {
            let mut out = String::new();
            for (k, (c, w)) in cells.iter().zip(&widths).enumerate() {
                if k + 1 == cells.len() {
                    out.push_str(c);
                } else {
                    out.push_str(&format!("{c:<w$}  "));
                }
            }
            out.trim_end().to_string()
        };
        let mut text = line(
            shown
                .iter()
                .map(|&i| self.columns[i].0.to_string())
                .collect(),
        );
        text.push('\n');
        for row in &self.rows {
            text.push_str(&line(shown.iter().map(|&i| cell(row, i)).collect()));
            text.push('\n');
        }
        text
    }
}

/// Prints `value` as `format` asks: JSON or YAML of the value (instants as RFC 3339), or the table `table` makes.
pub fn print<T: Serialize>(
    format: Format,
    value: &T,
    table: impl FnOnce() -> Table,
) -> anyhow::Result<()> {
    print!("{}", render(format, value, table)?);
    Ok(())
}

/// What [`print`] prints.
pub fn render<T: Serialize>(
    format: Format,
    value: &T,
    table: impl FnOnce() -> Table,
) -> anyhow::Result<String> {
    let data = || -> anyhow::Result<Value> {
        let mut v = serde_json::to_value(value)?;
        instants_as_rfc3339(&mut v);
        Ok(v)
    };
    Ok(match format {
        Format::Table => table().render(false),
        Format::Wide => table().render(true),
        Format::Json => format!("{}\n", serde_json::to_string_pretty(&data()?)?),
        Format::Yaml => serde_norway::to_string(&data()?)?,
    })
}

/// Rewrites every `<name>_ms: <instant>` in `v` as `<name>: "<RFC 3339>"`, at any depth.
pub fn instants_as_rfc3339(v: &mut Value) {
    match v {
        Value::Object(map) => {
            let keys: Vec<String> = map.keys().cloned().collect();
            for k in keys {
                let instant = k
                    .strip_suffix("_ms")
                    .filter(|name| !name.is_empty() && !map.contains_key(*name))
                    .zip(map.get(&k).and_then(Value::as_i64))
                    .filter(|(_, ms)| *ms >= INSTANTS_FROM_MS)
                    .map(|(name, ms)| (name.to_string(), rfc3339(ms)));
                match instant {
                    Some((name, text)) => {
                        map.remove(&k);
                        map.insert(name, Value::String(text));
                    }
                    None => {
                        if let Some(inner) = map.get_mut(&k) {
                            instants_as_rfc3339(inner);
                        }
                    }
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(instants_as_rfc3339),
        _ => {}
    }
}

/// An instant in Unix milliseconds as RFC 3339 in UTC with milliseconds (`2026-12-01T18:40:00.000Z`).
pub fn rfc3339(ms: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let f = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );
    t.format(&f).unwrap_or_else(|_| ms.to_string())
}

/// How long ago `then_ms` was at `now_ms`, as kubectl's AGE column prints it: 45s, 12m, 5h3m, 3d, 2y
/// (`-` for none; a time in the future prints as `in 5m`).
pub fn age(then_ms: Option<i64>, now_ms: i64) -> String {
    let Some(then) = then_ms else {
        return "-".to_string();
    };
    let (d, future) = if now_ms >= then {
        ((now_ms - then) / 1000, false)
    } else {
        ((then - now_ms) / 1000, true)
    };
    let text = match d {
        0..120 => format!("{d}s"),
        120..3600 => format!("{}m", d / 60),
        3600..28_800 => match (d % 3600) / 60 {
            0 => format!("{}h", d / 3600),
            m => format!("{}h{m}m", d / 3600),
        },
        28_800..172_800 => format!("{}h", d / 3600),
        172_800..63_072_000 => format!("{}d", d / 86_400),
        _ => format!("{}y", d / 31_536_000),
    };
    if future { format!("in {text}") } else { text }
}

/// Now in Unix milliseconds (the CLI's clock for AGE).
pub fn now_ms() -> i64 {
    (time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_have_a_header_aligned_columns_and_wide_extras() {
        let mut t = Table::new(&["NODE", "STATE"]).wide(&["POOL"]);
        t.row(vec!["n-1".into(), "adopted".into(), "default".into()]);
        t.row(vec!["node-22".into(), String::new(), "gpu".into()]);
        assert_eq!(
            t.render(false),
            "NODE     STATE\nn-1      adopted\nnode-22  -\n"
        );
        assert_eq!(
            t.render(true),
            "NODE     STATE    POOL\nn-1      adopted  default\nnode-22  -        gpu\n"
        );
        assert_eq!(Table::new(&["ID"]).render(false), "ID\n");
    }

    #[test]
    fn instants_become_rfc3339_and_durations_stay() {
        let mut v = json!({
            "created_at_ms": 1_764_614_400_000_i64,
            "nodes": [{"last_seen_ms": 1_764_614_400_123_i64, "ttl_ms": 60_000}],
            "deadline_ms": null,
            "id": "x",
        });
        instants_as_rfc3339(&mut v);
        assert_eq!(
            v,
            json!({
                "created_at": "2025-12-01T18:40:00.000Z",
                "nodes": [{"last_seen": "2025-12-01T18:40:00.123Z", "ttl_ms": 60_000}],
                "deadline_ms": null,
                "id": "x",
            })
        );
        let yaml = render(
            Format::Yaml,
            &json!({"a_ms": 1_764_614_400_000_i64, "b": [1]}),
            Table::default,
        )
        .expect("yaml");
        assert_eq!(yaml, "a: 2025-12-01T18:40:00.000Z\nb:\n- 1\n");
    }

    #[test]
    fn ages_read_like_kubectl() {
        let now = 10_000_000_000;
        let ago = |s: i64| age(Some(now - s * 1000), now);
        assert_eq!(ago(0), "0s");
        assert_eq!(ago(119), "119s");
        assert_eq!(ago(600), "10m");
        assert_eq!(ago(3600 + 5 * 60), "1h5m");
        assert_eq!(ago(10 * 3600), "10h");
        assert_eq!(ago(3 * 86_400), "3d");
        assert_eq!(ago(800 * 86_400), "2y");
        assert_eq!(age(None, now), "-");
        assert_eq!(age(Some(now + 300_000), now), "in 5m");
    }
}
