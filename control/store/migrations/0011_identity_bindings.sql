-- Identity bound to the current key, and a GPU bound to one node.

-- Node keys a reclaim superseded: their certificates are revoked. Gateways refuse them at the TLS handshake (each
-- reads the keys revoked since its last read, with the revoked identities); a session's open and a renewal also
-- compare the presented key with the node's current one (nodes.public_key), so nothing waits for that read.
CREATE TABLE node_key_revocations (
    -- SHA-256 (hex) of the superseded key's SubjectPublicKeyInfo (what nodes.join_key_hash held).
    key_hash     text PRIMARY KEY,
    node_id      text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    -- The last certificate issued to that key.
    cert_serial  text NOT NULL,
    reason       text NOT NULL,
    revoked_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX node_key_revocations_at ON node_key_revocations (revoked_at);

-- A GPU UUID belongs to one node at a time. A live node reporting a UUID another live node holds gets a row that is
-- not present (not bookable) and names the holder; the holder's release hands it over.
ALTER TABLE devices
    ADD COLUMN conflict_with text,
    ADD COLUMN conflict_since timestamptz;
-- Revoked nodes hold no GPU.
UPDATE devices d SET present = false FROM nodes n WHERE n.id = d.node_id AND n.state = 'revoked' AND d.present;
-- Where live nodes already report one UUID twice, the booked row (else the first by id) keeps it; the others wait.
WITH ranked AS (
    SELECT id,
           row_number() OVER w AS r,
           first_value(node_id) OVER w AS holder
    FROM devices WHERE present
    WINDOW w AS (PARTITION BY uuid ORDER BY reservation_id IS NULL, id)
)
UPDATE devices d SET present = false, conflict_with = ranked.holder, conflict_since = now()
FROM ranked WHERE ranked.id = d.id AND ranked.r > 1;
CREATE UNIQUE INDEX devices_one_holder ON devices (uuid) WHERE present;
CREATE INDEX devices_conflicts ON devices (node_id) WHERE conflict_with IS NOT NULL;
