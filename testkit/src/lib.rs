//! Test support shared by every crate of the workspace, as a dev-dependency only (`scripts/check-deps` refuses it
//! as a normal dependency). It owns the two things STYLE.md says exist once:
//!
//! - [`skip!`]: a test that needs something this machine lacks prints `SKIP: <test>: <why>` on stdout and returns.
//!   `scripts/test` counts those lines as skips, not passes; nothing else may print a skip.
//! - [`assert_golden`]: compares output with a checked-in golden file; `BC_UPDATE_GOLDEN=1` rewrites the files
//!   instead (review the diff like code). No other update variable exists.
//!
//! It depends on nothing but std, except behind the `prometheus` feature: [`prometheus`], Debian's Prometheus
//! as a real remote-write receiver (bcd's and the control plane's telemetry tests); behind the `browser` feature:
//! [`browser`], Debian's headless chromium driven over WebDriver (the fleet page's test); behind `cli`, [`help`]
//! (every command's `--help` of a binary, for its golden test); [`unit`], a systemd unit's sandbox reproduced for a
//! daemon a test starts; and [`gateways`], the two-gateway lab (control-plane processes behind a real HAProxy, every
//! process killed by its PID), and [`sushy`], sushy-tools' Redfish emulator (its fake driver on a free port, the
//! Basic-auth file, a status probe), std only as well.

#[cfg(feature = "browser")]
pub mod browser;
pub mod gateways;
#[cfg(feature = "cli")]
pub mod help;
#[cfg(feature = "prometheus")]
pub mod prometheus;
pub mod sushy;
pub mod unit;

use std::fmt::Write as _;
use std::path::Path;

/// A free loopback TCP port: bound, then released for the process that takes it. The one helper for this in the
/// workspace's tests and benches (the embedded PostgreSQL, product code, keeps its own).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// How a child stopped on SIGTERM ([`terminate`]).
#[derive(Debug)]
pub enum Stopped {
    /// It exited by itself (or had already): how, and how long after the SIGTERM.
    Exited(std::process::ExitStatus, std::time::Duration),
    /// It was still running at the limit and was killed (SIGKILL).
    Killed,
}

/// Stops `child` as a service manager does: SIGTERM, then waits up to `limit` for it to exit, then SIGKILL.
pub fn terminate(
    child: &mut std::process::Child,
    limit: std::time::Duration,
) -> std::io::Result<Stopped> {
    let t0 = std::time::Instant::now();
    if let Some(status) = child.try_wait()? {
        return Ok(Stopped::Exited(status, std::time::Duration::ZERO));
    }
    // A failed `kill` is a child that exited meanwhile: the wait below sees it.
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    while t0.elapsed() < limit {
        if let Some(status) = child.try_wait()? {
            return Ok(Stopped::Exited(status, t0.elapsed()));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill()?;
    child.wait()?;
    Ok(Stopped::Killed)
}

/// The last `n` lines of a file, oldest first, for a failure's report: the one helper for this in the workspace's
/// tests and benches. A file that cannot be read gives an empty string; bytes that are not UTF-8 are replaced.
pub fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The environment variable that makes [`assert_golden`] write the golden files instead of comparing.
pub const UPDATE_GOLDEN: &str = "BC_UPDATE_GOLDEN";

/// Skips the calling test: prints `SKIP: <test>: <why>` on stdout and returns from the enclosing function, a test
/// returning `()` or `Result<(), E>`, or a helper of one (see [`Skipped`]). The arguments are `format!`'s; `<test>`
/// is the running test's name.
///
/// ```
/// fn needs_qemu() {
///     if std::env::var_os("NO_SUCH_THING").is_none() {
///         bc_testkit::skip!("NO_SUCH_THING is not set ({})", "set it to run this");
///     }
///     unreachable!();
/// }
/// needs_qemu();
/// ```
#[macro_export]
macro_rules! skip {
    ($($why:tt)+) => {{
        $crate::print_skip(module_path!(), &::std::format!($($why)+));
        return $crate::Skipped::skipped();
    }};
}

/// What a skipping function returns: `()` for a plain test, `Ok(..)` of that for one returning `Result`, and for a
/// helper that reports the skip and lets its caller return, `None` (no fixture) or `false` (may not go on).
pub trait Skipped {
    fn skipped() -> Self;
}

impl Skipped for () {
    fn skipped() -> Self {}
}

impl<T: Skipped, E> Skipped for Result<T, E> {
    fn skipped() -> Self {
        Ok(T::skipped())
    }
}

impl<T> Skipped for Option<T> {
    fn skipped() -> Self {
        None
    }
}

impl Skipped for bool {
    fn skipped() -> Self {
        false
    }
}

/// The line [`skip!`] prints, for the test running on this thread (its libtest name; `fallback`, the module path,
/// when the thread is not a test's).
pub fn skip_line(fallback: &str, why: &str) -> String {
    let test = std::thread::current()
        .name()
        .filter(|n| *n != "main" && !n.is_empty())
        .map_or_else(|| fallback.to_string(), str::to_string);
    // One line: a reason with a newline would split the line scripts/test counts.
    let why = why.replace(['\r', '\n'], " ");
    format!("SKIP: {test}: {why}")
}

/// Prints the skip line on stdout (captured by libtest and shown with `--show-output`). Use [`skip!`].
pub fn print_skip(fallback: &str, why: &str) {
    println!("{}", skip_line(fallback, why));
}

/// Asserts that `actual` equals the golden file at `path` byte for byte. With `BC_UPDATE_GOLDEN=1` (any value but empty or `0`) it writes
/// `actual` to `path` (creating its directory) and passes. A mismatch panics naming the file, the first line that
/// differs (both versions) and the way to update; a missing file says how to create it.
#[track_caller]
pub fn assert_golden(path: impl AsRef<Path>, actual: &str) {
    let path = path.as_ref();
    if update_requested() {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        }
        std::fs::write(path, actual)
            .unwrap_or_else(|e| panic!("writing golden file {}: {e}", path.display()));
        println!("updated golden file {}", path.display());
        return;
    }
    let expected = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) => panic!(
            "golden file {}: {e}; run the test with {UPDATE_GOLDEN}=1 to create it, then review and commit it",
            path.display()
        ),
    };
    if let Some(report) = difference(&expected, actual) {
        panic!(
            "golden file {} differs from the output: {report}\nif the change is intended, rerun the test with \
             {UPDATE_GOLDEN}=1 and review the diff like code",
            path.display()
        );
    }
}

