"""A run: its config tree and presets, its directory (layout, atomic checkpoints, where it stands), the
controller that owns its Ray actors and syncs the engines' weights (weight_bus: by collective broadcast), the plan of whether it fits its hardware, the preflight, MLflow
tracking, progress reporting and the RL step's operations over URIs (steps)."""
