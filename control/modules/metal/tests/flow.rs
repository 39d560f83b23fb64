//! The metal executor on a real PostgreSQL, at chosen times (`now` is an argument): verbs through the planner,
//! BMC commands written for the site and their reported results, single-use boot tokens in the netboot entry, the
//! ramdisk's node found by the token it joined with, ramdisk commands on that node and their results, the
//! timeline and audit rows, the re-kick plan ending in "never joined", fencing, and no step applied twice.

use bc_core::api::metal::{BmcRef, EnrollRequest};
use bc_core::ids::SiteId;
use bc_core::metal::{BmcOp, HardwareSummary, Outcome, Phase, Policy, Power, Retry, State, Verb};
use bc_core::shards::{Shard, ShardLease};
use bc_mod_metal::executor::{self, Pass};
use bc_mod_metal::queries::{self, BmcCommand};
use bc_mod_metal::{Config, MIGRATIONS, Metal};
use bc_store::Store;
use bc_store::sqlx;
use bc_store::testing::test_db;

const SITE: &str = "rack-1";
const MAC: &str = "52:54:00:aa:bb:01";
const T0: i64 = 1_800_000_000_000;
const S: i64 = 1000;

fn policy() -> Policy {
    Policy {
        bmc_timeout_ms: 30 * S,
        inspect: Retry {
            timeout_ms: 30 * S,
            attempts: 2,
        },
        netboot: Retry {
            timeout_ms: 60 * S,
            attempts: 3,
        },
        ..Policy::default()
    }
}

struct Lab {
    metal: Metal,
    leases: Vec<ShardLease>,
}

const WORKER: &str = "w1";

async fn lab() -> (bc_store::testing::TestDb, Lab) {
    let db = test_db().await;
    bc_store::migrate::migrate_with(
        &db.pool,
        &MIGRATIONS
            .iter()
            .map(|m| bc_store::migrate::Migration {
                version: m.version,
                name: m.name,
                sql: m.sql,
            })
            .collect::<Vec<_>>(),
    )
    .await
    .expect("metal migration");
    let store = Store::new(db.pool.clone());
    store.ensure_root_tenant().await.expect("root tenant");
    sqlx::query("INSERT INTO sites (id, name, created_by) VALUES ($1, $1, 'test')")
        .bind(SITE)
        .execute(&db.pool)
        .await
        .expect("site");
    // This process holds every shard of the controllers role, fence 1.
    sqlx::query(
        "INSERT INTO shard_leases (role, shard, owner, fence, expires_at) \
         SELECT 'controllers', s, $1, 1, now() + interval '1 hour' FROM generate_series(0, 255) s",
    )
    .bind(WORKER)
    .execute(&db.pool)
    .await
    .expect("leases");
    let leases = (0..256)
        .map(|s| ShardLease {
            shard: Shard::new(s).expect("shard"),
            fence: 1,
        })
        .collect();
    let config = Config {
        policy: policy(),
        ..Config::default()
    };
    (
        db,
        Lab {
            metal: Metal { store, config },
            leases,
        },
    )
}

impl Lab {
    fn pool(&self) -> &sqlx::PgPool {
        self.metal.store.pool()
    }

    async fn enroll(&self) {
        let req = EnrollRequest {
            site: SiteId::new(SITE.into()).expect("site id"),
            mac: "52-54-00-AA-BB-01".into(),
            bmc: BmcRef {
                address: "http://127.0.0.1:8000".into(),
                credentials: "bmc-1".into(),
            },
            expected: None,
        };
        bc_mod_metal::api::enroll_machine(&self.metal, req, "test", T0)
            .await
            .expect("enroll");
    }

    async fn verb(&self, verb: Verb, now: i64) -> Result<(), String> {
        executor::verb(&self.metal, MAC, verb, now, "test")
            .await
            .expect("verb")
            .map(|_| ())
    }

    async fn pass(&self, now: i64) -> Pass {
        executor::pass(&self.metal, WORKER, &self.leases, MAC, now)
            .await
            .expect("pass")
    }

    async fn state(&self) -> State {
        queries::get(self.pool(), MAC)
            .await
            .expect("get")
            .expect("row")
            .machine
            .state
    }

    /// What the site agent would receive now.
    async fn site_takes(&self, now: i64) -> Vec<BmcCommand> {
        queries::take_bmc(self.pool(), SITE, now, 10)
            .await
            .expect("take")
    }

