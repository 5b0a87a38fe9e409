-- The claim's vocabulary: every word its answers can say, as enum types. The answers cast what
-- they return through these (so a word outside them fails the statement rather than reaching the
-- service), and the service's decoder is tested against every member of each.

-- What became of a claim that did not simply grant or miss (the `request` column of the answers).
CREATE TYPE credpool_claim_state AS ENUM (
    'replayed', 'conflict', 'in_flight', 'busy', 'unauthorized', 'tenant_limit', 'yield');

-- What holds back a claim that granted nothing (the `held_by` column): a credential's slots,
-- cooldown, windows or token refresh, or the caller's tenant (its cap, its windows).
CREATE TYPE credpool_held_by AS ENUM (
    'slots', 'cooldown', 'requests_window', 'tokens_window', 'token_refresh', 'tenant',
    'tenant_window');

-- What affinity made of a claim (the `affinity` column): the binding's result for a grant, or
-- 'bound' for a strict claim confined to its bound credential that granted nothing.
CREATE TYPE credpool_affinity_answer AS ENUM ('hit', 'new', 'moved', 'bound');
