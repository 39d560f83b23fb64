-- `reservations_pending_pool` serves the pool-lease placer's scan of a pool's pending reservations
-- (`pool = ANY(...)`, which no reservation without a pool matches). It held every pending reservation, so each
-- admission without a pool (every one under the default shard placer) wrote an entry that nothing reads. It now
-- holds only reservations that name a pool.
DROP INDEX reservations_pending_pool;
CREATE INDEX reservations_pending_pool ON reservations (pool, created_at) WHERE state = 'pending' AND pool IS NOT NULL;
