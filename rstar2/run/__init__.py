"""A run's orchestration, above the library: the controller that owns its Ray actors and syncs the engines' weights,
the RL step's operations over URIs (steps), the preflight, the plan of whether it fits its hardware, where a campaign
stands (runstate), ablations, hard-sample mining and one trajectory shown turn by turn (solve)."""
