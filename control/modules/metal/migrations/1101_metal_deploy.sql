-- The metal flow's deploy and its site reports (bc-mod-metal).
-- Join tokens minted for an installed system: single use, reclaiming the machine's node. The node that joined with
-- one (nodes.join_token_id) is the installed system, as a node that joined with a boot token is the ramdisk.
CREATE TABLE metal_join_tokens (
    id          text PRIMARY KEY,
    mac         text NOT NULL REFERENCES metal_machines (mac) ON DELETE CASCADE,
    attempt_id  bigint NOT NULL,
    -- The node the token reclaims.
    node_id     text NOT NULL,
    created_ms  bigint NOT NULL,
    used_ms     bigint,
    UNIQUE (mac, attempt_id)
);

-- What each site's agent last reported: where it serves boot HTTP and what its cache holds (deploy images are
-- streamed from there once it holds them).
CREATE TABLE metal_sites (
    site_id      text PRIMARY KEY REFERENCES sites (id) ON DELETE CASCADE,
    boot_url     text NOT NULL,
    -- The artifacts (sha256 hex) the agent holds in its cache, as it last reported them.
    cached       text[] NOT NULL DEFAULT '{}',
    reported_ms  bigint NOT NULL
);
