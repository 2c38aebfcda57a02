"""Bring your own problems: the problem-table schema (schema.py), readers for the common layouts (formats.py),
normalisation and the paper's integer filter (clean.py), duplicate removal (dedup.py), decontamination against the
evaluation suites (decontam.py), evaluation suite loaders (suites.py) and the import that chains them (importer.py)."""
