"""Mechanisms shared by several stages (models and tokenizers, the task, ...)."""
