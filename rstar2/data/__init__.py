"""Bring your own problems: the problem-table schema (schema.py), readers for the common layouts (formats.py),
normalisation and the paper's integer filter (clean.py), duplicate removal (dedup.py), decontamination against the
evaluation suites (decontam.py), evaluation suite loaders (suites.py) and the import that chains them (importer.py)."""

# The layouts formats.py reads, by name; declared here so that `rstar2 data import --help` lists them without loading
# polars (formats.FORMATS is this tuple).
FORMATS = ("verl", "dapo", "gsm8k", "solution", "plain", "choice")
