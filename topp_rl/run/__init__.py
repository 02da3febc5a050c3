"""The run around training: the run dir and its lock, checkpoints (single-file and sharded), the HF export,
signals, the console bar, loggers, sweep names, the end-of-run summary and host-memory settings."""
