-- Artifacts (kernels, initramfs, images) the control plane keeps content-addressed: the bytes live in its state
-- directory under artifacts/sha256/<hex>; this row is what is known about them. Site agents fetch the ones their
-- site's netboot table references and verify length and hash themselves.
CREATE TABLE artifacts (
    sha256     text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    name       text NOT NULL,
    size       bigint NOT NULL CHECK (size >= 0),
    created_by text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
