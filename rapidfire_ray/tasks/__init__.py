"""Tasks whose answers a program can check: the sample data's scorer, used by rule-based RL
rewards and by the pipeline's before/after comparison."""
from .answers import extract_answer, score_completion

__all__ = ["extract_answer", "score_completion"]
