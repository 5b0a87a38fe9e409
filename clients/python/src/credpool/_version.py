"""The package's version, in one place."""

__version__ = "0.1.0"

#: Sent as ``User-Agent`` with every request.
USER_AGENT = f"credpool-client-python/{__version__}"
