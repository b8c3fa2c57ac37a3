"""Evaluation: held-out loss (``loss``: perplexity, bits per character/byte) and run comparison
tables (``compare``)."""
