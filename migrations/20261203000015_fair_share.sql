-- Fair share of a saturated pool (issue 29): the allocations that wait for a slot, with their
-- tenant, on every replica, so that the claim of a waiting allocation can tell whether another
-- tenant, further below its weighted share of the pool (in-flight leases / weight), waits for the
-- same pool and model, and yield the slot to it (sql/lease.sql, credpool_fair_share_ahead).
--
-- A row is written by the claim of a waiting request that got nothing (and deleted by the claim
-- that grants it, or by its process when the wait ends), so a request that is served at once
-- never writes one. UNLOGGED: a row says "this request waits right now" and is worth nothing
-- after a crash or a failover (its request is gone, or writes it again at its next claim); its
-- writes need no WAL. A row is live while its process says it is alive
-- (`pool_waiter_processes.seen_at`, refreshed every second by a process with waiting requests:
-- one row per process, which no claim writes, so a claim never waits for it) and until its wait
-- ends (`until`).
CREATE UNLOGGED TABLE pool_waiters (
    waiter    uuid        NOT NULL,
    -- the service process that waits (its random name for itself)
    instance  text        NOT NULL,
    tenant    text        NOT NULL,
    provider  text        NOT NULL,
    -- the request's pool sequence (`vip` waits for `default` too)
    pools     text[]      NOT NULL,
    -- the model asked for (or the alias)
    model     text        NOT NULL,
    -- when the request arrived (ties between tenants of equal share go to the earliest)
    since     timestamptz NOT NULL,
    -- when its wait ends (its wait_ms)
    until     timestamptz NOT NULL,
    CONSTRAINT pool_waiters_pkey PRIMARY KEY (waiter)
);
CREATE INDEX pool_waiters_provider_model_idx ON pool_waiters (provider, model);
CREATE INDEX pool_waiters_instance_idx ON pool_waiters (instance);

-- The service processes with waiting requests, and when each last said so.
CREATE UNLOGGED TABLE pool_waiter_processes (
    instance  text        NOT NULL,
    seen_at   timestamptz NOT NULL,
    CONSTRAINT pool_waiter_processes_pkey PRIMARY KEY (instance)
);