    async fn site_reports(&self, c: &BmcCommand, o: Outcome, now: i64) {
        assert!(
            queries::finish_bmc(self.pool(), SITE, &c.id, &o, now)
                .await
                .expect("finish"),
            "{c:?} was open"
        );
    }

    async fn one_bmc(&self, now: i64, op: BmcOp) -> BmcCommand {
        let mut cs = self.site_takes(now).await;
        assert_eq!(cs.len(), 1, "{cs:?}");
        let c = cs.remove(0);
        assert_eq!(c.op, op);
        c
    }

    async fn netboot_cmdline(&self) -> Option<String> {
        let boot: Option<serde_json::Value> =
            sqlx::query_scalar("SELECT boot FROM machines WHERE mac = $1")
                .bind(MAC)
                .fetch_one(self.pool())
                .await
                .expect("boot");
        boot.map(|b| b["cmdline"].as_str().unwrap_or_default().to_owned())
    }

    /// The ramdisk joins with the token of the netboot entry: a node whose join token is that token, online.
    async fn ramdisk_joins(&self, node: &str) {
        let cmdline = self.netboot_cmdline().await.expect("a netboot entry");
        let token = cmdline
            .split_whitespace()
            .find_map(|p| p.strip_prefix("bc.boot_token="))
            .expect("a boot token on the command line");
        let id = token
            .strip_prefix("bcjt_")
            .and_then(|t| t.split('.').next())
            .expect("bcjt_<id>.<secret>");
        sqlx::query(
            "INSERT INTO nodes (id, shard, pool_id, state, claims, join_token_id, join_key_hash, joined_at, \
             cert_serial, cert_not_after, online) VALUES ($1, bc_shard($1), 'metal', 'adopting', '{}', $2, 'k', now(), 's', now() + interval '1 day', true)",
        )
        .bind(node)
        .bind(id)
        .execute(self.pool())
        .await
        .expect("node");
    }

    /// The ramdisk answers its open command of `kind` with `result`.
    async fn ramdisk_answers(&self, kind: &str, result: serde_json::Value) {
        let n = sqlx::query(
            "UPDATE commands SET state = 'done', result = $2, finished_at = now() \
             WHERE kind = $1 AND state IN ('pending', 'sent')",
        )
        .bind(kind)
        .bind(result)
        .execute(self.pool())
        .await
        .expect("answer")
        .rows_affected();
        assert_eq!(n, 1, "one open {kind}");
    }

    async fn count(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql)
            .bind(MAC)
            .fetch_one(self.pool())
            .await
            .expect(sql)
    }
}

