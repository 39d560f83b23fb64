//! Sites: site tokens (created by operators, spent by `bcd site enroll`), enrolled agents, the boot lease (one
//! serving agent per site, fenced like shard leases), the machines a site netboots, and secrets sealed at rest.
//! Only the SHA-256 of a token secret is stored; secrets arrive here already encrypted.

use crate::iam::audit;
use crate::{Store, StoreError, from_ms, to_ms};
use bc_core::api::sites::BootSpec;
use bc_core::ids::{MachineId, SiteId};
use sqlx::Row;

#[derive(Debug, Clone, serde::Serialize)]
pub struct SiteTokenRow {
    pub id: String,
    pub site_id: SiteId,
    #[serde(skip)]
    pub secret_hash: String,
    pub uses_total: i32,
    pub uses_left: i32,
    pub expires_at_ms: i64,
    pub revoked: bool,
    pub created_by: String,
    pub created_at_ms: i64,
}

pub struct NewSiteToken<'a> {
    pub id: &'a str,
    pub site_id: &'a str,
    pub secret_hash: &'a str,
    pub uses: i32,
    pub expires_at_ms: i64,
    pub created_by: &'a str,
}

/// What an enrollment commit decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnrollCommit {
    Enrolled {
        site_id: String,
    },
    /// A retry with the same token and key: the same site, no use spent.
    Replay {
        site_id: String,
    },
    Exhausted,
    Revoked,
    Expired,
    Unknown,
    /// The token's site was revoked (`sites revoke`): none of its tokens enrolls, not even a replay.
    SiteRevoked {
        site_id: String,
    },
}

/// What `sites revoke` did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SiteRevocation {
    /// False when the site was already revoked (nothing changed).
    pub newly: bool,
    /// Unspent site tokens revoked now.
    pub tokens_revoked: u64,
    /// Whether a boot lease was held and is released now.
    pub lease_released: bool,
}

/// The boot lease as one agent sees it after asking.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BootLease {
    pub held: bool,
    pub holder: String,
    pub fence: i64,
    /// Milliseconds until the current holder's lease ends (negative: already ended).
    pub expires_in_ms: i64,
}

/// A machine as stored: its canonical MAC, its site and what it netboots (the `boot` column, parsed once here: a
/// row whose boot does not parse is an error naming the machine, never skipped).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MachineRow {
    pub mac: MachineId,
    pub site_id: SiteId,
    /// None when the machine must not netboot.
    pub boot: Option<BootSpec>,
}

/// A secret as stored: AEAD nonce and ciphertext (the control plane holds the key).
#[derive(Debug, Clone)]
pub struct SealedSecret {
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

const TOKEN_COLUMNS: &str = "id, site_id, secret_hash, uses_total, uses_left, expires_at, revoked_at IS NOT NULL, created_by, created_at";

/// An id column of `table`'s row `key`, parsed (a malformed one is corrupt data naming the row).
fn id_of<T>(
    parse: fn(String) -> Result<T, bc_core::ids::BadId>,
    table: &str,
    key: &str,
    value: String,
) -> Result<T, StoreError> {
    parse(value).map_err(|e| StoreError::Corrupt(format!("{table} row {key:?}: {e}")))
}

fn token_from_row(row: &sqlx::postgres::PgRow) -> Result<SiteTokenRow, StoreError> {
    let id: String = row.get(0);
    Ok(SiteTokenRow {
        site_id: id_of(SiteId::new, "site_tokens", &id, row.get(1))?,
        id,
        secret_hash: row.get(2),
        uses_total: row.get(3),
        uses_left: row.get(4),
        expires_at_ms: to_ms(row.get(5)),
        revoked: row.get(6),
        created_by: row.get(7),
        created_at_ms: to_ms(row.get(8)),
    })
}

fn machine_from_row(row: &sqlx::postgres::PgRow) -> Result<MachineRow, StoreError> {
    let mac: String = row.get(0);
    let boot: Option<serde_json::Value> = row.get(2);
    let boot = boot
        .map(serde_json::from_value::<BootSpec>)
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("machines row {mac:?}: boot: {e}")))?;
    Ok(MachineRow {
        site_id: id_of(SiteId::new, "machines", &mac, row.get(1))?,
        mac: id_of(MachineId::new, "machines", &mac, mac.clone())?,
        boot,
    })
}

