-- A node key belongs to one live node. Besides being true by construction (keys are random), this lets a retried
-- join be recognised by its key at commit time, with no read on the hot path.
CREATE UNIQUE INDEX nodes_join_key ON nodes (join_key_hash) WHERE state <> 'revoked';
DROP INDEX nodes_join_retry;
