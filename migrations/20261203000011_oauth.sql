-- OAuth credentials (issue 28): an access token that expires and a refresh token that rotates.
--
-- The access token is the credential's secret as executors receive it (`secret_ciphertext`
-- sealed {"access_token", "expires_at"}); its expiry is a column of the credential row, so the
-- claim can pass over a token that would expire before the lease ends (sql/lease.sql, CLAIM): a
-- refresh writes a new secret, which moves config_version like every change a claim decides on.
-- Everything else of the OAuth grant lives in its own row, which executors never see.
ALTER TABLE credentials ADD COLUMN token_expires_at timestamptz;

CREATE TABLE oauth_credentials (
    key_id                 text        NOT NULL,
    -- the token endpoint (RFC 6749 section 3.2): https, or http on a loopback address
    token_url              text        NOT NULL,
    client_id              text        NOT NULL,
    scope                  text,
    -- the refresh starts this many seconds before the access token expires
    refresh_before_seconds integer     NOT NULL DEFAULT 300,
    -- sealed {"refresh_token", "client_secret"?} (service/src/secrets.rs, associated data
    -- "<key_id>/oauth" so that it never opens as the executors' secret)
    refresh_ciphertext     bytea       NOT NULL,
    -- +1 per new access token (a refresh, or an operator's PUT of a new secret)
    generation             bigint      NOT NULL DEFAULT 1,
    -- the refresh in progress: who holds it and until when (a marker that expires, so a writer
    -- that died mid-call holds nobody up for long); no transaction stays open across the call
    refreshing_holder      uuid,
    refreshing_until       timestamptz,
    -- failed attempts of this generation in a row, and when the next one may start (backoff)
    failed_attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at        timestamptz NOT NULL DEFAULT '-infinity',
    -- the last failure, for operators (never a token): NULL after a successful refresh
    last_error             text,
    refreshed_at           timestamptz,
    CONSTRAINT oauth_credentials_pkey PRIMARY KEY (key_id),
    CONSTRAINT oauth_credentials_key_id_fkey FOREIGN KEY (key_id)
        REFERENCES credentials (key_id) ON DELETE CASCADE,
    CONSTRAINT oauth_credentials_refresh_before_range
        CHECK (refresh_before_seconds BETWEEN 0 AND 86400),
    CONSTRAINT oauth_credentials_generation_positive CHECK (generation >= 1),
    CONSTRAINT oauth_credentials_refreshing_pair
        CHECK ((refreshing_holder IS NULL) = (refreshing_until IS NULL))
);

-- The refresher's trail rows: `token_refreshed` and `token_refresh_failed`, with the generation in
-- `details` (never a token).
ALTER TABLE credential_events
    DROP CONSTRAINT credential_events_event_known,
    ADD CONSTRAINT credential_events_event_known CHECK (
        event IN ('status_changed', 'probe_granted', 'cooldown_ended', 'created', 'updated',
                  'deleted', 'leases_released', 'secret_resealed', 'token_refreshed',
                  'token_refresh_failed'));
