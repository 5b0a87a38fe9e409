-- Hostile tenants (issue 42): what a tenant's executor key may reach.
--
-- `pools`: the providers and pools a tenant may lease from, as `provider/pool` patterns whose
-- halves are names or `*` (`openai/*`, `*/*`). Checked by the allocate handler from what the
-- key look-up returns, before any candidate is read (docs/src/security.md). A tenant created from
-- now on without `pools` may lease from nothing until an operator names its pools: a key that
-- leaks, or a tenant set up in a hurry, reaches nothing by default. Tenants that exist now keep
-- what they had (`*/*`), so the upgrade stops nobody's traffic; an operator scopes them with a
-- PUT that names their pools.
--
-- `reports_may_disable`: whether an outcome report of the tenant's leases alone may take a
-- credential out of traffic until an operator acts (`auth_error` disables; `quota_exhausted`
-- without `retry_after_seconds` rests it with no end). Without it, such a report rests the
-- credential for a bounded time (service/src/allocator/health.rs), so that one tenant cannot
-- disable every other tenant's credentials. Off for every tenant, existing ones included (their
-- reports then rest a credential instead of disabling it: nothing stops); `default`, the
-- configured internal key's tenant, keeps what the internal key always could (the handler gives
-- the internal key full reach without reading this row; the row says so for the admin API).
ALTER TABLE tenants
    ADD COLUMN pools text[] NOT NULL DEFAULT '{}',
    ADD COLUMN reports_may_disable boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT tenants_pools_count CHECK (cardinality(pools) <= 64);

UPDATE tenants SET pools = '{*/*}';
UPDATE tenants SET reports_may_disable = true WHERE tenant_id = 'default';

-- The trail of a tenant's configuration records the new settings with the others.
ALTER TABLE tenant_events
    ADD COLUMN pools text[],
    ADD COLUMN reports_may_disable boolean;
