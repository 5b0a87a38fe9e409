"""credpool-client: lease upstream credentials from credpool.

An executor asks credpool for a credential, gets a *lease* (one concurrency slot of one
credential, renewed in the background while the work runs), and leaves the block to release it
with the outcome of the upstream call::

    from credpool import AsyncClient, PoolExhausted

    async with AsyncClient("http://127.0.0.1:8080", internal_key=KEY) as client:
        async with client.lease("openai", "gpt-4o", holder="worker-7", wait=5.0) as lease:
            api_key = lease.credential["api_key"]
            ...

``AsyncClient.from_env()`` takes the URL and key from ``CREDPOOL_URL`` and
``CREDPOOL_INTERNAL_KEY`` (:class:`MissingSetting` when the key is not set).
:class:`Client` is the synchronous twin. Errors are one class per API error code under
:class:`CredpoolError` (:mod:`credpool.errors`); :func:`outcome_for` turns an openai or
anthropic SDK exception into the outcome to report.
"""

from . import errors
from ._async import AsyncClient, AsyncLease
from ._lease import Credential, Lease, Released
from ._protocol import DEFAULT_LEASE_SECONDS, MAX_RETRY_AFTER_SECONDS, OUTCOMES, RetryPolicy
from ._sync import Client, SyncLease
from ._version import __version__
from .errors import *  # noqa: F403 - every error class, as errors.__all__ lists them
from .outcomes import Outcome, outcome_for, retry_after_of

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "MAX_RETRY_AFTER_SECONDS",
    "OUTCOMES",
    "AsyncClient",
    "AsyncLease",
    "Client",
    "Credential",
    "Lease",
    "Outcome",
    "Released",
    "RetryPolicy",
    "SyncLease",
    "__version__",
    "outcome_for",
    "retry_after_of",
]
__all__ += errors.__all__
