-- Conversation affinity (issue 30): a binding from an `affinity_key` (a conversation id the
-- executor chose) to the credential that last served it, because providers cache prompts per
-- account. A binding is a hint: the claim (sql/lease.sql, CLAIM, "AFFINITY") reads it and tries
-- the bound credential first under the same gates as any candidate, and writes it only for
-- affinity keys whose advisory try-lock it got, so no claim ever waits for a binding row.
--
-- Keyed by the pool the request asked for (a `vip` conversation served from `default` stays a
-- `vip` conversation). `tenant` is part of the key so that bindings can be scoped per tenant once
-- tenants exist (issue 29); until then every binding is the tenant 'default'.
-- The credential's delete removes its bindings (cascade, in the operator's transaction, after the
-- credential row: docs/design.md "Lock order"); a disable, drain, pool move or cooldown leaves the
-- row, and the next call finds the bound credential cannot serve and moves the binding.
CREATE TABLE affinity_bindings (
    tenant text NOT NULL DEFAULT 'default',
    provider text NOT NULL,
    pool text NOT NULL,
    affinity_key text NOT NULL,
    key_id text NOT NULL,
    bound_at timestamptz NOT NULL,
    last_hit_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    CONSTRAINT affinity_bindings_pkey PRIMARY KEY (tenant, provider, pool, affinity_key),
    CONSTRAINT affinity_bindings_key_id_fkey FOREIGN KEY (key_id)
        REFERENCES credentials (key_id) ON DELETE CASCADE,
    CONSTRAINT affinity_bindings_affinity_key_length CHECK (char_length(affinity_key) BETWEEN 1 AND 256),
    CONSTRAINT affinity_bindings_expiry_after_hit CHECK (expires_at > last_hit_at)
);

-- the maintenance pass purges expired bindings, oldest expiry first
CREATE INDEX affinity_bindings_expires_at_idx ON affinity_bindings (expires_at);
-- the cap on live bindings evicts the oldest last_hit_at first
CREATE INDEX affinity_bindings_last_hit_at_idx ON affinity_bindings (last_hit_at);
-- the cascade of a credential's delete finds its bindings without reading the table
CREATE INDEX affinity_bindings_key_id_idx ON affinity_bindings (key_id);

-- Each grant's affinity result, for the dashboard's hit ratio (across every replica, from the
-- trail): 'hit' (the bound credential served), 'new' (no live binding), 'moved' (a binding
-- existed, another credential served); NULL for a grant without an affinity_key and for every
-- other event. NOT VALID: every existing row is NULL, so there is nothing to scan the trail for.
ALTER TABLE lease_events ADD COLUMN affinity text;
ALTER TABLE lease_events
    ADD CONSTRAINT lease_events_affinity_known CHECK (affinity IN ('hit', 'new', 'moved')) NOT VALID;
