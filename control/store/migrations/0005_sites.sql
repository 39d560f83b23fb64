-- Sites (rack management hosts running `bcd site`), their enrollment tokens and agents, the boot lease that picks
-- the one agent of a site that serves boot, the machines a site netboots, and secrets brokered to sites.

CREATE TABLE sites (
    id          text PRIMARY KEY,
    name        text NOT NULL,
    created_by  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE site_tokens (
    id           text PRIMARY KEY,
    site_id      text NOT NULL REFERENCES sites (id),
    -- SHA-256 (hex) of the token secret; the secret itself is never stored.
    secret_hash  text NOT NULL,
    uses_total   integer NOT NULL CHECK (uses_total > 0),
    uses_left    integer NOT NULL CHECK (uses_left >= 0),
    expires_at   timestamptz NOT NULL,
    revoked_at   timestamptz,
    created_by   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX site_tokens_site ON site_tokens (site_id);

-- One row per enrolled agent key: a retried enrollment with the same token and key finds its row and spends no use.
CREATE TABLE site_agents (
    site_id         text NOT NULL REFERENCES sites (id),
    -- SHA-256 (hex) of the agent key's SubjectPublicKeyInfo; also the agent's id in boot leases (first 16 chars).
    key_hash        text NOT NULL,
    site_token_id   text NOT NULL REFERENCES site_tokens (id),
    cert_serial     text NOT NULL,
    cert_not_after  timestamptz NOT NULL,
    enrolled_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (site_id, key_hash)
);

-- One boot lease per site. `fence` increases whenever the holder changes.
CREATE TABLE boot_leases (
    site_id     text PRIMARY KEY REFERENCES sites (id),
    holder      text NOT NULL,
    fence       bigint NOT NULL,
    expires_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Machines a site may netboot: `boot` is {kernel, initrd, cmdline}, or NULL when the machine must not netboot.
CREATE TABLE machines (
    mac         text PRIMARY KEY CHECK (mac ~ '^([0-9a-f]{2}:){5}[0-9a-f]{2}$'),
    site_id     text NOT NULL REFERENCES sites (id),
    boot        jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX machines_site ON machines (site_id);

-- Secrets (BMC credentials) sealed at rest with the control plane's secret key (AES-256-GCM; the key never enters
-- the database). A secret belongs to one site: only that site's agents may ask for it.
CREATE TABLE secrets (
    site_id     text NOT NULL REFERENCES sites (id),
    name        text NOT NULL,
    nonce       bytea NOT NULL,
    ciphertext  bytea NOT NULL,
    created_by  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (site_id, name)
);