/// `BC_UPDATE_GOLDEN` set to anything but empty or `0`.
fn update_requested() -> bool {
    std::env::var_os(UPDATE_GOLDEN).is_some_and(|v| !v.is_empty() && v != "0")
}

/// None when equal; otherwise where the two first differ, with the line from each.
fn difference(expected: &str, actual: &str) -> Option<String> {
    if expected == actual {
        return None;
    }
    let (e, a): (Vec<&str>, Vec<&str>) = (
        expected.split_inclusive('\n').collect(),
        actual.split_inclusive('\n').collect(),
    );
    let at = e.iter().zip(&a).take_while(|(x, y)| x == y).count();
    let mut report = format!(
        "{} lines / {} bytes in the file, {} lines / {} bytes produced; first difference at line {}",
        e.len(),
        expected.len(),
        a.len(),
        actual.len(),
        at + 1
    );
    let _ = write!(
        report,
        "\n  file:   {:?}\n  output: {:?}",
        e.get(at).copied().unwrap_or("<end of file>"),
        a.get(at).copied().unwrap_or("<end of output>")
    );
    Some(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_line_names_the_running_test_and_stays_on_one_line() {
        let line = skip_line("fallback::module", "no qemu\nhere");
        assert_eq!(
            line,
            "SKIP: tests::skip_line_names_the_running_test_and_stays_on_one_line: no qemu here"
        );
    }

    #[test]
    fn skip_line_outside_a_test_thread_names_the_module() {
        let line = std::thread::Builder::new()
            .name("main".into())
            .spawn(|| skip_line("bc_testkit::tests", "why"))
            .expect("spawn")
            .join()
            .expect("join");
        assert_eq!(line, "SKIP: bc_testkit::tests: why");
    }

    fn unit(reached: &mut u32) {
        if std::hint::black_box(true) {
            skip!("needs {}", "nothing");
        }
        *reached += 1;
    }

    #[test]
    fn skip_returns_from_unit_and_result_functions() {
        let mut reached = 0;
        unit(&mut reached);
        assert_eq!(reached, 0, "skip! returned before the rest of the test");
        fn result() -> Result<(), String> {
            if std::hint::black_box(true) {
                skip!("returns Ok");
            }
            Err("not skipped".into())
        }
        assert_eq!(result(), Ok(()));
        fn fixture() -> Result<Option<u8>, String> {
            if std::hint::black_box(true) {
                skip!("no fixture");
            }
            Ok(Some(1))
        }
        assert_eq!(fixture(), Ok(None));
        fn have() -> bool {
            if std::hint::black_box(true) {
                skip!("absent");
            }
            true
        }
        assert!(!have());
    }

    #[test]
    fn difference_points_at_the_first_differing_line() {
        assert_eq!(difference("a\nb\n", "a\nb\n"), None);
        let d = difference("a\nb\nc\n", "a\nB\nc\n").expect("differs");
        assert!(d.contains("first difference at line 2"), "{d}");
        assert!(
            d.contains(r#"file:   "b\n""#) && d.contains(r#"output: "B\n""#),
            "{d}"
        );
        let d = difference("a\n", "a\nmore\n").expect("differs");
        assert!(d.contains("<end of file>"), "{d}");
        let d = difference("a\n", "a").expect("differs: a missing final newline counts");
        assert!(d.contains("line 1"), "{d}");
    }

    #[test]
    fn assert_golden_passes_on_equal_and_panics_on_different_or_missing() {
        let dir = std::env::temp_dir().join(format!("bc-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("g.txt");
        std::fs::write(&file, "one\ntwo\n").expect("write");
        if !update_requested() {
            assert_golden(&file, "one\ntwo\n");
            let differs = std::panic::catch_unwind(|| assert_golden(&file, "one\n2\n"));
            let missing = std::panic::catch_unwind(|| assert_golden(dir.join("absent"), "x"));
            let _ = std::fs::remove_dir_all(&dir);
            let msg = |r: std::thread::Result<()>| {
                r.expect_err("must panic")
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_default()
            };
            let differs = msg(differs);
            assert!(
                differs.contains("line 2") && differs.contains(UPDATE_GOLDEN),
                "{differs}"
            );
            let missing = msg(missing);
            assert!(missing.contains("to create it"), "{missing}");
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
