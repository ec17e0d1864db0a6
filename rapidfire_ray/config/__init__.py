"""Config: one typed schema (`schema.py`) and its loader/validator (`load.py`)."""
from .load import load_config, parse_overrides, to_yaml, validate
from .schema import RapidfireConfig

__all__ = ["RapidfireConfig", "load_config", "parse_overrides", "to_yaml", "validate"]
