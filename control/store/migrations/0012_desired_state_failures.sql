-- What a node reported when it could not apply its desired state, and how far each placed reservation's booking
-- has reached its nodes. A failed acknowledgement no longer advances `acked_generation` (which is now the newest
-- generation the node applied), so a new session sends the generation again; the node also retries it itself.
ALTER TABLE nodes
    -- The newest generation the node reported it could not apply (0: none). The node is failing to apply while
    -- this is above acked_generation.
    ADD COLUMN failed_generation bigint NOT NULL DEFAULT 0,
    -- The node's reason for that failure, as it reported it.
    ADD COLUMN ack_message text,
    -- When the current run of failures began.
    ADD COLUMN ack_failed_at timestamptz;

-- Per node of a placed reservation, the desired generation that first carried its booking ({node id: generation}):
-- the booking has reached a node once it applied that generation or a newer one.
ALTER TABLE reservations ADD COLUMN generations jsonb NOT NULL DEFAULT '{}';
