-- Selection layer: model aliases, credential health (decaying outcome counters, the failure
-- window, cooldown backoff, liveness), half-open probes, the trail of health transitions, late
-- outcome reports, and the pool version that tells a service's candidate view it is stale.

ALTER TABLE credentials
    -- request model name -> the provider's model name on this credential ({"gpt-4o": "gpt-4o-2024-08-06"});
    -- every target is one of `models`
    ADD COLUMN model_aliases jsonb NOT NULL DEFAULT '{}',
    -- why the status is what it is (an auth error's lease, an operator's note)
    ADD COLUMN status_reason text,
    -- Outcome counters that decay exponentially (half-life from the service's configuration), as
    -- of health_decayed_at. They feed the success rate and the error / rate-limit penalties.
    ADD COLUMN health_successes double precision NOT NULL DEFAULT 0,
    ADD COLUMN health_failures double precision NOT NULL DEFAULT 0,
    ADD COLUMN health_rate_limits double precision NOT NULL DEFAULT 0,
    ADD COLUMN health_decayed_at timestamptz,
    -- times of the most recent failures (at most the failure threshold), for the N-in-window rule
    ADD COLUMN recent_failures timestamptz[] NOT NULL DEFAULT '{}',
    -- cooldowns since the credential last recovered: the exponent of the cooldown backoff
    ADD COLUMN cooldowns_in_a_row integer NOT NULL DEFAULT 0,
    -- the last successful use (or probe): how fresh our evidence is that the credential works
    ADD COLUMN last_success_at timestamptz,
    -- when the credential last came back from a cooldown (its probe succeeded)
    ADD COLUMN recovered_at timestamptz,
    ADD CONSTRAINT credentials_model_aliases_is_object CHECK (jsonb_typeof(model_aliases) = 'object'),
    ADD CONSTRAINT credentials_health_counters_non_negative CHECK (
        health_successes >= 0 AND health_failures >= 0 AND health_rate_limits >= 0),
    ADD CONSTRAINT credentials_cooldowns_in_a_row_non_negative CHECK (cooldowns_in_a_row >= 0);

-- A probe lease: granted while the credential was recovering from a cooldown. Only slot 0 of a
-- recovering credential can be claimed, so at most one probe is in flight; the probe's outcome
-- decides whether full capacity returns.
ALTER TABLE lease_slots
    ADD COLUMN probe boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT lease_slots_probe_needs_lease CHECK (NOT probe OR lease_id IS NOT NULL);

-- `outcome_after_expiry`: the executor reported an outcome for a lease that had already expired;
-- it counts for health and releases nothing.
ALTER TABLE lease_events DROP CONSTRAINT lease_events_event_known;
ALTER TABLE lease_events ADD CONSTRAINT lease_events_event_known CHECK (
    event IN ('granted', 'renewed', 'released', 'expired', 'outcome_after_expiry'));

-- One report per lease: a lease is released at most once, and an outcome after expiry is counted
-- at most once, whatever executors retry.
CREATE UNIQUE INDEX lease_events_one_report_per_lease ON lease_events (lease_id)
    WHERE event IN ('released', 'outcome_after_expiry');

-- Health transitions of credentials (and, later, operator actions): append-only, never a secret.
CREATE TABLE credential_events (
    event_id       bigint      GENERATED ALWAYS AS IDENTITY,
    key_id         text        NOT NULL,
    -- status_changed: old_status -> new_status; probe_granted: a recovering credential got its
    -- single probe lease
    event          text        NOT NULL,
    old_status     text,
    new_status     text,
    reason         text        NOT NULL,
    cooldown_until timestamptz,
    -- the lease whose outcome (or grant) caused the event
    lease_id       uuid,
    at             timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT credential_events_pkey PRIMARY KEY (event_id),
    CONSTRAINT credential_events_event_known CHECK (event IN ('status_changed', 'probe_granted'))
);

CREATE INDEX credential_events_key_id_at_idx ON credential_events (key_id, at);

CREATE TRIGGER credential_events_append_only
    BEFORE UPDATE ON credential_events
    FOR EACH ROW EXECUTE FUNCTION lease_events_forbid_update();

-- `exhausted` with a cooldown_until (a quota report with retry_after) recovers on its own like
-- `rate_limited` and `cooldown`; without one it waits for an operator.
CREATE OR REPLACE FUNCTION credential_usable(status text, cooldown_until timestamptz, at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status = 'available'
        OR (status IN ('rate_limited', 'cooldown', 'exhausted')
            AND cooldown_until IS NOT NULL
            AND cooldown_until <= at)
$$;

CREATE OR REPLACE FUNCTION credential_recovers_at(status text, cooldown_until timestamptz, at timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN status IN ('rate_limited', 'cooldown', 'exhausted') AND cooldown_until > at THEN cooldown_until
    END
$$;

-- A counter per (provider, pool), bumped in the same transaction as any change to a credential of
-- the pool that alters who may be leased (membership, models, limit, status, cooldown). Each
-- service keeps a view of its pools' candidates; the claim statement returns the pool's version,
-- so a service learns that its view is stale from the statement it runs anyway. Occupancy and the
-- decaying health counters do not bump it: they only steer ranking, and a periodic refresh
-- catches up with them.
CREATE TABLE pool_versions (
    provider text   NOT NULL,
    pool     text   NOT NULL,
    version  bigint NOT NULL,
    CONSTRAINT pool_versions_pkey PRIMARY KEY (provider, pool)
);

CREATE FUNCTION credpool_bump_pool_version(p_provider text, p_pool text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO pool_versions AS v (provider, pool, version) VALUES (p_provider, p_pool, 1)
    ON CONFLICT ON CONSTRAINT pool_versions_pkey DO UPDATE SET version = v.version + 1
$$;

CREATE FUNCTION credentials_bump_pool_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM credpool_bump_pool_version(OLD.provider, OLD.pool);
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND (NEW.provider, NEW.pool) IS DISTINCT FROM (OLD.provider, OLD.pool)) THEN
        PERFORM credpool_bump_pool_version(NEW.provider, NEW.pool);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER credentials_membership_changed
    AFTER INSERT OR DELETE ON credentials
    FOR EACH ROW EXECUTE FUNCTION credentials_bump_pool_version();

CREATE TRIGGER credentials_selection_changed
    AFTER UPDATE ON credentials
    FOR EACH ROW
    WHEN ((OLD.provider, OLD.pool, OLD.models, OLD.model_aliases, OLD.max_concurrent_uses,
           OLD.status, OLD.cooldown_until, OLD.slots_over_limit)
          IS DISTINCT FROM
          (NEW.provider, NEW.pool, NEW.models, NEW.model_aliases, NEW.max_concurrent_uses,
           NEW.status, NEW.cooldown_until, NEW.slots_over_limit))
    EXECUTE FUNCTION credentials_bump_pool_version();

-- Existing pools start at version 1.
INSERT INTO pool_versions (provider, pool, version)
SELECT DISTINCT provider, pool, 1 FROM credentials
ON CONFLICT DO NOTHING;