impl Store {
    /// Creates a site token, and the site itself when it does not exist yet.
    pub async fn create_site_token(&self, t: NewSiteToken<'_>) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO sites (id, name, created_by) VALUES ($1, $1, $2) ON CONFLICT (id) DO NOTHING",
        )
        .bind(t.site_id)
        .bind(t.created_by)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO site_tokens (id, site_id, secret_hash, uses_total, uses_left, expires_at, created_by) \
             VALUES ($1, $2, $3, $4, $4, $5, $6)",
        )
        .bind(t.id)
        .bind(t.site_id)
        .bind(t.secret_hash)
        .bind(t.uses)
        .bind(from_ms(t.expires_at_ms))
        .bind(t.created_by)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            t.created_by,
            "site-token.created",
            &format!("site-token/{}", t.id),
            serde_json::json!({"site": t.site_id, "uses": t.uses}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn site_token(&self, id: &str) -> Result<Option<SiteTokenRow>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {TOKEN_COLUMNS} FROM site_tokens WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(token_from_row).transpose()
    }

    /// Tokens of one site (all sites when `site` is `None`), newest first.
    pub async fn list_site_tokens(
        &self,
        site: Option<&str>,
    ) -> Result<Vec<SiteTokenRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {TOKEN_COLUMNS} FROM site_tokens WHERE $1::text IS NULL OR site_id = $1 \
             ORDER BY created_at DESC"
        )))
        .bind(site)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(token_from_row).collect()
    }

    /// Revokes a site token; revoking twice is not an error. Returns false when no such token exists.
    pub async fn revoke_site_token(&self, id: &str, actor: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let n = sqlx::query(
            "UPDATE site_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            return Ok(false);
        }
        audit(
            &mut tx,
            actor,
            "site-token.revoked",
            &format!("site-token/{id}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Revokes a site: marks it revoked, revokes its unspent tokens and releases its boot lease, in one
    /// transaction under the site's row lock, with an audit event. The gateways then refuse every agent of the site
    /// (see [`Store::revoked_identities_since`]). Revoking again changes nothing and writes no event. `None` when no
    /// such site exists.
    pub async fn revoke_site(
        &self,
        site: &str,
        actor: &str,
    ) -> Result<Option<SiteRevocation>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let Some(row) =
            sqlx::query("SELECT revoked_at IS NOT NULL FROM sites WHERE id = $1 FOR UPDATE")
                .bind(site)
                .fetch_optional(&mut *tx)
                .await?
        else {
            return Ok(None);
        };
        if row.get::<bool, _>(0) {
            return Ok(Some(SiteRevocation {
                newly: false,
                tokens_revoked: 0,
                lease_released: false,
            }));
        }
        sqlx::query("UPDATE sites SET revoked_at = now() WHERE id = $1")
            .bind(site)
            .execute(&mut *tx)
            .await?;
        let tokens_revoked = sqlx::query(
            "UPDATE site_tokens SET revoked_at = now() \
             WHERE site_id = $1 AND revoked_at IS NULL AND uses_left > 0 AND expires_at > now()",
        )
        .bind(site)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let lease_released = sqlx::query(
            "UPDATE boot_leases SET expires_at = now() - interval '1 millisecond', updated_at = now() \
             WHERE site_id = $1 AND expires_at > now()",
        )
        .bind(site)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            > 0;
        audit(
            &mut tx,
            actor,
            "site.revoked",
            &format!("site/{site}"),
            serde_json::json!({"tokens_revoked": tokens_revoked, "lease_released": lease_released}),
        )
        .await?;
        tx.commit().await?;
        Ok(Some(SiteRevocation {
            newly: true,
            tokens_revoked,
            lease_released,
        }))
    }

    /// Whether `site` exists and is revoked.
    pub async fn site_revoked(&self, site: &str) -> Result<bool, StoreError> {
        let revoked: Option<bool> =
            sqlx::query_scalar("SELECT revoked_at IS NOT NULL FROM sites WHERE id = $1")
                .bind(site)
                .fetch_optional(&self.pool)
                .await?;
        Ok(revoked.unwrap_or(false))
    }

    /// Spends one use of site token `token_id` on the agent key `key_hash`, under the token's row lock. A retry
    /// within 10 minutes with a key this token enrolled is a replay (no use spent) whatever the token's state now,
    /// so a crash between commit and the agent storing its certificate never strands it (as for joins).
    pub async fn commit_enrollment(
        &self,
        token_id: &str,
        key_hash: &str,
        cert_serial: &str,
        not_after_ms: i64,
    ) -> Result<EnrollCommit, StoreError> {
        let mut tx = self.pool.begin().await?;
        let Some(row) = sqlx::query(
            "SELECT t.site_id, t.uses_left, t.revoked_at IS NOT NULL, t.expires_at <= now(), \
                    s.revoked_at IS NOT NULL \
             FROM site_tokens t JOIN sites s ON s.id = t.site_id WHERE t.id = $1 FOR UPDATE OF t",
        )
        .bind(token_id)
        .fetch_optional(&mut *tx)
        .await?
        else {
            return Ok(EnrollCommit::Unknown);
        };
        let (site_id, uses_left, revoked, expired): (String, i32, bool, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if row.get::<bool, _>(4) {
            return Ok(EnrollCommit::SiteRevoked { site_id });
        }
        let replay = sqlx::query(
            "UPDATE site_agents SET cert_serial = $3, cert_not_after = $4 \
             WHERE site_id = $1 AND key_hash = $2 AND site_token_id = $5 \
               AND enrolled_at > now() - interval '10 minutes'",
        )
        .bind(&site_id)
        .bind(key_hash)
        .bind(cert_serial)
        .bind(from_ms(not_after_ms))
        .bind(token_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if replay > 0 {
            tx.commit().await?;
            return Ok(EnrollCommit::Replay { site_id });
        }
        if revoked {
            return Ok(EnrollCommit::Revoked);
        }
        if expired {
            return Ok(EnrollCommit::Expired);
        }
        if uses_left <= 0 {
            return Ok(EnrollCommit::Exhausted);
        }
        sqlx::query("UPDATE site_tokens SET uses_left = uses_left - 1 WHERE id = $1")
            .bind(token_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO site_agents (site_id, key_hash, site_token_id, cert_serial, cert_not_after) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (site_id, key_hash) DO UPDATE SET \
             site_token_id = EXCLUDED.site_token_id, cert_serial = EXCLUDED.cert_serial, \
             cert_not_after = EXCLUDED.cert_not_after, enrolled_at = now()",
        )
        .bind(&site_id)
        .bind(key_hash)
        .bind(token_id)
        .bind(cert_serial)
        .bind(from_ms(not_after_ms))
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            &format!("site-token/{token_id}"),
            "site.agent-enrolled",
            &format!("site/{site_id}"),
            serde_json::json!({"key_hash": key_hash}),
        )
        .await?;
        tx.commit().await?;
        Ok(EnrollCommit::Enrolled { site_id })
    }

    /// Records a renewed certificate of an enrolled agent; false when the agent is not (or no longer) enrolled.
    pub async fn record_site_agent_cert(
        &self,
        site: &str,
        key_hash: &str,
        cert_serial: &str,
        not_after_ms: i64,
    ) -> Result<bool, StoreError> {
        let n = sqlx::query(
            "UPDATE site_agents SET cert_serial = $3, cert_not_after = $4 WHERE site_id = $1 AND key_hash = $2",
        )
        .bind(site)
        .bind(key_hash)
        .bind(cert_serial)
        .bind(from_ms(not_after_ms))
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(n > 0)
    }

    /// Number of agents enrolled for `site`.
    pub async fn site_agent_count(&self, site: &str) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM site_agents WHERE site_id = $1")
                .bind(site)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    // === impl boot lease ===

    /// Takes or renews `site`'s boot lease for `holder`: renews it when `holder` holds it, takes it when it is
    /// free or expired (the fence increases on every change of holder, and when a holder comes back after its
    /// own lease expired). Otherwise reports who holds it.
    pub async fn acquire_boot_lease(
        &self,
        site: &str,
        holder: &str,
        ttl_ms: i64,
    ) -> Result<BootLease, StoreError> {
        let taken = sqlx::query(
            "INSERT INTO boot_leases (site_id, holder, fence, expires_at) \
               VALUES ($1, $2, 1, now() + make_interval(secs => $3 / 1000.0)) \
             ON CONFLICT (site_id) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at, \
               updated_at = now(), \
               fence = CASE WHEN boot_leases.holder = EXCLUDED.holder AND boot_leases.expires_at > now() \
                            THEN boot_leases.fence ELSE boot_leases.fence + 1 END \
             WHERE boot_leases.holder = EXCLUDED.holder OR boot_leases.expires_at <= now() \
             RETURNING fence, (extract(epoch FROM expires_at - now()) * 1000)::bigint",
        )
        .bind(site)
        .bind(holder)
        .bind(ttl_ms as f64)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(r) = taken {
            return Ok(BootLease {
                held: true,
                holder: holder.to_string(),
                fence: r.get(0),
                expires_in_ms: r.get(1),
            });
        }
        self.boot_lease(site, holder)
            .await?
            .ok_or_else(|| StoreError::Conflict(format!("boot lease of site {site} vanished")))
    }

    /// Gives the lease up at once when `holder` holds it (fence kept; the next holder bumps it).
    pub async fn release_boot_lease(&self, site: &str, holder: &str) -> Result<bool, StoreError> {
        let n = sqlx::query(
            "UPDATE boot_leases SET expires_at = now() - interval '1 millisecond', updated_at = now() \
             WHERE site_id = $1 AND holder = $2 AND expires_at > now()",
        )
        .bind(site)
        .bind(holder)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(n > 0)
    }

    /// The stored boot lease of `site`, seen by `asker`.
    pub async fn boot_lease(
        &self,
        site: &str,
        asker: &str,
    ) -> Result<Option<BootLease>, StoreError> {
        let row = sqlx::query(
            "SELECT holder, fence, (extract(epoch FROM expires_at - now()) * 1000)::bigint \
             FROM boot_leases WHERE site_id = $1",
        )
        .bind(site)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| {
            let holder: String = r.get(0);
            let expires_in_ms: i64 = r.get(2);
            BootLease {
                held: holder == asker && expires_in_ms > 0,
                holder,
                fence: r.get(1),
                expires_in_ms,
            }
        }))
    }

    // === impl machines ===

    /// Creates a machine of `site` with its boot spec. A MAC that already exists is CONFLICT (naming its site):
    /// its boot changes only through [`Store::set_machine_boot`], never as a side effect of a create.
    pub async fn create_machine(&self, m: &MachineRow, actor: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let site_exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM sites WHERE id = $1)")
                .bind(m.site_id.as_str())
                .fetch_one(&mut *tx)
                .await?;
        if !site_exists {
            return Err(StoreError::NotFound {
                what: "site",
                id: m.site_id.to_string(),
            });
        }
        let created = sqlx::query(
            "INSERT INTO machines (mac, site_id, boot) VALUES ($1, $2, $3) ON CONFLICT (mac) DO NOTHING",
        )
        .bind(m.mac.as_str())
        .bind(m.site_id.as_str())
        .bind(boot_json(m.boot.as_ref())?)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if created == 0 {
            let site: Option<String> =
                sqlx::query_scalar("SELECT site_id FROM machines WHERE mac = $1")
                    .bind(m.mac.as_str())
                    .fetch_optional(&mut *tx)
                    .await?;
            return Err(StoreError::Conflict(format!(
                "machine {} already exists (site {}); change its boot with machines.set-boot",
                m.mac,
                site.unwrap_or_default()
            )));
        }
        audit(
            &mut tx,
            actor,
            "machine.create",
            &format!("machine/{}", m.mac),
            serde_json::json!({"site": m.site_id, "boot": m.boot}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Sets (or clears, with `None`) the boot spec of an existing machine. Returns false when there is none.
    pub async fn set_machine_boot(
        &self,
        mac: &str,
        boot: Option<&BootSpec>,
        actor: &str,
    ) -> Result<bool, StoreError> {
        let boot = boot_json(boot)?;
        let mut tx = self.pool.begin().await?;
        let n = sqlx::query("UPDATE machines SET boot = $2, updated_at = now() WHERE mac = $1")
            .bind(mac)
            .bind(&boot)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
            return Ok(false);
        }
        audit(
            &mut tx,
            actor,
            "machine.set-boot",
            &format!("machine/{mac}"),
            serde_json::json!({"boot": boot}),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn machine(&self, mac: &str) -> Result<Option<MachineRow>, StoreError> {
        let row = sqlx::query("SELECT mac, site_id, boot FROM machines WHERE mac = $1")
            .bind(mac)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(machine_from_row).transpose()
    }

    /// Machines of `site` (all sites when `None`), by MAC.
    pub async fn list_machines(&self, site: Option<&str>) -> Result<Vec<MachineRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT mac, site_id, boot FROM machines WHERE $1::text IS NULL OR site_id = $1 ORDER BY mac",
        )
        .bind(site)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(machine_from_row).collect()
    }

    // === impl secrets ===

    /// Stores (or replaces) a secret of `site`, already sealed by the caller.
    pub async fn put_secret(
        &self,
        site: &str,
        name: &str,
        sealed: &SealedSecret,
        actor: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let site_exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM sites WHERE id = $1)")
                .bind(site)
                .fetch_one(&mut *tx)
                .await?;
        if !site_exists {
            return Err(StoreError::NotFound {
                what: "site",
                id: site.to_string(),
            });
        }
        sqlx::query(
            "INSERT INTO secrets (site_id, name, nonce, ciphertext, created_by) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (site_id, name) DO UPDATE SET nonce = EXCLUDED.nonce, ciphertext = EXCLUDED.ciphertext, \
             created_by = EXCLUDED.created_by, updated_at = now()",
        )
        .bind(site)
        .bind(name)
        .bind(&sealed.nonce)
        .bind(&sealed.ciphertext)
        .bind(actor)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            actor,
            "secret.put",
            &format!("site/{site}/secret/{name}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records in the audit log that `agent` of `site` received secret `name` (never the value).
    pub async fn audit_secret_delivery(
        &self,
        site: &str,
        name: &str,
        agent: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        audit(
            &mut tx,
            &format!("site/{site}/agent/{agent}"),
            "secret.delivered",
            &format!("site/{site}/secret/{name}"),
            serde_json::json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn secret(&self, site: &str, name: &str) -> Result<Option<SealedSecret>, StoreError> {
        let row =
            sqlx::query("SELECT nonce, ciphertext FROM secrets WHERE site_id = $1 AND name = $2")
                .bind(site)
                .bind(name)
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.map(|r| SealedSecret {
            nonce: r.get(0),
            ciphertext: r.get(1),
        }))
    }
}

/// A boot spec as the `boot` column holds it.
fn boot_json(boot: Option<&BootSpec>) -> Result<Option<serde_json::Value>, StoreError> {
    boot.map(serde_json::to_value)
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("encoding a boot spec: {e}")))
}

/// What `machines.delete` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MachineDeletion {
    Deleted {
        site: SiteId,
    },
    NotFound,
    /// Still held by another table's row (the metal flow's): its name.
    InUse(String),
}

