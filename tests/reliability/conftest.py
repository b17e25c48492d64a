"""Fixtures of the reliability tests: the service tests' private redis-server processes."""

from tests.services.conftest import (  # noqa: F401 (fixtures, found by pytest by name)
    private_redis,
    redis_server,
    redis_url,
    service_env,
)
