-- Sessions: liveness, desired state and its acknowledgement, inventory sections, commands to nodes.
ALTER TABLE nodes
    ADD COLUMN online boolean NOT NULL DEFAULT false,
    ADD COLUMN last_seen_at timestamptz,
    ADD COLUMN desired_generation bigint NOT NULL DEFAULT 0,
    ADD COLUMN desired_spec jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN acked_generation bigint NOT NULL DEFAULT 0,
    ADD COLUMN ack_outcome text,
    ADD COLUMN conditions jsonb NOT NULL DEFAULT '[]',
    -- The node key's public point (uncompressed P-256) at its latest join: verifies the node's signed results.
    ADD COLUMN public_key bytea;

CREATE TABLE inventory_sections (
    node_id     text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    name        text NOT NULL,
    -- SHA-256 (hex) of the payload as the node sent it.
    hash        text NOT NULL,
    payload     jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, name)
);

CREATE TABLE commands (
    id           text PRIMARY KEY,
    node_id      text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    kind         text NOT NULL,
    args         jsonb NOT NULL DEFAULT '{}',
    state        text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'done', 'failed', 'expired')),
    created_at   timestamptz NOT NULL DEFAULT now(),
    sent_at      timestamptz,
    deadline_at  timestamptz NOT NULL,
    finished_at  timestamptz,
    -- The signed envelope's payload (JSON) once its signature verified against the node's certificate key.
    result       jsonb,
    envelope     bytea,
    error        text,
    -- Set when a controller has acted on the result.
    consumed_at  timestamptz
);
CREATE INDEX commands_pending ON commands (node_id) WHERE state = 'pending';
CREATE INDEX commands_node ON commands (node_id, created_at);
CREATE INDEX commands_unconsumed ON commands (kind) WHERE consumed_at IS NULL AND state IN ('done', 'failed', 'expired');
