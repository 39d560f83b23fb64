//! The CLI of the capacity module's `reservations` group.

use crate::client::ApiClient;
use crate::output::{self, Format, Table};
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub enum ReservationCommand {
    /// Reserve GPUs; waits for the placer and prints the reservation (id, node, GPU UUIDs).
    Create {
        #[arg(long, default_value = "root")]
        tenant: String,
        #[arg(long)]
        gpus: u32,
        /// GPU model as nodes report it (any when absent).
        #[arg(long)]
        model: Option<String>,
        /// node (all on one node), nvlink (one NVLink clique) or any.
        #[arg(long, default_value = "node")]
        topology: String,
        /// How long: 90s, 30m, 24h, 7d.
        #[arg(long, default_value = "1h", value_parser = bc_proto::duration::parse)]
        duration: std::time::Duration,
        /// The pool to book in (required when the control plane places by pool).
        #[arg(long)]
        pool: Option<String>,
        /// Retrying with the same key and request returns the same reservation.
        #[arg(long)]
        idempotency_key: Option<String>,
    },
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    Show {
        id: String,
    },
    Release {
        id: String,
    },
}

/// Calls `M` with its typed request and reads its typed answer.
pub async fn call_typed<M: bc_kernel::ApiMethod>(
    client: &ApiClient,
    request: &M::Request,
) -> anyhow::Result<M::Response> {
    let v = client
        .call(M::GROUP, M::METHOD, serde_json::to_value(request)?)
        .await?;
    serde_json::from_value(v).map_err(|e| {
        anyhow::anyhow!(
            "{}.{}: the control plane's answer is not what this CLI reads ({e}); use a CLI of the server's version",
            M::GROUP,
            M::METHOD
        )
    })
}

/// The reservations table: one row each.
fn reservation_table<'a>(
    rows: impl IntoIterator<Item = &'a bc_core::api::capacity::Reservation>,
) -> Table {
    let now = output::now_ms();
    let mut t = Table::new(&["ID", "TENANT", "STATE", "GPUS", "AGE", "EXPIRES"])
        .wide(&["POOL", "NODE:GPU"]);
    for r in rows {
        let gpus: Vec<String> = r
            .gpus
            .iter()
            .map(|g| format!("{}:{}", g.node, g.uuid))
            .collect();
        t.row(vec![
            r.id.to_string(),
            r.tenant.to_string(),
            r.state.to_string(),
            r.gpus.len().to_string(),
            output::age(Some(r.created_at_ms), now),
            output::age(r.expires_at_ms, now),
            r.request
                .pool
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            gpus.join(","),
        ]);
    }
    t
}

pub async fn reservations(
    client: &ApiClient,
    out: Format,
    command: ReservationCommand,
) -> anyhow::Result<()> {
    use bc_core::api::capacity::{CreateReservation, ListReservations, ReservationById};
    use bc_mod_capacity::admission::{
        CreateReservationMethod, GetReservationMethod, ListReservationsMethod,
        ReleaseReservationMethod,
    };
    let by_id = |id: &str| -> anyhow::Result<ReservationById> {
        Ok(ReservationById {
            id: bc_core::ids::ReservationId::parse(id)?,
        })
    };
    match command {
        ReservationCommand::Create {
            tenant,
            gpus,
            model,
            topology,
            duration,
            pool,
            idempotency_key,
        } => {
            let topology = serde_json::from_value(json!(topology))
                .map_err(|_| anyhow::anyhow!("--topology {topology:?}: use node, nvlink or any"))?;
            let pool = pool.map(|p| bc_core::ids::PoolId::parse(&p)).transpose()?;
            let request = CreateReservation {
                tenant,
                gpus,
                model,
                topology,
                duration_s: u32::try_from(duration.as_secs())
                    .map_err(|_| anyhow::anyhow!("--duration {duration:?} is too long"))?,
                pool,
                idempotency_key,
            };
            let answer = call_typed::<CreateReservationMethod>(client, &request).await?;
            output::print(out, &answer, || {
                reservation_table([&answer.reservation.reservation])
            })?;
        }
        ReservationCommand::List { tenant } => {
            let request = ListReservations {
                tenant,
                limit: None,
            };
            let list = call_typed::<ListReservationsMethod>(client, &request).await?;
            output::print(out, &list, || {
                reservation_table(list.reservations.iter().map(|r| &r.reservation))
            })?;
        }
        ReservationCommand::Show { id } => {
            let answer = call_typed::<GetReservationMethod>(client, &by_id(&id)?).await?;
            if out != Format::Table && out != Format::Wide {
                return output::print(out, &answer, Table::default);
            }
            let shown = &answer.reservation;
            let r = &shown.reservation;
            print!("{}", reservation_table([r]).render(out == Format::Wide));
            if let Some(e) = &r.error {
                println!("error: {e}");
            }
            if let Some(d) = &shown.delivery {
                println!("delivery: {}", delivery_name(d.state));
                for n in &d.nodes {
                    println!(
                        "  node {} generation {}: {}{}",
                        n.node,
                        n.generation,
                        delivery_name(n.state),
                        n.message
                            .as_deref()
                            .map(|m| format!(": {m}"))
                            .unwrap_or_default()
                    );
                }
            }
        }
        ReservationCommand::Release { id } => {
            let answer = call_typed::<ReleaseReservationMethod>(client, &by_id(&id)?).await?;
            output::print(out, &answer, || {
                reservation_table([&answer.reservation.reservation])
            })?;
        }
    }
    Ok(())
}

fn delivery_name(d: bc_core::reservation::Delivery) -> &'static str {
    match d {
        bc_core::reservation::Delivery::Pending => "pending",
        bc_core::reservation::Delivery::Applied => "applied",
        bc_core::reservation::Delivery::Failed => "failed",
    }
}
