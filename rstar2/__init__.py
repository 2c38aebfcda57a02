"""rstar2, the library: the rStar2-Agent pipeline's parts, one folder per stage (no Prefect, no command line).

rollout/     the agent loop on vLLM engines, scheduling, chat format and tool calls
sandbox/     isolated execution of the model's Python
reward.py    the answer check (Math-Verify in the sandbox)
training/    GRPO-RoC, the trainer and its ranks, SFT, stage transitions and hard-sample mining
evaluation/  statistics, reports, entropy analysis, training health, `solve` and export
run/         config and presets, the run's layout and checkpoints, the controller of its actors, plan, tracking
data/        problem tables: layouts, cleaning, decontamination, suites
world/       the tiny world the embedded default makes for itself
"""
