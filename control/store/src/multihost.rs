//! Several PostgreSQL hosts, one of them the primary: libpq's multi-host URL with its `target_session_attrs`, for a
//! pool. sqlx has no multi-host support, so this module gives it one.
//!
//! `postgres://user:pw@host1:5432,host2:5433/db?target_session_attrs=read-write` lists the hosts in the order they
//! are tried (as libpq does: first to last, each time a connection is made). With `read-write` a host qualifies
//! only when a session on it can write (`pg_is_in_recovery()` false and `transaction_read_only` off: a standby,
//! or a server set read-only, does not); with `any` (the default, as in libpq) the first host that accepts does.
//!
//! The pool ([`connect`]) opens its connections on the host that qualified; with more than one host, a watcher
//! task checks that host every [`WATCH_INTERVAL`] over a connection of its own and, when it stops qualifying (it
//! died, or it is a standby again), walks the list until one does (a host that gave no answer to the check is tried
//! last: [`Targets::find_after_silence`]) and switches the pool's connect options to it
//! (`Pool::set_connect_options`: connections opened later go there). Pooled connections opened before the switch are
//! dropped when next handed out (`before_acquire`), and a new connection that lands on a host that cannot write is
//! refused (`after_connect`) and wakes the watcher at once. While no host qualifies (between a primary's death and
//! a standby's promotion) calls fail fast with the database's errors and the watcher keeps walking. Every session
//! gets `idle_in_transaction_session_timeout` ([`IDLE_IN_TRANSACTION`]).

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions as _, Connection as _, PgConnection, PgPool};
use std::str::FromStr as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the watcher checks, with two or more hosts, that the pool's host still qualifies.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// Every session of the pool is ended by the server once it sits this long inside a transaction without a
/// statement: a process paused or cut off mid-transaction (a fenced one locks its lease rows `FOR SHARE`) cannot
/// keep its locks, and so its shards, from a new owner for longer. The control plane's transactions run their
/// statements back to back.
pub const IDLE_IN_TRANSACTION: &str = "5s";
/// How long a call waits for a pooled connection when the URL lists several hosts.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one host may take to accept a connection and answer the check during a walk.
pub const HOST_TIMEOUT: Duration = Duration::from_secs(2);

/// Which host a session may use (libpq's `target_session_attrs`, the two values the control plane needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    /// The first host that accepts a connection.
    Any,
    /// The first host whose sessions can write: the primary.
    ReadWrite,
}

/// One host of the list: `host:port` for messages, and the options to connect to it.
#[derive(Debug, Clone)]
pub struct Target {
    pub label: String,
    pub options: PgConnectOptions,
}

/// The hosts of a database URL, in the order they are tried, and what a host must be.
#[derive(Debug, Clone)]
pub struct Targets {
    pub hosts: Vec<Target>,
    pub attrs: SessionAttrs,
}

