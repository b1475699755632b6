"""Quickstart data and tokenizer, written and built for packtool."""
