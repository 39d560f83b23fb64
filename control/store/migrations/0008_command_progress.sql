-- The latest progress a node reported for a running command (e.g. bytes written, rate and ETA of an image stream).
-- Advisory and unsigned; the daemon sends at most about one report a second per command, and the gateway keeps
-- only the latest, for commands in state 'sent' of the reporting node.
ALTER TABLE commands ADD COLUMN progress jsonb;
ALTER TABLE commands ADD COLUMN progress_at timestamptz;
