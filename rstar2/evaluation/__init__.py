"""Measuring a policy: evaluation statistics over problems and seeds, reports and plots, the token
entropy analysis, training health and the collapse alert, looking at one trajectory (`solve`)
and exporting a model."""
