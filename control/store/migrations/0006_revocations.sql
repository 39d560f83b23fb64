-- Revocations reach the gateways' TLS handshake: each gateway reads the nodes revoked since its last read.
CREATE INDEX nodes_revoked_at ON nodes (updated_at) WHERE state = 'revoked';