#[derive(Debug, thiserror::Error)]
pub enum TargetsError {
    #[error("database URL: {0}")]
    Invalid(String),
    #[error("no database host is {wanted}: {tried}")]
    NoHost { wanted: &'static str, tried: String },
    #[error("connecting to PostgreSQL")]
    Pool(#[source] sqlx::Error),
}

impl SessionAttrs {
    fn wanted(self) -> &'static str {
        match self {
            SessionAttrs::Any => "reachable",
            SessionAttrs::ReadWrite => "reachable and read-write",
        }
    }
}

impl Targets {
    /// Reads a `postgres://` URL whose host part may list several `host[:port]`, comma-separated. The other parts
    /// (user, password, database, parameters) apply to every host. `target_session_attrs` is `any` or
    /// `read-write`; any other value is refused, as is an empty host.
    pub fn parse(url: &str) -> Result<Targets, TargetsError> {
        let bad = |why: &str| TargetsError::Invalid(why.to_string());
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            bad("expected postgres://[user[:password]@]host[:port][,host[:port]...]/database")
        })?;
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(bad("the scheme must be postgres:// or postgresql://"));
        }
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hostlist) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (path, query) = match tail.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (tail, None),
        };
        let mut attrs = SessionAttrs::Any;
        let mut kept = Vec::new();
        for pair in query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter(|p| !p.is_empty())
        {
            match pair.split_once('=') {
                Some(("target_session_attrs", v)) => {
                    attrs = match v {
                        "any" => SessionAttrs::Any,
                        "read-write" => SessionAttrs::ReadWrite,
                        other => {
                            return Err(TargetsError::Invalid(format!(
                                "target_session_attrs={other} is not supported (any or read-write)"
                            )));
                        }
                    }
                }
                Some(("host" | "hostaddr" | "port", _)) => {
                    return Err(bad(
                        "list the hosts in the URL's host part (host1:port1,host2:port2), not as parameters",
                    ));
                }
                _ => kept.push(pair),
            }
        }
        let mut hosts = Vec::new();
        for host in hostlist.split(',') {
            if host.is_empty() {
                return Err(bad("an empty host in the host list"));
            }
            let mut one = format!("{scheme}://");
            if let Some(u) = userinfo {
                one.push_str(u);
                one.push('@');
            }
            one.push_str(host);
            one.push_str(path);
            if !kept.is_empty() {
                one.push('?');
                one.push_str(&kept.join("&"));
            }
            let options = PgConnectOptions::from_str(&one)
                .map_err(|e| TargetsError::Invalid(format!("host {host}: {e}")))?;
            // An IPv6 address in brackets, whichever way the URL parser hands the host back.
            let host = options.get_host();
            let label = match host.contains(':') && !host.starts_with('[') {
                true => format!("[{host}]:{}", options.get_port()),
                false => format!("{host}:{}", options.get_port()),
            };
            hosts.push(Target { label, options });
        }
        Ok(Targets { hosts, attrs })
    }

    /// Walks the hosts in order and returns the first that qualifies, with the connection that checked it.
    pub async fn find(&self, timeout: Duration) -> Result<(usize, PgConnection), TargetsError> {
        self.find_after_silence(timeout, None).await
    }

    /// [`Targets::find`], with the host `silent` (one that just gave no answer within `timeout`) tried last: libpq
    /// too goes on to the next host once one has not answered within its `connect_timeout`, and trying that host
    /// first again would cost a whole `timeout` more whenever it still hangs (a primary cut off without a reset,
    /// the case a failover must be quick for). The other hosts keep their order, so which host qualifies first is
    /// still decided by the list; the silent one is tried when none of the others qualifies.
    pub async fn find_after_silence(
        &self,
        timeout: Duration,
        silent: Option<usize>,
    ) -> Result<(usize, PgConnection), TargetsError> {
        let order = (0..self.hosts.len())
            .filter(|&i| Some(i) != silent)
            .chain(silent.filter(|&i| i < self.hosts.len()));
        let mut tried = Vec::new();
        for i in order {
            let t = &self.hosts[i];
            match tokio::time::timeout(timeout, open_checked(&t.options, self.attrs)).await {
                Ok(Ok(Ok(conn))) => return Ok((i, conn)),
                Ok(Ok(Err(why))) => tried.push(format!("{} {why}", t.label)),
                Ok(Err(e)) => tried.push(format!("{} {}", t.label, chain(&e))),
                Err(_) => tried.push(format!(
                    "{} gave no answer within {} s",
                    t.label,
                    timeout.as_secs_f32()
                )),
            }
        }
        Err(TargetsError::NoHost {
            wanted: self.attrs.wanted(),
            tried: tried.join("; "),
        })
    }
}

/// An error and its causes on one line (sqlx hides the OS error, "Connection refused", in its source).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Connects to one host and checks it: `Ok(Err(why))` when it answered but does not qualify.
async fn open_checked(
    options: &PgConnectOptions,
    attrs: SessionAttrs,
) -> Result<Result<PgConnection, String>, sqlx::Error> {
    let mut conn = options.connect().await?;
    match qualifies(&mut conn, attrs).await? {
        Ok(()) => Ok(Ok(conn)),
        Err(why) => {
            let _ = conn.close().await;
            Ok(Err(why))
        }
    }
}

/// Whether the session on `conn` is what `attrs` asks for (`Err(why)` when not).
async fn qualifies(
    conn: &mut PgConnection,
    attrs: SessionAttrs,
) -> Result<Result<(), String>, sqlx::Error> {
    if attrs == SessionAttrs::Any {
        return sqlx::query("SELECT 1")
            .execute(&mut *conn)
            .await
            .map(|_| Ok(()));
    }
    let (recovery, read_only): (bool, String) =
        sqlx::query_as("SELECT pg_is_in_recovery(), current_setting('transaction_read_only')")
            .fetch_one(&mut *conn)
            .await?;
    Ok(match (recovery, read_only.as_str()) {
        (true, _) => Err("is a standby (in recovery)".into()),
        (false, "on") => Err("is read-only (transaction_read_only on)".into()),
        _ => Ok(()),
    })
}

