-- Instances (VPS): which pools host them, the instances, and their idempotency keys (admission's tx 1).

-- A pool's class for instances: `vps-host` (its nodes run bcd with [vmm]) or `provider` (a provider's API).
CREATE TABLE instance_pools (
    pool_id     text PRIMARY KEY REFERENCES pools (id),
    class       text NOT NULL CHECK (class IN ('vps-host', 'provider')),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per instance. A placed instance holds its node's atoms: vcpus, memory_mib and disk_gib count against
-- what the node's inventory advertises, and its GPUs are devices rows whose booking (reservation_id) is its id,
-- so a GPU is never booked to a reservation and an instance at once.
CREATE TABLE instances (
    id            text PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants (id),
    principal_id  text NOT NULL,
    pool_id       text NOT NULL REFERENCES pools (id),
    request       jsonb NOT NULL,
    state         text NOT NULL CHECK (state IN ('pending', 'placed', 'failed', 'deleted')),
    node_id       text REFERENCES nodes (id),
    vcpus         integer NOT NULL,
    memory_mib    integer NOT NULL,
    disk_gib      integer NOT NULL,
    gpus          jsonb NOT NULL DEFAULT '[]',
    power         text NOT NULL DEFAULT 'running' CHECK (power IN ('running', 'stopped')),
    reboots       bigint NOT NULL DEFAULT 0,
    -- Raised with every change to what the node is asked to do with this instance.
    generation    bigint NOT NULL DEFAULT 1,
    error         text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    placed_at     timestamptz,
    deleted_at    timestamptz
);
CREATE INDEX instances_node ON instances (node_id) WHERE state = 'placed';
CREATE INDEX instances_tenant ON instances (tenant_id, created_at);

CREATE TABLE instance_idempotency (
    principal_id  text NOT NULL,
    key           text NOT NULL,
    body_hash     text NOT NULL,
    instance_id   text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (principal_id, key)
);
