-- Reservations: bookable devices (atoms), reservations and their idempotency keys, the outbox to daemons, the work
-- queue, process membership and shard leases.

-- The shard (0..255) of a subject: the first byte of its MD5. Immutable, so it can back generated columns; the Rust
-- side never computes it, it reads it.
CREATE FUNCTION bc_shard(text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT get_byte(decode(md5($1), 'hex'), 0)::smallint $$;

-- Bookable atoms. A GPU row is derived from the node's `gpus` inventory section; `reservation_id` is the booking.
CREATE TABLE devices (
    id              text PRIMARY KEY,           -- <node id>/gpu/<uuid>
    node_id         text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    kind            text NOT NULL DEFAULT 'gpu',
    idx             integer NOT NULL,
    uuid            text NOT NULL,
    model           text NOT NULL,
    -- NVLink clique (fabric cluster + clique id) when the GPU reports one; GPUs sharing it are NVLink peers.
    clique          text,
    present         boolean NOT NULL DEFAULT true,
    reservation_id  text
);
CREATE INDEX devices_node ON devices (node_id);
CREATE INDEX devices_reservation ON devices (reservation_id) WHERE reservation_id IS NOT NULL;

CREATE TABLE reservations (
    id            text PRIMARY KEY,
    shard         smallint NOT NULL GENERATED ALWAYS AS (bc_shard(id)) STORED,
    tenant_id     text NOT NULL REFERENCES tenants (id),
    principal_id  text NOT NULL,
    request       jsonb NOT NULL,
    state         text NOT NULL CHECK (state IN ('pending', 'placed', 'failed', 'released', 'expired')),
    node_ids      text[] NOT NULL DEFAULT '{}',
    gpus          jsonb NOT NULL DEFAULT '[]',
    error         text,
    duration_s    integer NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    placed_at     timestamptz,
    expires_at    timestamptz,
    ended_at      timestamptz
);
CREATE INDEX reservations_pending ON reservations (shard, created_at) WHERE state = 'pending';
CREATE INDEX reservations_tenant ON reservations (tenant_id, created_at);

-- Admission's tx 1: the request under its idempotency key. The body hash tells a replay from a conflicting reuse.
CREATE TABLE idempotency (
    principal_id    text NOT NULL,
    key             text NOT NULL,
    body_hash       text NOT NULL,
    reservation_id  text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (principal_id, key)
);

-- What must reach a daemon, written in the same transaction as the change that caused it. The sink deletes a row
-- once it has poked the gateways; the gateways' own pull converges without it.
CREATE TABLE outbox (
    id          bigserial PRIMARY KEY,
    shard       smallint NOT NULL GENERATED ALWAYS AS (bc_shard(node_id)) STORED,
    node_id     text NOT NULL,
    kind        text NOT NULL,
    generation  bigint NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_shard ON outbox (shard, id);

-- Delayed work (reservation expiry, …): claimed with SKIP LOCKED by the owner of its shard.
CREATE TABLE work_queue (
    id          bigserial PRIMARY KEY,
    kind        text NOT NULL,
    subject     text NOT NULL,
    shard       smallint NOT NULL GENERATED ALWAYS AS (bc_shard(subject)) STORED,
    run_at      timestamptz NOT NULL,
    attempts    integer NOT NULL DEFAULT 0,
    last_error  text,
    UNIQUE (kind, subject)
);
CREATE INDEX work_queue_due ON work_queue (shard, run_at);

-- Live processes of each role; a row whose lease has run out is a dead process.
CREATE TABLE workers (
    role        text NOT NULL,
    id          text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (role, id)
);

-- One owner per (role, shard). `fence` increases whenever ownership changes hands; work is committed only while the
-- committing process still holds the lease with the fence it read.
CREATE TABLE shard_leases (
    role        text NOT NULL,
    shard       smallint NOT NULL,
    owner       text NOT NULL,
    fence       bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (role, shard)
);

ALTER TABLE nodes ADD COLUMN shard smallint NOT NULL GENERATED ALWAYS AS (bc_shard(id)) STORED;
