-- The metal flow (bc-mod-metal). One row per enrolled machine with its flow record (bc_core::metal::Machine as
-- JSON, the planner's input and output), the timeline and transitions it records, the BMC commands it sends to the
-- machine's site, the ramdisk commands it queued on the machine's node, and the single-use boot tokens it minted.

CREATE TABLE metal_machines (
    mac             text PRIMARY KEY REFERENCES machines (mac),
    site_id         text NOT NULL REFERENCES sites (id),
    shard           smallint NOT NULL GENERATED ALWAYS AS (bc_shard(mac)) STORED,
    bmc_address     text NOT NULL,
    -- The name of the site secret holding the BMC credentials (never the credentials).
    bmc_credentials text NOT NULL,
    record          jsonb NOT NULL,
    -- Copies of the record's state for filters and the executor's scan.
    phase           text NOT NULL,
    failed          boolean NOT NULL,
    deadline_ms     bigint,
    -- The node a ramdisk joined as with one of this machine's boot tokens, and the installed system's node.
    ramdisk_node    text,
    installed_node  text,
    -- When the site last saw DHCP from the boot MAC.
    last_dhcp_ms    bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX metal_machines_scan ON metal_machines (shard) WHERE NOT failed;
CREATE INDEX metal_machines_site ON metal_machines (site_id);

-- The timeline as `metal show` reads it: one row per attempt at a phase (seq: its place in the record's timeline).
CREATE TABLE metal_timeline (
    mac       text NOT NULL REFERENCES metal_machines (mac) ON DELETE CASCADE,
    seq       integer NOT NULL,
    phase     text NOT NULL,
    start_ms  bigint NOT NULL,
    end_ms    bigint,
    attempt   integer NOT NULL,
    outcome   text,
    PRIMARY KEY (mac, seq)
);

-- BMC work for the machine's site agent: `op` is a bc_core::metal::BmcOp, `outcome` a bc_core::metal::Outcome.
CREATE TABLE metal_bmc_commands (
    id           text PRIMARY KEY,
    mac          text NOT NULL REFERENCES metal_machines (mac) ON DELETE CASCADE,
    site_id      text NOT NULL REFERENCES sites (id),
    attempt_id   bigint NOT NULL,
    step         text NOT NULL,
    op           jsonb NOT NULL,
    state        text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'done', 'failed', 'cancelled')),
    created_ms   bigint NOT NULL,
    deadline_ms  bigint NOT NULL,
    sent_ms      bigint,
    finished_ms  bigint,
    outcome      jsonb,
    UNIQUE (mac, attempt_id, step)
);
CREATE INDEX metal_bmc_open ON metal_bmc_commands (site_id, created_ms) WHERE state IN ('pending', 'sent');

-- Ramdisk commands (rows of `commands`) queued for a machine's attempt.
CREATE TABLE metal_commands (
    command_id  text PRIMARY KEY REFERENCES commands (id) ON DELETE CASCADE,
    mac         text NOT NULL REFERENCES metal_machines (mac) ON DELETE CASCADE,
    attempt_id  bigint NOT NULL,
    step        text NOT NULL,
    UNIQUE (mac, attempt_id, step)
);

-- Single-use boot tokens: one per netboot attempt; only the hash of the secret is kept.
CREATE TABLE metal_boot_tokens (
    id           text PRIMARY KEY,
    mac          text NOT NULL REFERENCES metal_machines (mac) ON DELETE CASCADE,
    attempt_id   bigint NOT NULL,
    secret_hash  text NOT NULL,
    created_ms   bigint NOT NULL,
    used_ms      bigint,
    node_id      text,
    UNIQUE (mac, attempt_id)
);
