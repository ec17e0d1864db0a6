"""Training stages, each a thin layer over a TRL trainer: `sft` now; `reward` and `rl` later."""
