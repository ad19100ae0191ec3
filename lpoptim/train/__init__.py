"""A small GPT and a character-level text loader: the project's own demo and quality tests train these."""
