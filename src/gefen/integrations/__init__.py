"""Glue between Gefen's optimizers and training frameworks.

:mod:`gefen.integrations.transformers` builds Gefen optimizers for the Hugging Face ``Trainer`` and parses
``TrainingArguments.optim_args``. Importing this package (or that module) imports neither ``transformers`` nor
``accelerate``; they are imported by the functions that need them (``pip install gefen[hf]``).
"""
