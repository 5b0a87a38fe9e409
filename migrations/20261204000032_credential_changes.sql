-- Incremental candidate views: a service reads again only what changed in a pool since its last
-- read. Each credential row names the transaction that last changed who may be leased from it
-- (`changed_by`, the same changes that move the pool's version), and a credential that leaves a
-- pool (deleted, or moved to another) leaves a row in credential_departures for a while. A read
-- notes its snapshot's xmin: every transaction below it had ended before the read, so a later
-- read of the rows with `changed_by` (or `departed_by`) at or above it misses no change.

-- NULL: not changed since before this migration (a service's first read of a pool reads it whole).
ALTER TABLE credentials ADD COLUMN changed_by xid8;

CREATE TABLE credential_departures (
    provider text NOT NULL,
    pool text NOT NULL,
    key_id text NOT NULL,
    departed_by xid8 NOT NULL DEFAULT pg_current_xact_id(),
    departed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX credential_departures_pool ON credential_departures (provider, pool, departed_at);
