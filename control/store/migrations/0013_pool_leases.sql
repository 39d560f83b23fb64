-- The capacity module's pool-lease placer (`[capacity] placer = "pool-lease"`): one scheduler process holds each
-- pool's lease (`scheduler/pool:<pool>`) and is that pool's only booking writer. `fence` increases whenever the
-- holder changes; a booking commits only inside a transaction that holds the row FOR SHARE with the holder's fence.
CREATE TABLE pool_leases (
    pool        text PRIMARY KEY,
    owner       text NOT NULL,
    fence       bigint NOT NULL,
    expires_at  timestamptz NOT NULL
);

-- Each reservation's pool, from its request (none: any pool), to claim pending ones by pool.
ALTER TABLE reservations ADD COLUMN pool text GENERATED ALWAYS AS (request ->> 'pool') STORED;
CREATE INDEX reservations_pending_pool ON reservations (pool, created_at) WHERE state = 'pending';
