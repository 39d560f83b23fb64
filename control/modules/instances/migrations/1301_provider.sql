-- Provider pools and the provider workflow; `deleting`: an instance taken off its node or its provider whose end is
-- not confirmed yet (it still holds what it held).

-- A provider pool's configuration (bc-core's ProviderPool: endpoint, region, the credentials' secret reference,
-- instance types, images); NULL for a vps-host pool.
ALTER TABLE instance_pools ADD COLUMN provider jsonb;

ALTER TABLE instances DROP CONSTRAINT instances_state_check;
ALTER TABLE instances ADD CONSTRAINT instances_state_check
    CHECK (state IN ('pending', 'placed', 'failed', 'deleting', 'deleted'));
-- When a delete started (the deadline of the node's confirmation runs from here).
ALTER TABLE instances ADD COLUMN deleting_at timestamptz;
-- The node's desired generation that took a hosted instance off it: its delete is confirmed once the node applied it
-- and no longer reports the instance.
ALTER TABLE instances ADD COLUMN removal_generation bigint;

-- One row per instance of a provider pool while the provider workflow has something to do for it: its record
-- (bc-core's workflow::Record) and when it is next due. Shard-owned by the controllers role.
CREATE TABLE instance_provider (
    instance_id  text PRIMARY KEY REFERENCES instances (id),
    pool_id      text NOT NULL REFERENCES pools (id),
    shard        smallint NOT NULL GENERATED ALWAYS AS (bc_shard(instance_id)) STORED,
    record       jsonb NOT NULL DEFAULT '{}',
    next_at_ms   bigint NOT NULL DEFAULT 0,
    -- The instance generation the record's last pass saw.
    generation   bigint NOT NULL DEFAULT 0,
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX instance_provider_due ON instance_provider (shard, next_at_ms);
