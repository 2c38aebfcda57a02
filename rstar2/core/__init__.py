"""What every part of a run stands on: the config tree and presets, the run's directory (layout), atomic commits and
checkpoints, MLflow tracking, progress reporting, the weight bus and fingerprints that keep engines and trainer in
step, and the local network's addresses."""
