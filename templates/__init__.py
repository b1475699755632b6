"""Chat templates shipped with packtool (package data)."""
