"""The whole kvx conformance suite on this connector: everything it claims (store_reuse,
store_pd), every dtype and block size of the matrix."""

from kvx.conformance.kit import AllScenarios


class TestExampleStore(AllScenarios):
    pass
