-- Lease state defined once: tables only. Every SQL function, trigger function, trigger and view
-- lives from now on in the repeatable files of `sql/` (one current definition each, applied after
-- the versioned migrations whenever a file's content changes; `credpool_sql_files` records what
-- was applied). Versioned migrations keep to DDL and the data moves a schema change needs.

-- What the repeatable files were applied with: one row per file, its SHA-256 and when.
CREATE TABLE credpool_sql_files (
    name       text        NOT NULL,
    checksum   bytea       NOT NULL,
    -- the newest versioned migration of the binary that applied it
    migration  bigint      NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT credpool_sql_files_pkey PRIMARY KEY (name)
);

-- ---------------------------------------------------------------------------------------------
-- Gates on the locked row. Whether a slot may be claimed now depends only on the slot row itself,
-- the row the claim locks: `over_limit` (its credential had more leases in flight than a lowered
-- limit when its slots were last fit) and `draining` (an operator drained the credential) are
-- copies that credpool_fit_slots writes under every slot row's lock. A claim whose snapshot
-- predates the change and whose lock comes after it re-checks the changed row and passes over it.
ALTER TABLE lease_slots
    ADD COLUMN over_limit boolean NOT NULL DEFAULT false,
    ADD COLUMN draining boolean NOT NULL DEFAULT false;

UPDATE lease_slots s
SET over_limit = c.slots_over_limit, draining = c.draining
FROM credentials c
WHERE c.key_id = s.key_id AND (c.slots_over_limit OR c.draining);

-- The trigger's WHEN clause names slots_over_limit; sql/pools.sql creates it again without it.
DROP TRIGGER credentials_selection_changed ON credentials;
ALTER TABLE credentials DROP COLUMN slots_over_limit;

-- ---------------------------------------------------------------------------------------------
-- Request ids in a table of their own. A request_id names the lease its request was granted;
-- the lease is live while it holds its slot. Only claims write this table, each under the
-- transaction-scoped advisory lock of the request_id it writes, taken with a try-lock: a claim
-- never waits for another transaction here, and never writes a slot row it did not claim.
CREATE TABLE lease_requests (
    request_id     text        NOT NULL,
    -- SHA-256 (hex) of the parameters the request came with (computed by the service)
    request_digest text        NOT NULL,
    lease_id       uuid        NOT NULL,
    -- when the request_id was last granted a lease (retention of the rows)
    granted_at     timestamptz NOT NULL,
    CONSTRAINT lease_requests_pkey PRIMARY KEY (request_id),
    CONSTRAINT lease_requests_request_id_format CHECK (request_id ~ '^[A-Za-z0-9._:-]{1,128}$')
);

CREATE INDEX lease_requests_granted_at_idx ON lease_requests (granted_at);

INSERT INTO lease_requests (request_id, request_digest, lease_id, granted_at)
SELECT request_id, request_digest, lease_id, granted_at
FROM lease_slots
WHERE request_id IS NOT NULL;

ALTER TABLE lease_slots
    DROP CONSTRAINT lease_slots_request_with_lease,
    DROP COLUMN request_id,
    DROP COLUMN request_digest;

-- ---------------------------------------------------------------------------------------------
-- Pool versions without a shared row lock. A pool's version is the sum of its rows, one row per
-- database backend that ever changed the pool (`backend` = pg_backend_pid(); 0 holds the folded
-- counts of backends that have exited). A backend runs one transaction at a time, so only one
-- transaction ever locks a given row: bumping a version never waits, and transactions that change
-- several pools cannot deadlock on their versions whatever the order. Each committed bump adds
-- one, so the sum grows with every commit that changes the pool, in any commit order.
ALTER TABLE pool_versions ADD COLUMN backend integer NOT NULL DEFAULT 0;
ALTER TABLE pool_versions
    DROP CONSTRAINT pool_versions_pkey,
    ADD CONSTRAINT pool_versions_pkey PRIMARY KEY (provider, pool, backend);
