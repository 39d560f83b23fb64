-- As the base schema's migration 18: the shard is written by the statement that inserts the machine
-- (`bc_shard(mac)`), not generated on every insert and update.
ALTER TABLE metal_machines ALTER COLUMN shard DROP EXPRESSION;
