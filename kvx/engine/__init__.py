"""Engine hooks, the output aggregator and the reference engine."""

from kvx.engine.aggregator import KVOutputAggregator
from kvx.engine.engine import Engine, EngineConfig
from kvx.engine.hooks import LayerHooks, connector_forward, run_connector_step
from kvx.engine.model import ToyModel, prefix_hashes
from kvx.engine.scheduler import RequestOutput, Scheduler, SchedulerConfig

__all__ = [
    "Engine",
    "EngineConfig",
    "KVOutputAggregator",
    "LayerHooks",
    "RequestOutput",
    "Scheduler",
    "SchedulerConfig",
    "ToyModel",
    "connector_forward",
    "prefix_hashes",
    "run_connector_step",
]
