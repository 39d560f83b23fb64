//! Gateways in the store: where each gateway process is reached by the other control-plane processes (its relay
//! URL, published at start and refreshed while it runs), and which gateway holds a node's session (the session row
//! names it: [`crate::Store::open_session_on`]). The tunnel relay reads both in one statement.

use crate::{Store, StoreError};
use sqlx::Row;

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
    /// Publishes (or refreshes) gateway `id` as reachable on `relay_url`.
    pub async fn publish_gateway(&self, id: &str, relay_url: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO gateways (id, relay_url) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET relay_url = $2, seen_at = now()",
        )
        .bind(id)
        .bind(relay_url)
        .execute(&self.pool)
        .await?;
        Ok(())
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
