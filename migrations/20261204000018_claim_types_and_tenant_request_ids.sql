-- The claim in phases (sql/claim.sql): the values a claim carries from phase to phase, and request
-- ids that belong to a tenant.
--
-- credpool_claim: one claim of a call. Its first attributes are what the service sends, by these
-- names (the claim reads them with jsonb_populate_recordset); the rest are what the phases add.
CREATE TYPE credpool_claim AS (
    ranked               text[],
    provider             text,
    pool                 text,
    model                text,
    lease_id             uuid,
    holder               text,
    lease_seconds        integer,
    tokens               bigint,
    request_id           text,
    request_digest       text,
    key_hash             text,
    windowed             boolean,
    affinity_key         text,
    affinity_pools       text[],
    affinity_ttl_seconds integer,
    affinity_mode        text,
    waiting              jsonb,
    -- its place in the call (the answer's `claim`)
    n                    integer,
    -- the key's tenant (NULL: no live key), whether the call holds its advisory lock in shared
    -- mode, whether it has a cap, whether it has windows, where its search of a free tenant slot
    -- row starts
    tenant               text,
    steady               boolean,
    capped               boolean,
    tenant_windowed      boolean,
    tenant_start         integer,
    pool_version         bigint,
    -- a waiting request's arrival and the end of its wait, on the claim's clock
    since                timestamptz,
    wait_until           timestamptz,
    -- its live affinity binding's credential, and whether strict confines it to that credential
    bound                text,
    bound_only           boolean,
    -- its answer when it was answered before any pick (unauthorized, busy, in_flight, replayed,
    -- conflict, yield), and the tenant a yield went to
    request              text,
    yield_to             text,
    -- for a claim that got nothing: whether its tenant's cap or windows hold it back, and when
    cap_full             boolean,
    cap_frees            timestamptz,
    window_full          boolean,
    window_frees         timestamptz
);

-- credpool_grant: a lease a call answers with (granted by a round, or replayed for its request
-- id): the claim, its slot row as granted, the sealed secret and the provider's model handed out,
-- and whether an expired lease was ended to make room.
CREATE TYPE credpool_grant AS (
    n              integer,
    s              lease_slots,
    secret         bytea,
    provider_model text,
    pruned         boolean
);

-- credpool_pick: a slot a round picked for a claim, locked: the claim, the slot row as locked
-- (with the expired lease it may still carry), what the grant and the answer need of its
-- credential, the clock read with the slot row, whether the credential has windows (its
-- lease_windows row is locked too), and the claim's tenant slot row and whether its tenant's
-- windows row is locked.
CREATE TYPE credpool_pick AS (
    n                integer,
    s                lease_slots,
    status           text,
    cooldown_until   timestamptz,
    at               timestamptz,
    secret           bytea,
    provider_model   text,
    token_expires_at timestamptz,
    windowed         boolean,
    tenant_slot      integer,
    tenant_windowed  boolean
);

-- Request ids belong to the tenant that presented them: the same request_id from two tenants is
-- two requests, and no answer tells one tenant about another's ids. The rows of live leases take
-- their lease's tenant; the others are free already (a retry would get a new lease).
ALTER TABLE lease_requests ADD COLUMN tenant text NOT NULL DEFAULT 'default';
UPDATE lease_requests r
SET tenant = s.tenant
FROM lease_slots s
WHERE s.key_id = r.key_id AND s.lease_id = r.lease_id AND s.tenant IS NOT NULL;
ALTER TABLE lease_requests
    DROP CONSTRAINT lease_requests_pkey,
    ADD CONSTRAINT lease_requests_pkey PRIMARY KEY (tenant, request_id),
    ALTER COLUMN tenant DROP DEFAULT;