fn inventory() -> Outcome {
    Outcome::Inspected(HardwareSummary {
        cpus: Some(2),
        memory_mib: Some(2048),
        gpus: Some(0),
        disks: None,
        macs: vec![MAC.into()],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provide_runs_inspection_netboot_diagnose_and_wipe_to_ready() {
    let (_db, lab) = lab().await;
    lab.enroll().await;
    lab.verb(Verb::Provide, T0).await.expect("provide");
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Inspecting
        }
    );

    let c = lab.one_bmc(T0 + S, BmcOp::Inspect).await;
    assert_eq!(
        c.bmc.credentials, "bmc-1",
        "the site gets the secret's name"
    );
    lab.site_reports(&c, inventory(), T0 + 2 * S).await;
    assert!(matches!(lab.pass(T0 + 2 * S).await, Pass::Applied(_)));
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::BootingRamdisk
        }
    );
    let cmdline = lab
        .netboot_cmdline()
        .await
        .expect("netboot entry published");
    assert!(cmdline.contains("bc.boot_token=bcjt_"), "{cmdline}");
    let uses: i32 = sqlx::query_scalar(
        "SELECT uses_total FROM join_tokens WHERE id IN (SELECT id FROM metal_boot_tokens WHERE mac = $1)",
    )
    .bind(MAC)
    .fetch_one(lab.pool())
    .await
    .expect("boot token");
    assert_eq!(uses, 1, "a boot token is single use");

    let c = lab.one_bmc(T0 + 3 * S, BmcOp::BootOncePxe).await;
    lab.site_reports(&c, Outcome::BootOnceSet { persistent: true }, T0 + 3 * S)
        .await;
    lab.pass(T0 + 3 * S).await;
    let c = lab
        .one_bmc(T0 + 4 * S, BmcOp::Power { power: Power::Boot })
        .await;
    lab.site_reports(&c, Outcome::Done, T0 + 4 * S).await;
    assert_eq!(
        lab.pass(T0 + 5 * S).await,
        Pass::Unchanged,
        "waiting for the join"
    );

    lab.ramdisk_joins("node-ramdisk-1").await;
    lab.pass(T0 + 20 * S).await;
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Diagnosing
        }
    );
    assert_eq!(
        lab.netboot_cmdline().await,
        None,
        "the netboot entry is withdrawn once joined"
    );
    // The BMC kept the override as Continuous: the disk boot is restored explicitly.
    lab.one_bmc(T0 + 21 * S, BmcOp::BootDisk).await;

    lab.ramdisk_answers(
        "ramdisk.diagnose",
        serde_json::json!({"cpu": {"logical_cpus": 2}, "memory": {"total_bytes": 2147483648u64},
                           "gpus": [], "disks": [{"name": "vda"}], "nics": [{"mac": MAC}], "problems": []}),
    )
    .await;
    lab.pass(T0 + 30 * S).await;
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Wiping
        }
    );
    lab.ramdisk_answers(
        "ramdisk.wipe",
        serde_json::json!({"wiped": true, "failed": [], "devices": []}),
    )
    .await;
    lab.pass(T0 + 40 * S).await;
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Ready
        }
    );

    let row = queries::get(lab.pool(), MAC)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(row.machine.node_id.as_deref(), Some("node-ramdisk-1"));
    assert_eq!(row.machine.power_cycles, 1);
    let phases: Vec<String> =
        sqlx::query_scalar("SELECT phase FROM metal_timeline WHERE mac = $1 ORDER BY seq")
            .bind(MAC)
            .fetch_all(lab.pool())
            .await
            .expect("timeline");
    assert_eq!(
        phases,
        [
            "enrolled",
            "inspecting",
            "booting-ramdisk",
            "diagnosing",
            "wiping",
            "ready"
        ]
    );
    let transitions = lab
        .count("SELECT count(*) FROM audit_events WHERE subject = 'machine/' || $1 AND action = 'metal.transition'")
        .await;
    assert_eq!(transitions, 5, "one audit event per transition");
    let used: Option<String> =
        sqlx::query_scalar("SELECT node_id FROM metal_boot_tokens WHERE mac = $1")
            .bind(MAC)
            .fetch_one(lab.pool())
            .await
            .expect("token row");
    assert_eq!(
        used.as_deref(),
        Some("node-ramdisk-1"),
        "the machine links to the node"
    );
    // Migration 1102: the enrolment writes the machine's shard, as the generated column did.
    let misplaced = bc_store::testing::misplaced_shards(lab.pool(), &[("metal_machines", "mac")])
        .await
        .expect("shards");
    assert!(misplaced.is_empty(), "{misplaced:?}");
    assert_eq!(
        bc_store::testing::generated_columns_calling_sql_functions(lab.pool())
            .await
            .expect("catalog"),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_that_never_joins_is_rekicked_k_times_then_fails_with_why() {
    let (_db, lab) = lab().await;
    lab.enroll().await;
    lab.verb(Verb::Provide, T0).await.expect("provide");
    let c = lab.one_bmc(T0, BmcOp::Inspect).await;
    lab.site_reports(&c, inventory(), T0).await;
    lab.pass(T0).await;
    let mut now = T0;
    let mut tokens = Vec::new();
    for attempt in 1..=3 {
        tokens.push(lab.netboot_cmdline().await.expect("entry"));
        let c = lab.one_bmc(now, BmcOp::BootOncePxe).await;
        lab.site_reports(&c, Outcome::BootOnceSet { persistent: false }, now)
            .await;
        lab.pass(now).await;
        let c = lab.one_bmc(now, BmcOp::Power { power: Power::Boot }).await;
        lab.site_reports(&c, Outcome::Done, now).await;
        lab.pass(now).await;
        now += 61 * S;
        lab.pass(now).await;
        let state = lab.state().await;
        if attempt < 3 {
            assert_eq!(
                state,
                State::Active {
                    phase: Phase::BootingRamdisk
                },
                "attempt {attempt}"
            );
        } else {
            let State::Failed { phase, reason } = state else {
                panic!("{state:?}");
            };
            assert_eq!(phase, Phase::BootingRamdisk);
            assert!(
                reason.starts_with("never joined: 3 PXE attempts"),
                "{reason}"
            );
        }
    }
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "a fresh boot token per attempt");
    assert_eq!(lab.netboot_cmdline().await, None, "withdrawn on failure");
    assert!(
        lab.site_takes(now).await.is_empty(),
        "nothing left for the BMC"
    );
    let row = queries::get(lab.pool(), MAC)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(row.machine.power_cycles, 3);
    assert_eq!(row.machine.deadline, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_verb_changes_nothing_and_says_what_to_do() {
    let (_db, lab) = lab().await;
    lab.enroll().await;
    let why = lab
        .verb(Verb::Release, T0)
        .await
        .expect_err("release from enrolled");
    assert!(why.contains("inspect, provide or deploy it"), "{why}");
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Enrolled
        }
    );
    lab.verb(Verb::Inspect, T0).await.expect("inspect");
    let why = lab
        .verb(Verb::Provide, T0)
        .await
        .expect_err("provide while inspecting");
    assert!(why.contains("abort"), "{why}");
    lab.verb(Verb::Abort, T0 + S).await.expect("abort");
    let State::Failed { reason, .. } = lab.state().await else {
        panic!("not failed");
    };
    assert!(reason.contains("aborted by the operator"), "{reason}");
    assert!(
        lab.site_takes(T0 + S).await.is_empty(),
        "the inspection was cancelled"
    );
    lab.verb(Verb::Retry, T0 + 2 * S).await.expect("retry");
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Inspecting
        }
    );
    assert_eq!(
        lab.site_takes(T0 + 2 * S).await.len(),
        1,
        "a fresh inspection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_lease_changes_nothing_and_a_repeated_pass_repeats_nothing() {
    let (_db, lab) = lab().await;
    lab.enroll().await;
    lab.verb(Verb::Provide, T0).await.expect("provide");
    let c = lab.one_bmc(T0, BmcOp::Inspect).await;
    lab.site_reports(&c, inventory(), T0).await;
    // The shard moved on to another owner (fence 2): this process's pass is skipped.
    sqlx::query("UPDATE shard_leases SET owner = 'w2', fence = 2")
        .execute(lab.pool())
        .await
        .expect("move");
    assert_eq!(lab.pass(T0).await, Pass::Skipped);
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Inspecting
        }
    );
    sqlx::query("UPDATE shard_leases SET owner = $1, fence = 1")
        .bind(WORKER)
        .execute(lab.pool())
        .await
        .expect("back");
    assert!(matches!(lab.pass(T0).await, Pass::Applied(_)));
    // Passes again at the same and later times (a restarted executor) add no command and no token.
    for t in [T0, T0 + S, T0 + 2 * S] {
        assert_eq!(lab.pass(t).await, Pass::Unchanged);
    }
    assert_eq!(
        lab.count("SELECT count(*) FROM metal_boot_tokens WHERE mac = $1")
            .await,
        1
    );
    assert_eq!(
        lab.count("SELECT count(*) FROM metal_bmc_commands WHERE mac = $1")
            .await,
        2,
        "the inspection and one boot override"
    );
}

