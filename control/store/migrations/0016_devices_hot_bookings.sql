-- A device's booking (`reservation_id` set by a placement, cleared by a release, an expiry, a lost race or an
-- instance's removal) is the most frequent write in the store: one per GPU admitted and one per GPU freed. The
-- partial index `devices_reservation` named `reservation_id`, so every booking was written into each of the table's
-- four indexes (at 2,000 admissions/s, 4 of the 14 index entries written per admission; `pg_waldump --stats`,
-- BENCHMARKS.md). Every lookup of a reservation's devices now goes by its nodes (`devices_node`: a reservation
-- records its nodes when placed, an instance its node) or by device id, so no index names `reservation_id`, and a
-- fifth of each page written from now on is left free for a new version beside the old: bookings are HOT updates.
DROP INDEX devices_reservation;
ALTER TABLE devices SET (fillfactor = 80);
