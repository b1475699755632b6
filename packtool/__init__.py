"""packtool: packed, contamination-free LLM training shards and a loader that keeps them exact."""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
