"""The rollout: the agent loop over vLLM engines (multi-turn, token-in/token-out, the Python tool), the
engines and their Ray clients, which engine runs which trajectory (scheduler, policies, kv_aware's
length estimator), the model's chat format and the check of each rollout's token stream against it, tool-call
parsing, and the actors' placement groups. How a rollout runs concurrently (threads that each own a queue, and the
engine actors' asyncio methods): docs/rollout.md."""
