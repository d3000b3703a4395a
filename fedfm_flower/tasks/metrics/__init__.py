"""Evaluation metrics (ROUGE for generated text)."""
