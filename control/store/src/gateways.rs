//! Gateways in the store: where each gateway process is reached by the other control-plane processes (its relay
//! URL, published at start and refreshed while it runs), and which gateway holds a node's session (the session row
//! names it: [`crate::Store::open_session_on`]). The tunnel relay reads both in one statement.

use crate::{Store, StoreError};
use sqlx::Row;

/// A gateway row's refresh time as the watch compares it (the row aliased `g`): microseconds, exact (`seen_at`
/// holds microseconds). A macro, for `concat!`: statements are static text.
macro_rules! refreshed_us {
    () => {
        "(extract(epoch FROM g.seen_at) * 1000000)::bigint"
    };
}
pub(crate) use refreshed_us;

/// Where a node's session is held, as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRoute {
    /// The gateway that opened the node's latest session (None before its first session since the column exists).
    pub gateway_id: Option<String>,
    pub online: bool,
    /// That gateway's relay URL, when it published one.
    pub relay_url: Option<String>,
    /// Milliseconds since that gateway last refreshed its row (by the database's clock).
    pub gateway_silent_ms: Option<i64>,
}

impl Store {
    /// Refreshes gateway `id`'s row while it runs: reachable on `relay_url`, and alive for `lease_ms` more (it
    /// refreshes within a third of that; see [`bc_core::gateways`]).
    pub async fn publish_gateway(
        &self,
        id: &str,
        relay_url: &str,
        lease_ms: i64,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO gateways (id, relay_url, lease_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO UPDATE SET relay_url = $2, lease_ms = $3, seen_at = now()",
        )
        .bind(id)
        .bind(relay_url)
        .bind(lease_ms)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The sessions whose row names gateway `id` and that are online: (node, epoch), by node. A restarted gateway
    /// reads them once its reconnects are over and closes those it does not hold: its previous run's, whose node has
    /// not reconnected (a killed or crashed gateway closed none, and its restart refreshes the row the `controllers`
    /// role watches, so nothing else will).
    pub async fn sessions_on_gateway(&self, id: &str) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query_as(
            "SELECT id, session_epoch FROM nodes WHERE gateway_id = $1 AND online ORDER BY id",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows)
    }

    /// Every gateway's row as the `controllers` role's watch reads it ([`bc_core::gateways::GatewayWatch`]).
    pub async fn gateway_rows(&self) -> Result<Vec<bc_core::gateways::GatewayRow>, StoreError> {
        let rows = sqlx::query(concat!(
            "SELECT g.id, ",
            refreshed_us!(),
            ", g.lease_ms FROM gateways g ORDER BY g.id"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| bc_core::gateways::GatewayRow {
                id: r.get(0),
                refreshed_us: r.get(1),
                lease_ms: r.get(2),
            })
            .collect())
    }

    /// The published gateways: (id, relay URL), by id.
    pub async fn gateways(&self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query("SELECT id, relay_url FROM gateways ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Where `node_id`'s session is held; None when there is no such node.
    pub async fn node_route(&self, node_id: &str) -> Result<Option<NodeRoute>, StoreError> {
        let row = sqlx::query(
            "SELECT n.gateway_id, n.online, g.relay_url, \
               (extract(epoch FROM now() - g.seen_at) * 1000)::bigint \
             FROM nodes n LEFT JOIN gateways g ON g.id = n.gateway_id WHERE n.id = $1",
        )
        .bind(node_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| NodeRoute {
            gateway_id: r.get(0),
            online: r.get(1),
            relay_url: r.get(2),
            gateway_silent_ms: r.get(3),
        }))
    }
}
