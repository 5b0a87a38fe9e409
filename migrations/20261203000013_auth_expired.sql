-- `auth_expired` (issue 28): the outcome an executor reports when the provider rejected an OAuth
-- access token it leased. The report takes that token out of traffic at once and makes it due
-- for its refresh, but only if the lease holds the credential's current token: a lease granted
-- before the current generation began holds an older token, and its report says nothing about
-- the current one (sql/lease.sql, RELEASE).
ALTER TABLE lease_events
    DROP CONSTRAINT lease_events_outcome_known,
    ADD CONSTRAINT lease_events_outcome_known CHECK (
        outcome IS NULL
        OR outcome IN ('success', 'failure', 'rate_limited', 'auth_error', 'auth_expired',
                       'quota_exhausted'));

-- When the current generation's access token was written (a refresh, or an operator's PUT): a
-- lease granted at or after it holds that token (every such write moves config_version under
-- the credential's locks, so no claim grants the older token after the write commits). Rows of
-- before this migration: '-infinity', so that reports on today's leases count.
ALTER TABLE oauth_credentials ADD COLUMN generation_at timestamptz;
UPDATE oauth_credentials SET generation_at = '-infinity';
ALTER TABLE oauth_credentials
    ALTER COLUMN generation_at SET NOT NULL,
    ALTER COLUMN generation_at SET DEFAULT now();

-- `token_rejected`: an executor reported `auth_expired` on a lease of the current generation
-- (details: the generation and the lease; never a token).
ALTER TABLE credential_events
    DROP CONSTRAINT credential_events_event_known,
    ADD CONSTRAINT credential_events_event_known CHECK (
        event IN ('status_changed', 'probe_granted', 'cooldown_ended', 'created', 'updated',
                  'deleted', 'leases_released', 'secret_resealed', 'token_refreshed',
                  'token_refresh_failed', 'token_rejected'));
