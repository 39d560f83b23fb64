-- Which gateway process holds each node's session (written when the session opens), and where each gateway is
-- reached by the other control-plane processes (the tunnel relay: an API process opens a node's tunnel through the
-- gateway that holds its session). A gateway publishes its row at start and refreshes `seen_at` while it runs.
ALTER TABLE nodes ADD COLUMN gateway_id text;

CREATE TABLE gateways (
    id          text PRIMARY KEY,
    -- https://host:port of the gateway itself (never a balancer in front of several).
    relay_url   text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now()
);
