-- bc-mod-tunnels (1200): pools' tunnel port allowlists and the audit of tunnel connections.
CREATE TABLE tunnel_pool_ports (
    pool_id  text PRIMARY KEY REFERENCES pools (id) ON DELETE CASCADE,
    ports    integer[] NOT NULL
);

-- One row per tunnel connection, refused ones included: who, to which node and port, when, bytes, how it ended.
CREATE TABLE tunnel_connections (
    id               uuid PRIMARY KEY,
    principal_id     text NOT NULL,
    node_id          text NOT NULL,
    pool_id          text NOT NULL,
    port             integer NOT NULL,
    started_at       timestamptz NOT NULL DEFAULT now(),
    stopped_at       timestamptz,
    bytes_from_node  bigint NOT NULL DEFAULT 0,
    bytes_to_node    bigint NOT NULL DEFAULT 0,
    outcome          text NOT NULL,
    reason           text NOT NULL DEFAULT ''
);
CREATE INDEX tunnel_connections_by_node ON tunnel_connections (node_id, started_at DESC);
CREATE INDEX tunnel_connections_by_time ON tunnel_connections (started_at DESC);
