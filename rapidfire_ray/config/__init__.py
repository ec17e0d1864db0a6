"""Config: one typed schema (`schema.py`), its loader/validator (`load.py`) and the rules across
sections (`rules.py`)."""
from .load import from_plain, load_config, parse_overrides, to_yaml, validate
from .rules import is_elastic, worker_range
from .schema import RapidfireConfig

__all__ = ["RapidfireConfig", "from_plain", "is_elastic", "load_config", "parse_overrides", "to_yaml", "validate",
           "worker_range"]
