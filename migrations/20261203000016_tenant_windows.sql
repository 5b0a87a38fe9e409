-- Tenant rate windows (issue 29): a tenant's limits on requests and tokens per interval over all
-- its credentials, counted like a credential's (the columns and the ring of buckets of
-- lease_windows; the arithmetic is sql/windows.sql's). Tables only; what uses them is in
-- sql/lease.sql (CLAIM, RELEASE, credpool_fit_tenant) and sql/audit.sql.
--
-- One row per tenant that has windows, and none for a tenant without: a claim probes this table
-- for its tenant and locks the row it finds (FOR UPDATE SKIP LOCKED) with its slot row, so the
-- state that decides whether the tenant's windows have room is on a row the claim locks, while a
-- tenant without windows makes its claims queue on nothing. A claim reads the table only after
-- it holds its tenant's advisory lock in shared mode (tried), which a change of the tenant takes
-- exclusively: a row written by a change is seen by every claim that could grant after it.
CREATE TABLE tenant_windows (
    tenant_id      text      NOT NULL,
    -- the tenant's rate_limits, one entry per window, in their order: kind, count, seconds
    window_kinds   text[]    NOT NULL DEFAULT '{}',
    window_counts  bigint[]  NOT NULL DEFAULT '{}',
    window_seconds integer[] NOT NULL DEFAULT '{}',
    -- window i's ring of 17 buckets: elements i * 17 + 1 .. (i + 1) * 17 (as in lease_windows)
    bucket_ids     bigint[]  NOT NULL DEFAULT '{}',
    bucket_charged bigint[]  NOT NULL DEFAULT '{}',
    CONSTRAINT tenant_windows_pkey PRIMARY KEY (tenant_id),
    CONSTRAINT tenant_windows_tenant_id_fkey FOREIGN KEY (tenant_id)
        REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    CONSTRAINT tenant_windows_shape CHECK (
        cardinality(window_counts) = cardinality(window_kinds)
        AND cardinality(window_seconds) = cardinality(window_kinds)
        AND cardinality(bucket_ids) = 17 * cardinality(window_kinds)
        AND cardinality(bucket_charged) = 17 * cardinality(window_kinds)
        AND cardinality(window_kinds) BETWEEN 1 AND 8),
    CONSTRAINT tenant_windows_kinds_known CHECK (window_kinds <@ ARRAY['requests', 'tokens'])
);

-- (Tenants given windows before they were enforced get their rows from sql/lease.sql, seeded from
-- the trail, once the functions that seed them exist.)

-- The tenant slot row a capped tenant's lease also sits in, on the lease's slot row: ending or
-- renewing the lease finds that row by its primary key (tenant_id, slot) rather than among every
-- row of the tenant (a cap of N meant reading N rows per release). sql/lease.sql fills it for the
-- leases in flight once the functions that keep it are in place (the ones before them, still in
-- place until then, neither set nor clear it; every probe of it matches the lease_id too, so a
-- stale value finds nothing).
ALTER TABLE lease_slots ADD COLUMN tenant_slot integer;
