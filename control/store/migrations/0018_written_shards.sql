-- Shard and pool columns stop being generated: each writer writes them, `bc_shard(<key>)` and `request ->> 'pool'`
-- in its own statement. PostgreSQL 15 prepares a stored generated column's expression on every statement that
-- inserts into or updates its table (an UPDATE recomputes every generated column, whatever it sets), and preparing
-- `bc_shard` inlines a SQL function, which parses its body each time. In a statement's text the same call is planned
-- once per prepared statement: 5.2 µs per single-row INSERT against 11.4 µs with the generated column (a PL/pgSQL loop
-- of 50,000 inserts on PostgreSQL 15, cached plan, no network). `bc_shard` stays the only definition of a shard, and
-- NOT NULL refuses a writer that forgets it. Values are kept; no table is rewritten.
ALTER TABLE reservations ALTER COLUMN shard DROP EXPRESSION, ALTER COLUMN pool DROP EXPRESSION;
ALTER TABLE outbox ALTER COLUMN shard DROP EXPRESSION;
ALTER TABLE work_queue ALTER COLUMN shard DROP EXPRESSION;
ALTER TABLE nodes ALTER COLUMN shard DROP EXPRESSION;
