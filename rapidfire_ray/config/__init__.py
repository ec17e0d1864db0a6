"""Config: one typed schema (`schema.py`) and its loader/validator (`load.py`)."""
from .load import is_elastic, load_config, parse_overrides, to_yaml, validate, worker_range
from .schema import RapidfireConfig

__all__ = ["RapidfireConfig", "is_elastic", "load_config", "parse_overrides", "to_yaml", "validate", "worker_range"]
