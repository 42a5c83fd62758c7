"""The whole kvx conformance suite on this connector: alone, and composed with a Redis store."""

from kvx.conformance.kit import AllScenarios


class TestExampleConnector(AllScenarios):
    pass


class TestExampleWithRedisStore(AllScenarios):
    with_redis_store = True
    kvx_xfail = {
        "corrupted_bytes_detected": "the scenario flips bytes in files under {tmp}; a Redis "
        "store keeps none there (kvx's own tests corrupt Redis values)"
    }
