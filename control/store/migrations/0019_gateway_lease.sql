-- A gateway publishes the lease it keeps: it refreshes its row within a third of it, and the `controllers` role
-- takes the sessions of a gateway whose row stayed unchanged for longer than it for dead (the node goes offline).
-- Rows of gateways that predate the column get 30 s, the lease a default gateway publishes.
ALTER TABLE gateways ADD COLUMN lease_ms bigint NOT NULL DEFAULT 30000;
