-- Identity, IAM projection, pools, join tokens, nodes and audit events: what `bcd join` needs.

CREATE TABLE tenants (
    id          text PRIMARY KEY,
    name        text NOT NULL,
    is_root     boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX tenants_one_root ON tenants (is_root) WHERE is_root;

CREATE TABLE principals (
    id            text PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants (id),
    name          text NOT NULL,
    api_key_id    text UNIQUE,
    -- SHA-256 (hex) of the API key's secret; the secret itself is never stored.
    api_key_hash  text,
    disabled      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE grants (
    principal_id  text NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
    permission    text NOT NULL,
    scope         text NOT NULL,
    PRIMARY KEY (principal_id, permission, scope)
);

CREATE TABLE pools (
    id             text PRIMARY KEY,
    tenant_id      text NOT NULL REFERENCES tenants (id),
    name           text NOT NULL,
    allow_reclaim  boolean NOT NULL DEFAULT true,
    -- Acceptance checks a node must pass before adoption, in order.
    acceptance     jsonb NOT NULL DEFAULT '["diag.nvml"]',
    created_at     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE join_tokens (
    id           text PRIMARY KEY,
    pool_id      text NOT NULL REFERENCES pools (id),
    -- SHA-256 (hex) of the token secret; the secret itself is never stored.
    secret_hash  text NOT NULL,
    uses_total   integer NOT NULL CHECK (uses_total > 0),
    uses_left    integer NOT NULL CHECK (uses_left >= 0),
    expires_at   timestamptz NOT NULL,
    revoked_at   timestamptz,
    expect       jsonb NOT NULL DEFAULT '{}',
    reclaim      boolean NOT NULL DEFAULT false,
    created_by   text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX join_tokens_pool ON join_tokens (pool_id);

CREATE TABLE nodes (
    id              text PRIMARY KEY,
    pool_id         text NOT NULL REFERENCES pools (id),
    state           text NOT NULL CHECK (state IN ('adopting', 'adopted', 'draining', 'failed', 'revoked')),
    hardware_key    text,
    claims          jsonb NOT NULL,
    join_token_id   text REFERENCES join_tokens (id),
    -- SHA-256 (hex) of the node key's SubjectPublicKeyInfo at its latest join.
    join_key_hash   text NOT NULL,
    joined_at       timestamptz NOT NULL,
    cert_serial     text NOT NULL,
    cert_not_after  timestamptz NOT NULL,
    session_epoch   bigint NOT NULL DEFAULT 0,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
-- One live node per machine: a second join of the same hardware must reclaim (or the old node be revoked).
CREATE UNIQUE INDEX nodes_hardware_key ON nodes (hardware_key) WHERE hardware_key IS NOT NULL AND state <> 'revoked';
CREATE INDEX nodes_join_retry ON nodes (join_token_id, join_key_hash);
CREATE INDEX nodes_pool ON nodes (pool_id);

CREATE TABLE audit_events (
    id       bigserial PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text NOT NULL,
    action   text NOT NULL,
    subject  text NOT NULL,
    detail   jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_events_subject ON audit_events (subject, at);
