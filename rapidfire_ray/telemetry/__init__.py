"""Telemetry: measured step-phase timing, live progress, and the trainer callback that reports
steps and checkpoints to Ray."""
