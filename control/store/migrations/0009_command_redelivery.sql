-- At-least-once delivery of commands: the session epoch a command was last sent on. A command in state 'sent'
-- whose node opened a newer session (the old one may have died before the daemon received it) is sent again on
-- the new one while its deadline has not passed; the daemon runs an id once and answers a repeat with its result.
ALTER TABLE commands ADD COLUMN sent_epoch bigint;
ALTER TABLE commands ADD COLUMN deliveries integer NOT NULL DEFAULT 0;
CREATE INDEX commands_open ON commands (node_id) WHERE state IN ('pending', 'sent');