impl Store {
    /// Every site with its counts and boot-lease holder, by id.
    pub async fn list_sites(&self) -> Result<Vec<bc_core::api::sites::Site>, StoreError> {
        let rows = sqlx::query(
            "SELECT s.id, s.name, s.created_by, s.created_at, s.revoked_at, \
               (SELECT count(*) FROM site_agents a WHERE a.site_id = s.id), \
               (SELECT count(*) FROM machines m WHERE m.site_id = s.id), \
               (SELECT count(*) FROM secrets x WHERE x.site_id = s.id), \
               (SELECT holder FROM boot_leases b WHERE b.site_id = s.id AND b.expires_at > now()) \
             FROM sites s ORDER BY s.id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.get(0);
                Ok(bc_core::api::sites::Site {
                    id: id_of(SiteId::new, "sites", &id, id.clone())?,
                    name: r.get(1),
                    created_by: r.get(2),
                    created_at_ms: to_ms(r.get(3)),
                    revoked_at_ms: r.get::<Option<time::OffsetDateTime>, _>(4).map(to_ms),
                    agents: r.get(5),
                    machines: r.get(6),
                    secrets: r.get(7),
                    boot_holder: r.get(8),
                })
            })
            .collect()
    }

    /// Deletes a machine and audits it; a row of another table that still names it (the metal flow's
    /// `metal_machines`) refuses it.
    pub async fn delete_machine(
        &self,
        mac: &str,
        actor: &str,
    ) -> Result<MachineDeletion, StoreError> {
        let mut tx = self.pool.begin().await?;
        let deleted: Result<Option<String>, sqlx::Error> =
            sqlx::query_scalar("DELETE FROM machines WHERE mac = $1 RETURNING site_id")
                .bind(mac)
                .fetch_optional(&mut *tx)
                .await;
        let site = match deleted {
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23503") => {
                return Ok(MachineDeletion::InUse(
                    e.table().unwrap_or("another table").to_string(),
                ));
            }
            other => other?,
        };
        let Some(site) = site else {
            return Ok(MachineDeletion::NotFound);
        };
        audit(
            &mut tx,
            actor,
            "machine.delete",
            &format!("machine/{mac}"),
            serde_json::json!({"site": site}),
        )
        .await?;
        tx.commit().await?;
        Ok(MachineDeletion::Deleted {
            site: id_of(SiteId::new, "machines", mac, site)?,
        })
    }
}