/// What the pool's callbacks and its watcher share.
struct Shared {
    targets: Targets,
    /// The index of the host the pool connects to.
    current: AtomicUsize,
    /// When the pool last switched hosts: connections older than that are dropped when next handed out.
    switched: Mutex<Option<Instant>>,
    wake: tokio::sync::Notify,
    /// Counts the moves to another host ([`crate::Store::primary_moves`]).
    moves: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    fn opened_before_switch(&self, age: Duration) -> bool {
        let switched = *self.switched.lock().unwrap_or_else(|p| p.into_inner());
        switched.is_some_and(|at| age > at.elapsed())
    }
}

/// A store on a pool of up to `max_connections` on the database at `url` (one host or several, see the module's
/// doc). The first host that qualifies is found within `first_timeout` per host, or the error names why each did
/// not. With several hosts the store counts the pool's moves ([`crate::Store::primary_moves`]).
pub async fn connect(
    url: &str,
    max_connections: u32,
    first_timeout: Duration,
) -> Result<crate::Store, TargetsError> {
    let mut targets = Targets::parse(url)?;
    for host in &mut targets.hosts {
        host.options = host
            .options
            .clone()
            .options([("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION)]);
    }
    let (first, probe) = targets.find(first_timeout).await?;
    let options = targets.hosts[first].options.clone();
    let watched = targets.hosts.len() > 1;
    let attrs = targets.attrs;
    let shared = Arc::new(Shared {
        targets,
        current: AtomicUsize::new(first),
        switched: Mutex::new(None),
        wake: tokio::sync::Notify::new(),
        moves: tokio::sync::watch::Sender::new(0),
    });
    let mut pool = PgPoolOptions::new().max_connections(max_connections);
    if attrs == SessionAttrs::ReadWrite {
        let s = shared.clone();
        pool = pool.after_connect(move |conn, _| {
            let s = s.clone();
            Box::pin(async move {
                match qualifies(conn, SessionAttrs::ReadWrite).await? {
                    Ok(()) => Ok(()),
                    Err(why) => {
                        s.wake.notify_one();
                        Err(sqlx::Error::Protocol(format!("the database host {why}")))
                    }
                }
            })
        });
    }
    if watched {
        // A connection refused is retried inside an acquire with a backoff of up to a fifth of what is left of
        // its timeout: 10 s (not sqlx's 30 s) keeps that step at 2 s once the watcher has switched hosts.
        pool = pool.acquire_timeout(ACQUIRE_TIMEOUT);
        let s = shared.clone();
        pool = pool.before_acquire(move |_, meta| {
            let stale = s.opened_before_switch(meta.age);
            Box::pin(async move { Ok(!stale) })
        });
        // And when given back: a connection to the old primary (a call cut short at the move drops it mid-query)
        // is closed at once, not pinged first, which on one that hangs costs the return's whole 5 s
        // (third_party/sqlx-core/PATCHED.md) with its place in the pool held.
        let s = shared.clone();
        pool = pool.after_release(move |_, meta| {
            let stale = s.opened_before_switch(meta.age);
            Box::pin(async move { Ok(!stale) })
        });
    }
    let pool = pool
        .connect_with(options)
        .await
        .map_err(TargetsError::Pool)?;
    if watched {
        tracing::info!(host = %shared.targets.hosts[first].label, hosts = shared.targets.hosts.len(), "database host chosen");
        let moves = shared.moves.subscribe();
        tokio::spawn(watch(pool.clone(), shared, probe));
        Ok(crate::Store::following(pool, moves))
    } else {
        let _ = probe.close().await;
        Ok(crate::Store::new(pool))
    }
}

/// Keeps the pool on a host that qualifies until the pool is closed.
async fn watch(pool: PgPool, shared: Arc<Shared>, probe: PgConnection) {
    let mut probe = Some(probe);
    let mut lost_at: Option<Instant> = None;
    let mut last_warning: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            _ = shared.wake.notified() => {}
        }
        if pool.is_closed() {
            return;
        }
        let current = shared.current.load(Ordering::Relaxed);
        let mut silent = None;
        if let Some(conn) = probe.as_mut() {
            let check =
                tokio::time::timeout(HOST_TIMEOUT, qualifies(conn, shared.targets.attrs)).await;
            match check {
                Ok(Ok(Ok(()))) => continue,
                Err(_) => silent = Some(current),
                _ => {}
            }
            probe = None;
        }
        let lost = *lost_at.get_or_insert_with(Instant::now);
        match shared
            .targets
            .find_after_silence(HOST_TIMEOUT, silent)
            .await
        {
            Ok((i, conn)) => {
                probe = Some(conn);
                lost_at = None;
                if i != current {
                    *shared.switched.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(Instant::now());
                    shared.current.store(i, Ordering::Relaxed);
                    pool.set_connect_options(shared.targets.hosts[i].options.clone());
                    shared.moves.send_modify(|n| *n += 1);
                    tracing::warn!(
                        from = %shared.targets.hosts[current].label,
                        to = %shared.targets.hosts[i].label,
                        after_ms = lost.elapsed().as_millis() as u64,
                        "database primary moved; the pool now connects to {}",
                        shared.targets.hosts[i].label
                    );
                } else {
                    tracing::info!(host = %shared.targets.hosts[i].label, after_ms = lost.elapsed().as_millis() as u64, "database host answers again");
                }
            }
            Err(e) => {
                if last_warning.is_none_or(|w| w.elapsed() > Duration::from_secs(5)) {
                    tracing::warn!(error = %e, "no database host qualifies; retrying");
                    last_warning = Some(Instant::now());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_list_applies_user_database_and_parameters_to_every_host() {
        let t = Targets::parse(
            "postgres://bc:s3cret@127.0.0.1:5432,db2.example:6543,[::1]:7000/fleet?target_session_attrs=read-write&sslmode=disable",
        )
        .expect("parse");
        assert_eq!(t.attrs, SessionAttrs::ReadWrite);
        let labels: Vec<_> = t.hosts.iter().map(|h| h.label.as_str()).collect();
        assert_eq!(labels, ["127.0.0.1:5432", "db2.example:6543", "[::1]:7000"]);
        for h in &t.hosts {
            assert_eq!(h.options.get_username(), "bc");
            assert_eq!(h.options.get_database(), Some("fleet"));
        }
    }

    #[test]
    fn one_host_without_attributes_is_any_and_a_missing_port_is_the_default() {
        let t = Targets::parse("postgres://bc@localhost/x").expect("parse");
        assert_eq!(t.attrs, SessionAttrs::Any);
        assert_eq!(t.hosts.len(), 1);
        assert_eq!(t.hosts[0].options.get_port(), 5432);
    }

    #[test]
    fn what_is_not_supported_is_refused_naming_it() {
        for (url, says) in [
            ("postgres://a@h1,,h2/x", "empty host"),
            ("postgres://a@h1/x?target_session_attrs=standby", "standby"),
            ("postgres://a@h1/x?host=h2", "host part"),
            ("mysql://a@h1/x", "scheme"),
            ("h1:5432", "expected"),
        ] {
            let e = Targets::parse(url).expect_err(url).to_string();
            assert!(e.contains(says), "{url}: {e}");
        }
    }

    #[tokio::test]
    async fn a_host_that_gave_no_answer_is_tried_after_the_others() {
        // Host 0 accepts connections (the kernel's backlog) and never answers; host 1 refuses (bound, then dropped).
        let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let refused = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
            .port();
        let silent_port = silent.local_addr().expect("addr").port();
        let t = Targets::parse(&format!(
            "postgres://a:b@127.0.0.1:{silent_port},127.0.0.1:{refused}/x?target_session_attrs=read-write"
        ))
        .expect("parse");
        let timeout = Duration::from_millis(300);
        let t = &t;
        let walk = |silent| async move {
            t.find_after_silence(timeout, silent)
                .await
                .expect_err("nothing qualifies")
                .to_string()
        };
        let in_order = walk(None).await;
        let silent_last = walk(Some(0)).await;
        let (hung, down) = (
            format!("127.0.0.1:{silent_port} gave no answer"),
            format!("127.0.0.1:{refused}"),
        );
        let at = |e: &str, what: &str| e.find(what).unwrap_or_else(|| panic!("{what} in {e}"));
        assert!(at(&in_order, &hung) < at(&in_order, &down), "{in_order}");
        assert!(
            at(&silent_last, &down) < at(&silent_last, &hung),
            "{silent_last}"
        );
        // An index past the list changes nothing.
        assert_eq!(walk(Some(7)).await, in_order);
    }

    #[tokio::test]
    async fn a_walk_names_why_each_host_did_not_qualify() {
        // Two ports nothing listens on (bound, then dropped).
        let ports: Vec<u16> = (0..2)
            .map(|_| {
                std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|l| l.local_addr())
                    .map(|a| a.port())
                    .expect("port")
            })
            .collect();
        let t = Targets::parse(&format!(
            "postgres://a:b@127.0.0.1:{},127.0.0.1:{}/x?target_session_attrs=read-write",
            ports[0], ports[1]
        ))
        .expect("parse");
        let e = t
            .find(Duration::from_secs(5))
            .await
            .expect_err("nothing listens")
            .to_string();
        assert!(e.contains("read-write"), "{e}");
        for p in ports {
            assert!(
                e.contains(&format!("127.0.0.1:{p}")) && e.contains("refused"),
                "{e}"
            );
        }
    }
}
