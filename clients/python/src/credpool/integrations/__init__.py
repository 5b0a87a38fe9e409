"""credpool inside tools its users already run: :mod:`credpool.integrations.litellm` (LiteLLM's
SDK, Router and Proxy). Each integration is imported on its own and needs its tool installed
(``pip install 'credpool-client[litellm]'``)."""
