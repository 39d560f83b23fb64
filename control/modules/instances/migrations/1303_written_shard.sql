-- As the base schema's migration 18: the shard is written by the statement that inserts the row
-- (`bc_shard(instance_id)`), not generated on every insert and update.
ALTER TABLE instance_provider ALTER COLUMN shard DROP EXPRESSION;
