-- A lowered tenant cap reopens on its own, as a lowered credential limit does, and fair share
-- knows what a waiting request would reserve. Tables only; what uses them is in sql/tenants.sql
-- (credpool_fit_tenant), sql/release.sql (END), sql/renew.sql and sql/claim.sql (fair share).
--
-- tenant_slots.surplus: a row beyond a lowered cap (never claimed), as lease_slots.surplus is for
-- a credential. With more leases in flight than a lowered cap, the `cap` rows whose leases end
-- last stay within the cap and reopen when their leases end, with nothing to run; the others are
-- surplus. Rows over a lowered cap before this migration were all closed until a refit: they stay
-- closed (surplus) until the next fit ranks them.
ALTER TABLE tenant_slots ADD COLUMN surplus boolean NOT NULL DEFAULT false;
UPDATE tenant_slots SET surplus = true WHERE over_limit;

-- pool_waiters.tokens: the tokens a waiting request would reserve, so that a claim yields only to
-- a tenant whose windows have room for it.
ALTER TABLE pool_waiters ADD COLUMN tokens bigint NOT NULL DEFAULT 0;
