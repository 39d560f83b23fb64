-- bc-mod-tunnels (1201): the gateway each tunnel connection went through (the session row's gateway when it was
-- opened; NULL for refusals before the gateway was chosen).
ALTER TABLE tunnel_connections ADD COLUMN gateway_id text;
