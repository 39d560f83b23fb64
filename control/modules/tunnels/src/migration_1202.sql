-- bc-mod-tunnels (1202): the API process that relays each open tunnel (its worker id in the `api` role), so the cap
-- of tunnels per principal counts across every API process, and the rows of a process that died are closed LOST.
ALTER TABLE tunnel_connections ADD COLUMN api_worker text;
CREATE INDEX tunnel_connections_open ON tunnel_connections (principal_id) WHERE stopped_at IS NULL;
