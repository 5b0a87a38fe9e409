-- Gates on the locked row (docs/design.md, "Gate on the locked row").
--
-- A claim locks one lease_slots row and decides, in the same statement, on columns of the
-- credential row that it only reads from its snapshot. PostgreSQL re-checks a locked row that
-- changed after the snapshot, never a row it did not lock, so an operator's change committed in
-- between (a disable, a pool move, a new secret) was granted past. From here on every change of
-- what a claim decides on moves the credential's configuration version, and the same transaction
-- writes it into every slot row of the credential; a claim grants only where the slot row's
-- version equals the version of the credential row it ranked with (sql/lease.sql, CLAIM).
ALTER TABLE credentials ADD COLUMN config_version bigint NOT NULL DEFAULT 0;
ALTER TABLE lease_slots ADD COLUMN config_version bigint NOT NULL DEFAULT 0;

-- A lowered limit under load: the credential keeps its `limit` slot rows whose leases end last
-- (claimable again as each lease ends) and marks the others `surplus`: never claimed, removed by
-- the next fit. Before, every row was closed until a fit ran (the cleanup pass, up to a minute
-- later); such rows stay closed here until that fit.
ALTER TABLE lease_slots ADD COLUMN surplus boolean NOT NULL DEFAULT false;
UPDATE lease_slots SET surplus = true WHERE over_limit;
ALTER TABLE lease_slots
    ADD CONSTRAINT lease_slots_surplus_over_limit CHECK (NOT surplus OR over_limit);
