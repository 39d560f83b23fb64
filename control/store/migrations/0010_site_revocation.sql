-- A revoked site: its agents are refused at the gateways' TLS handshake (their SPIFFE ID spiffe://<domain>/site/<id>
-- joins the revoked-identity set each gateway reads), by the site services, and by enrollment. Never cleared.
ALTER TABLE sites ADD COLUMN revoked_at timestamptz;
CREATE INDEX sites_revoked_at ON sites (revoked_at) WHERE revoked_at IS NOT NULL;
