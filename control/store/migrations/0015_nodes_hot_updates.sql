-- A node's row is written often: each placement and release (its desired state), each session open and heartbeat
-- batch, each certificate renewal. PostgreSQL writes such an update beside the old version on the same page, with no
-- new entry in any index (a HOT update), only when no indexed column changed and the page has room. Neither held:
--   * `nodes_revoked_at` indexed `updated_at`, which nearly every write sets, so every write of a node also wrote an
--     entry into each of the table's indexes. The revocation feed now reads its own column, `revoked_at`, set by the
--     trigger below when a node becomes revoked (whichever statement revokes it), and `updated_at` is indexed nowhere.
--   * pages were filled to the brim, leaving no room for a new version beside the old. A fifth of each page written
--     from now on is left free for one.
ALTER TABLE nodes ADD COLUMN revoked_at timestamptz;
UPDATE nodes SET revoked_at = updated_at WHERE state = 'revoked';

CREATE FUNCTION bc_nodes_revoked_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.revoked_at := now();
    RETURN NEW;
END $$;
-- Fires only for statements that set `state`, and only on the change into `revoked`.
CREATE TRIGGER nodes_revoked_at BEFORE UPDATE OF state ON nodes
    FOR EACH ROW WHEN (NEW.state = 'revoked' AND OLD.state IS DISTINCT FROM 'revoked')
    EXECUTE FUNCTION bc_nodes_revoked_at();

CREATE INDEX nodes_revoked_since ON nodes (revoked_at) WHERE state = 'revoked';
DROP INDEX nodes_revoked_at;
ALTER TABLE nodes SET (fillfactor = 80);
