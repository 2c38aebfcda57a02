"""Prefect flows: compose tasks/ into the RL step DAG, stages and the campaign. No algorithm code lives here."""
