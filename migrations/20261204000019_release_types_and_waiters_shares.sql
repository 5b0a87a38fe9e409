-- The release in phases (sql/release.sql), and waiters of one credential.
--
-- credpool_release: one release of a call. Its first attributes are what the service sends, by
-- these names (the release reads them with jsonb_populate_recordset); the rest are what the
-- phases add.
CREATE TYPE credpool_release AS (
    lease_id            uuid,
    key_id              text,
    provider            text,
    pool                text,
    fence               bigint,
    outcome             text,
    usage_tokens        bigint,
    key_hash            text,
    retry_after_seconds integer,
    -- whether the reporter may take the credential out of traffic until an operator acts (absent:
    -- the configured internal key may, a tenant's key may not)
    may_disable         boolean,
    -- its place in the call
    n                   integer,
    -- the tenant of the key presented (NULL: no live key)
    tenant              text,
    -- the lease's slot row, locked, when the lease still sits in it
    slot                lease_slots,
    -- released, expired, mismatch, not_found, unauthorized
    verdict             text,
    -- the lease's grant time and what its usage changed in the token windows (usage - reservation)
    usage_at            timestamptz,
    usage_delta         bigint,
    -- whether its outcome counts for health, and the credential's health after it
    counted             boolean,
    health              credentials
);

-- Whether a waiting request takes part in fair share (other tenants yield a slot of the pool to
-- it): not a waiter of one credential (a strict affinity binding), nor one its own tenant's cap
-- or windows hold back. Every waiter is recorded, so that a release knows whether anyone waits
-- for its pool (it announces the freed slot only then).
ALTER TABLE pool_waiters ADD COLUMN shares boolean NOT NULL DEFAULT true;