/// Up to the ramdisk's join and the diagnose answered: the machine is wiping with `ramdisk.wipe` queued.
async fn to_wiping(lab: &Lab) {
    lab.enroll().await;
    lab.verb(Verb::Provide, T0).await.expect("provide");
    let c = lab.one_bmc(T0, BmcOp::Inspect).await;
    lab.site_reports(&c, inventory(), T0).await;
    lab.pass(T0).await;
    let c = lab.one_bmc(T0, BmcOp::BootOncePxe).await;
    lab.site_reports(&c, Outcome::BootOnceSet { persistent: false }, T0)
        .await;
    lab.pass(T0).await;
    let c = lab.one_bmc(T0, BmcOp::Power { power: Power::Boot }).await;
    lab.site_reports(&c, Outcome::Done, T0).await;
    lab.ramdisk_joins("node-ramdisk-2").await;
    lab.pass(T0 + S).await;
    lab.ramdisk_answers(
        "ramdisk.diagnose",
        serde_json::json!({"cpu": {"logical_cpus": 2}, "gpus": [], "disks": [], "nics": [], "problems": []}),
    )
    .await;
    lab.pass(T0 + 2 * S).await;
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Wiping
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_accepted_and_not_applied_fails_the_machine_with_what_was_read() {
    let (_db, lab) = lab().await;
    lab.enroll().await;
    lab.verb(Verb::Provide, T0).await.expect("provide");
    let c = lab.one_bmc(T0, BmcOp::Inspect).await;
    lab.site_reports(&c, inventory(), T0).await;
    lab.pass(T0).await;
    let c = lab.one_bmc(T0, BmcOp::BootOncePxe).await;
    let read = "the BMC accepted the boot override Pxe but reads back Target=Hdd, Enabled=Disabled";
    lab.site_reports(
        &c,
        Outcome::Failed {
            reason: read.into(),
            retryable: false,
        },
        T0,
    )
    .await;
    lab.pass(T0 + S).await;
    let State::Failed { phase, reason } = lab.state().await else {
        panic!("not failed");
    };
    assert_eq!(phase, Phase::BootingRamdisk);
    assert!(reason.contains(read), "{reason}");
    assert_eq!(
        lab.netboot_cmdline().await,
        None,
        "the netboot entry is withdrawn"
    );
    assert!(
        lab.site_takes(T0 + S).await.is_empty(),
        "no power kick after a failed override"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_during_wiping_cancels_the_wipe_on_the_node() {
    let (_db, lab) = lab().await;
    to_wiping(&lab).await;
    lab.verb(Verb::Abort, T0 + 3 * S).await.expect("abort");
    let State::Failed { phase, reason } = lab.state().await else {
        panic!("not failed");
    };
    assert_eq!(phase, Phase::Wiping);
    assert!(
        reason.contains("aborted by the operator during wiping"),
        "{reason}"
    );
    let (state, error): (String, Option<String>) =
        sqlx::query_as("SELECT state, error FROM commands WHERE kind = 'ramdisk.wipe'")
            .fetch_one(lab.pool())
            .await
            .expect("wipe command");
    assert_eq!(state, "failed", "the node is not left wiping for nobody");
    assert!(error.is_some_and(|e| e.contains("aborted")));
    // It stopped: there is nothing left to abort; retry starts the phase again.
    assert!(lab.verb(Verb::Abort, T0 + 4 * S).await.is_err());
    lab.verb(Verb::Retry, T0 + 5 * S).await.expect("retry");
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Wiping
        }
    );
    assert_eq!(
        lab.count("SELECT count(*) FROM metal_commands WHERE mac = $1 AND step = 'wipe'")
            .await,
        2,
        "retry queues a fresh wipe"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_executor_resumes_from_the_stored_record() {
    let (_db, lab) = lab().await;
    to_wiping(&lab).await;
    // Another process (a restarted control plane) takes over the shards and plans from the stored record.
    sqlx::query("UPDATE shard_leases SET owner = 'w2', fence = 2")
        .execute(lab.pool())
        .await
        .expect("move");
    let leases: Vec<ShardLease> = lab
        .leases
        .iter()
        .map(|l| ShardLease {
            shard: l.shard,
            fence: 2,
        })
        .collect();
    let restarted = Metal {
        store: lab.metal.store.clone(),
        config: lab.metal.config.clone(),
    };
    let again = executor::pass(&restarted, "w2", &leases, MAC, T0 + 3 * S)
        .await
        .expect("pass");
    assert_eq!(again, Pass::Unchanged, "nothing is planned twice");
    assert_eq!(
        lab.count("SELECT count(*) FROM metal_commands WHERE mac = $1")
            .await,
        2,
        "one diagnose, one wipe"
    );
    lab.ramdisk_answers(
        "ramdisk.wipe",
        serde_json::json!({"wiped": true, "failed": []}),
    )
    .await;
    executor::pass(&restarted, "w2", &leases, MAC, T0 + 4 * S)
        .await
        .expect("pass");
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Ready
        }
    );
}

/// From wiping to ready, then deploy: the stream names the image on the site's boot HTTP (as its agent reported
/// it), the kexec carries the installed system's join token in its seed (minted in the same plan, recorded for the
/// machine), and the node that joins with that token (a reclaim of the same node) makes the machine deployed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_carries_the_join_token_to_the_kexec_and_the_installed_join_deploys() {
    let (_db, lab) = lab().await;
    to_wiping(&lab).await;
    lab.ramdisk_answers(
        "ramdisk.wipe",
        serde_json::json!({"wiped": true, "failed": []}),
    )
    .await;
    lab.pass(T0 + 3 * S).await;
    sqlx::query("INSERT INTO metal_sites (site_id, boot_url, reported_ms) VALUES ($1, 'http://10.78.0.2:8080', 0)")
        .bind(SITE)
        .execute(lab.pool())
        .await
        .expect("site report");
    let image = format!("sha256:{}", "ab".repeat(32));
    let streams = "SELECT count(*) FROM metal_commands WHERE mac = $1 AND step = 'stream'";
    lab.verb(
        Verb::Deploy(bc_core::metal::DeploySpec {
            image: image.clone(),
            user_data: "#cloud-config\n".into(),
            meta_data: String::new(),
        }),
        T0 + 4 * S,
    )
    .await
    .expect("deploy");
    assert_eq!(
        lab.count(streams).await,
        0,
        "no stream before the site holds the image"
    );
    sqlx::query("UPDATE metal_sites SET cached = ARRAY[$1]")
        .bind("ab".repeat(32))
        .execute(lab.pool())
        .await
        .expect("the site reports the image cached");
    lab.pass(T0 + 4 * S + 500).await;
    assert_eq!(lab.count(streams).await, 1);
    let args: serde_json::Value =
        sqlx::query_scalar("SELECT args FROM commands WHERE kind = 'ramdisk.stream'")
            .fetch_one(lab.pool())
            .await
            .expect("stream queued");
    assert_eq!(
        args["url"],
        format!("http://10.78.0.2:8080/artifacts/sha256/{}", "ab".repeat(32)),
        "the site's boot HTTP serves the image"
    );
    lab.ramdisk_answers(
        "ramdisk.stream",
        serde_json::json!({"digest": "ab".repeat(32), "algo": "sha256"}),
    )
    .await;
    lab.pass(T0 + 5 * S).await;
    let args: serde_json::Value =
        sqlx::query_scalar("SELECT args FROM commands WHERE kind = 'ramdisk.kexec'")
            .fetch_one(lab.pool())
            .await
            .expect("kexec queued");
    let token = args["seed"]["join_token"]
        .as_str()
        .expect("the seed's join token");
    assert_eq!(args["seed"]["user_data"], "#cloud-config\n");
    let id = token
        .strip_prefix("bcjt_")
        .and_then(|t| t.split('.').next())
        .expect("bcjt_<id>.<secret>");
    let (reclaim, uses, reclaims): (bool, i32, String) = sqlx::query_as(
        "SELECT j.reclaim, j.uses_total, t.node_id FROM join_tokens j JOIN metal_join_tokens t ON t.id = j.id \
         WHERE j.id = $1",
    )
    .bind(id)
    .fetch_one(lab.pool())
    .await
    .expect("the join token is the machine's");
    assert_eq!(
        (reclaim, uses, reclaims.as_str()),
        (true, 1, "node-ramdisk-2")
    );
    assert_eq!(
        lab.pass(T0 + 6 * S).await,
        Pass::Unchanged,
        "waits for the join"
    );
    // The kexec'd system reclaims the node with the token: the node's join token is now that one.
    sqlx::query("UPDATE nodes SET join_token_id = $1, online = true WHERE id = 'node-ramdisk-2'")
        .bind(id)
        .execute(lab.pool())
        .await
        .expect("reclaim");
    lab.pass(T0 + 30 * S).await;
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Deployed
        }
    );
    let row = queries::get(lab.pool(), MAC)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(row.installed_node.as_deref(), Some("node-ramdisk-2"));
    assert_eq!(
        lab.count(
            "SELECT count(*) FROM metal_commands WHERE mac = $1 AND step IN ('stream', 'kexec')"
        )
        .await,
        2,
        "one stream, one kexec"
    );
}

/// A ramdisk whose session dropped a moment ago (a control plane restarted, a gateway failed over) keeps its
/// attempt; one gone longer than the grace ends it and the next attempt netboots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_session_is_given_a_grace_before_the_attempt_ends() {
    let (_db, lab) = lab().await;
    to_wiping(&lab).await;
    let seen = T0 + 2 * S;
    sqlx::query("UPDATE nodes SET online = false, last_seen_at = to_timestamp($1 / 1000.0)")
        .bind(seen as f64)
        .execute(lab.pool())
        .await
        .expect("session dropped");
    assert_eq!(
        lab.pass(seen + 30 * S).await,
        Pass::Unchanged,
        "30 s after the drop the wipe still waits"
    );
    assert_eq!(
        lab.state().await,
        State::Active {
            phase: Phase::Wiping
        }
    );
    lab.pass(seen + executor::SESSION_GRACE_MS + S).await;
    let row = queries::get(lab.pool(), MAC)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(
        row.machine.attempt, 2,
        "the attempt ended: {:?}",
        row.machine
    );
    assert!(
        lab.netboot_cmdline().await.is_some(),
        "the next attempt netboots"
    );
}
