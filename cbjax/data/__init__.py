"""Data shipped with the package: a sample of the Azure LLM inference code trace (CC-BY 4.0)."""
